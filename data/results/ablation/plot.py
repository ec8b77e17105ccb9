"""Ablations at CPU scale, from committed runs (README, "Ablations"): Table 1 in
data/results/ablation/, Clip-Higher (Figure 2) in data/results/clip_higher/.

    python data/results/ablation/plot.py [FOLDER]

prints the README's table and draws FOLDER/<folder name>.png (FOLDER: this one by default).

Reads FOLDER/<config>_s<seed>.jsonl (one metrics line per step, written by dapo.py) and FOLDER/wall_s.tsv.
"""
import collections
import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = ["dapo", "no_clip_higher", "no_dynamic_sampling", "no_token_level_loss", "no_overlong_shaping", "grpo",
         "clip_higher", "symmetric"]
PANELS = [("reward/accuracy", "training accuracy"), ("loss/entropy", "policy entropy (nats/token)"),
          ("rollout/response_len_mean", "mean response length (tokens)"),
          ("loss/clip_frac_high", "upper-clipped fraction of loss tokens"),
          ("loss/clip_high_prob", "mean pi_old of upper-clipped tokens")]  # the last: runs that log it


def load(folder):
    runs = collections.defaultdict(dict)  # config -> seed -> [metrics per step]
    for path in sorted(glob.glob(os.path.join(folder, "*_s*.jsonl"))):
        name, seed = os.path.basename(path)[:-len(".jsonl")].rsplit("_s", 1)
        with open(path) as f:
            runs[name][int(seed)] = [json.loads(line) for line in f]
    return runs


def mean_sd(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(xs, digits=2):
    m, s = mean_sd(xs)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def table(runs):
    """Final figures, mean ± sd over seeds: training accuracy over the last 3 steps, eval avg@k at the
    last step, and the last 3 steps' entropy, length, truncation, clipping and dynamic-sampling figures."""
    def last3(ms, key):
        return statistics.mean(m[key] for m in ms[-3:] if key in m)

    def final_eval(ms):
        return next(v for m in reversed(ms) for k, v in m.items() if k.startswith("eval/avg@"))
    rows = ["| run | seeds | accuracy (last 3 steps) | eval avg@2 (last step) | entropy | length | truncated "
            "| clip low | clip high | zero-gradient groups | rounds |", "|" + " --- |" * 11]
    for name in [n for n in ORDER if n in runs]:
        seeds = runs[name].values()
        cells = [fmt([last3(ms, "reward/accuracy") for ms in seeds]), fmt([final_eval(ms) for ms in seeds])]
        cells += [fmt([last3(ms, k) for ms in seeds], d) for k, d in (
            ("loss/entropy", 2), ("rollout/response_len_mean", 1), ("rollout/truncated_frac", 2),
            ("loss/clip_frac_low", 4), ("loss/clip_frac_high", 4), ("dynamic_sampling/zero_grad_frac", 2),
            ("dynamic_sampling/rounds", 1))]
        rows.append(f"| {name} | {len(runs[name])} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def wall_time(folder):
    path = os.path.join(folder, "wall_s.tsv")
    if not os.path.exists(path):
        return ""
    secs = [int(line.split("\t")[2]) for line in open(path) if line.strip()]
    return f"{len(secs)} runs, {sum(secs) / 3600:.2f} h in all, {min(secs)}-{max(secs)} s each"


def figure(runs, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(k, label) for k, label in PANELS if any(k in m for seeds in runs.values() for ms in seeds.values()
                                                        for m in ms)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), constrained_layout=True)
    for ax, (key, label) in zip(axes, panels):
        for name in [n for n in ORDER if n in runs]:
            seeds = list(runs[name].values())
            steps = sorted({m["step"] for ms in seeds for m in ms})
            per_step = [[m[key] for ms in seeds for m in ms if m["step"] == s and key in m] for s in steps]
            steps, per_step = zip(*[(s, v) for s, v in zip(steps, per_step) if v])
            mean = [statistics.mean(v) for v in per_step]
            lo, hi = [min(v) for v in per_step], [max(v) for v in per_step]
            line, = ax.plot(steps, mean, label=f"{name} ({len(seeds)} seeds)",
                            lw=2 if name in ("dapo", "clip_higher") else 1.2)
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.12)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{title} at CPU scale (SmolLM2-135M, addition): mean over seeds, band = min-max")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    folder = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else HERE)
    runs, name = load(folder), os.path.basename(folder)
    print(table(runs))
    print(wall_time(folder))
    try:
        title = "Clip-Higher (eps_high 0.28) against symmetric clipping" if name == "clip_higher" else "DAPO ablations"
        print("figure:", figure(runs, os.path.join(folder, f"{name}.png"), title))
    except ImportError:
        print("matplotlib is not installed: no figure (pip install matplotlib)")
