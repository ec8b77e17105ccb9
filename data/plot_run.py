"""Draw dapo runs' metrics.jsonl (a line a step) into one PNG, panels against step, runs overlaid.

    python data/plot_run.py runs/cpu                              # writes runs/cpu/metrics.png
    python data/plot_run.py runs/cpu runs/cpu-eps_high=0.2 -o fig.png
    python data/plot_run.py data/results/ablation/dapo_s1.jsonl -o demo.png

A run is a run folder (its metrics.jsonl) or a metrics JSONL file. Each run has one colour, and
the figure's legend names it: its folder, or the file's name when that is not metrics.jsonl. Within
a panel the line style tells its metrics apart (the panel's legend).

Panels: training accuracy (and eval avg@k where logged), policy entropy, mean response length (and
the longest), clip fractions, step time (and its rollout and update parts), engine/trainer log-prob
gap. matplotlib is needed by this script only (pip install matplotlib). A missing or malformed file
is one line on stderr naming the file and the line, and exit code 1.
"""
import argparse
import json
import os
import sys

# (title, [(key, label)]); eval/avg@k is found by its prefix
PANELS = [
    ("accuracy", [("reward/accuracy", "training (all samples)"), ("eval/avg@", "eval avg@k")]),
    ("policy entropy (nats/token)", [("loss/entropy", "entropy")]),
    ("response length (tokens)",
     [("rollout/response_len_mean", "mean"), ("rollout/response_len_max", "max")]),
    ("clipped fraction of loss tokens",
     [("loss/clip_frac_low", "low (A < 0)"), ("loss/clip_frac_high", "high (A > 0)")]),
    ("time (s)",
     [("perf/step_s", "step"), ("perf/rollout_s", "rollout"), ("perf/update_s", "updates")]),
    ("engine/trainer log-prob gap", [("rollout/engine_logp_gap", "mean |engine - trainer|")]),
]
# The first metric of a panel is drawn solid, the second dashed, the third dotted.
LINE_STYLES = ["-", "--", ":"]


def fail(msg):
    print(f"plot_run: {msg}", file=sys.stderr)
    sys.exit(1)


def metrics_path(run):
    """A run folder's metrics.jsonl, or the file itself."""
    if os.path.isdir(run):
        return os.path.join(run, "metrics.jsonl")
    return run


def run_name(path):
    """The legend's name of a run: its folder, or the file's name if not metrics.jsonl."""
    folder, filename = os.path.split(os.path.abspath(path))
    if filename == "metrics.jsonl":
        return os.path.basename(folder)
    return os.path.splitext(filename)[0]


def read_metrics(path):
    """The file's lines as dicts, each with a numeric 'step'; anything else ends the script."""
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
    """[(key found, steps, values)] for key, or for every key starting with it (eval/avg@k)."""
    if key.endswith("@"):
        keys = sorted({k for row in rows for k in row if k.startswith(key)})
    else:
        keys = [key]
    found = []
    for k in keys:
        logged = [row for row in rows if isinstance(row.get(k), (int, float))]
        if logged:
            found.append((k, [row["step"] for row in logged], [row[k] for row in logged]))
    return found


def draw(runs, title, out):
    """runs: [(name, rows)]. Colour C0, C1, ... is the run; the line style is the metric."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    fig, axes = plt.subplots(2, 3, figsize=(14, 8), constrained_layout=True)
    for ax, (panel, keys) in zip(axes.flat, PANELS):
        # metric label -> (line style, marker), for the panel's legend
        drawn = {}
        for style, (key, label) in zip(LINE_STYLES, keys):
            for colour, (_, rows) in enumerate(runs):
                for k, steps, values in series(rows, key):
                    marker = ""
                    if k.startswith("eval/"):
                        marker = "o"
                    ax.plot(steps, values, color=f"C{colour}", ls=style, marker=marker, ms=4)
                    if key.endswith("@"):
                        drawn[k.split("/")[-1]] = (style, marker)
                    else:
                        drawn[label] = (style, marker)
        if drawn:
            handles = [Line2D([], [], color="grey", ls=ls, marker=mk) for ls, mk in drawn.values()]
            ax.legend(handles, list(drawn), fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        if panel == "accuracy":
            ax.set_ylim(0, 1)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    run_handles = [Line2D([], [], color=f"C{colour}", lw=2) for colour in range(len(runs))]
    run_names = [name for name, _ in runs]
    fig.legend(run_handles, run_names, loc="outside lower center", ncols=min(len(runs), 5))
    fig.suptitle(title)
    fig.savefig(out, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Draw dapo runs' metrics.jsonl into one PNG.")
    parser.add_argument("runs", nargs="+", help="run folders (their metrics.jsonl) or JSONL files")
    parser.add_argument("-o", "--out", help="PNG to write (default: the first metrics file, .png)")
    parser.add_argument("--title", help="figure title (default: the runs as given)")
    args = parser.parse_args(argv)
    paths = [metrics_path(run) for run in args.runs]
    # Read before importing matplotlib: bad input fails fast, with or without it.
    runs = [(run_name(path), read_metrics(path)) for path in paths]
    out = args.out or os.path.splitext(paths[0])[0] + ".png"
    title = args.title or ", ".join(args.runs)
    try:
        draw(runs, title, out)
    except ImportError:
        fail("matplotlib is not installed (pip install matplotlib)")
    except OSError as e:
        fail(f"{out}: cannot write: {e.strerror}")
    drawn = ", ".join(f"{name} ({len(rows)} steps)" for name, rows in runs)
    print(f"plot_run: {drawn} drawn in {out}")


if __name__ == "__main__":
    main()
