"""Draw one run's metrics.jsonl (written by dapo.py, one line per step) into a PNG, panels against step.

    python data/plot_run.py runs/cpu/metrics.jsonl                 # writes runs/cpu/metrics.png
    python data/plot_run.py runs/cpu/metrics.jsonl -o demo.png

Panels: training accuracy (and eval avg@k where logged), policy entropy, mean response length (and the
truncated fraction), clip fractions, step time (and its rollout and update parts), engine/trainer log-prob gap.
matplotlib is needed by this script only (pip install matplotlib). A missing or malformed file is one line on
stderr naming the file and the line, and exit code 1.
"""
import argparse
import json
import os
import sys

PANELS = [  # (title, [(key, label)]); eval/avg@k is found by prefix
    ("accuracy", [("reward/accuracy", "training (all samples)"), ("eval/avg@", "eval avg@k")]),  # y in [0, 1]
    ("policy entropy (nats/token)", [("loss/entropy", "entropy")]),
    ("response length (tokens)", [("rollout/response_len_mean", "mean"), ("rollout/response_len_max", "max")]),
    ("clipped fraction of loss tokens", [("loss/clip_frac_low", "low (A < 0)"), ("loss/clip_frac_high", "high (A > 0)")]),
    ("time (s)", [("perf/step_s", "step"), ("perf/rollout_s", "rollout"), ("perf/update_s", "updates")]),
    ("engine/trainer log-prob gap", [("rollout/engine_logp_gap", "mean |engine - trainer|")]),
]


def fail(msg):
    print(f"plot_run: {msg}", file=sys.stderr)
    sys.exit(1)


def read_metrics(path):
    """The file's lines as dicts, each with a numeric 'step'; any other content ends the script in one line."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        fail(f"{path}: cannot read: {e.strerror}")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.strip())
        except json.JSONDecodeError as e:
            fail(f"{path}:{n}: not a JSON line ({e.msg}, column {e.colno})")
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            fail(f"{path}:{n}: not a metrics line (a JSON object with a numeric 'step')")
        rows.append(row)
    if not rows:
        fail(f"{path}: no metrics lines")
    return rows


def series(rows, key):
    """(label key, steps, values) for key, or for every key starting with it (eval/avg@k)."""
    keys = sorted({k for r in rows for k in r if k == key or (key.endswith("@") and k.startswith(key))})
    return [(k, [r["step"] for r in rows if isinstance(r.get(k), (int, float))],
             [r[k] for r in rows if isinstance(r.get(k), (int, float))]) for k in keys]


def draw(rows, title, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5), constrained_layout=True)
    for ax, (name, keys) in zip(axes.flat, PANELS):
        for key, label in keys:
            for k, x, y in series(rows, key):
                ax.plot(x, y, "o-" if k.startswith("eval/") else "-", ms=4,
                        label=k.split("/")[-1] if key.endswith("@") else label)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        if name == "accuracy":
            ax.set_ylim(0, 1)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(out, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description="Draw a dapo run's metrics.jsonl into a PNG.")
    p.add_argument("metrics", help="metrics.jsonl written by dapo.py")
    p.add_argument("-o", "--out", help="PNG to write (default: the metrics file with .png)")
    p.add_argument("--title", help="figure title (default: the metrics file's path)")
    a = p.parse_args(argv)
    rows = read_metrics(a.metrics)  # before matplotlib: bad input fails fast, with or without it
    out = a.out or os.path.splitext(a.metrics)[0] + ".png"
    try:
        draw(rows, a.title or a.metrics, out)
    except ImportError:
        fail("matplotlib is not installed (pip install matplotlib)")
    except OSError as e:
        fail(f"{out}: cannot write: {e.strerror}")
    print(f"plot_run: {len(rows)} steps of {a.metrics} drawn in {out}")


if __name__ == "__main__":
    main()
