"""Clip-Higher against entropy collapse with random rewards (data/results/random_reward/run.sh).

    python data/results/random_reward/plot.py   # the table; draws random_reward.png beside it

Reads data/results/random_reward/<config>_s<seed>.jsonl (one metrics line a step, from dapo.py).
With rewards that carry no information, entropy can only move through the clip bounds; the table
gives each setting's entropy at step 1 and over the last 3 steps (mean ± sd over seeds), its change,
the clipped fractions of loss tokens, and the mean pi_old of the upper-clipped tokens against that
of all loss tokens (the paper's Figure 3a).
"""

import importlib.util
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
BOUNDS = {
    "eps_high_0.2": "symmetric [0.8, 1.2]",
    "eps_high_0.28": "Clip-Higher [0.8, 1.28]",
    "eps_high_0.4": "[0.8, 1.4]",
    "eps_low_0.1": "lower 0.1: [0.9, 1.2]",
}
# with the demo's soft overlong penalty (Eq. 13), then without it (the coin flip alone)
GROUPS = {"with the overlong penalty": "", "without it (coin flip alone)": "no_penalty_"}
ORDER = [prefix + name for prefix in GROUPS.values() for name in BOUNDS]
LABELS = {prefix + name: label + (", no penalty" if prefix else "")
          for prefix in GROUPS.values() for name, label in BOUNDS.items()}


def load():
    """Runs by config and seed, read by data/results/ablation/plot.py's loader."""
    spec = importlib.util.spec_from_file_location(
        "ablation_plot", os.path.join(HERE, "..", "ablation", "plot.py")
    )
    ablation_plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation_plot)
    return ablation_plot.load(HERE)


def fmt(values, digits=3):
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def table(runs):
    rows = [
        "| setting | seeds | entropy, step 1 | entropy, last 3 steps | change | clip low "
        "| clip high | pi_old of upper-clipped | pi_old of all loss tokens |",
        "|" + " --- |" * 9,
    ]
    for name in [n for n in ORDER if n in runs]:
        seeds = list(runs[name].values())
        first = [ms[0]["loss/entropy"] for ms in seeds]
        last = [statistics.mean(m["loss/entropy"] for m in ms[-3:]) for ms in seeds]
        change = [b - a for a, b in zip(first, last)]

        def over_steps(key, seeds=seeds):
            return [statistics.mean(m[key] for m in ms) for ms in seeds]

        cells = [
            fmt(first),
            fmt(last),
            fmt(change),
            fmt(over_steps("loss/clip_frac_low"), 4),
            fmt(over_steps("loss/clip_frac_high"), 4),
            fmt(over_steps("loss/clip_high_prob")),
            fmt(over_steps("loss/token_prob")),
        ]
        rows.append(f"| {LABELS[name]} | {len(seeds)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("loss/entropy", "policy entropy (nats/token)"),
        ("loss/clip_frac_high", "upper-clipped fraction (A > 0)"),
        ("loss/clip_frac_low", "lower-clipped fraction (A < 0)"),
    ]
    groups = {title: prefix for title, prefix in GROUPS.items()
              if any(name.startswith(prefix) and name in runs for name in ORDER if prefix)
              or not prefix}
    fig, axes = plt.subplots(len(groups), len(panels), figsize=(5 * len(panels), 4 * len(groups)),
                             squeeze=False)
    for row, (group, prefix) in enumerate(groups.items()):
        names = [prefix + name for name in BOUNDS if prefix + name in runs]
        for ax, (key, title) in zip(axes[row], panels):
            for name in names:
                seeds = list(runs[name].values())
                steps = [m["step"] for m in seeds[0]]
                by_step = [[ms[i][key] for ms in seeds] for i in range(len(steps))]
                mean = [statistics.mean(v) for v in by_step]
                label = f"{BOUNDS[name[len(prefix):]]} ({len(seeds)} seeds)"
                line = ax.plot(steps, mean, label=label)[0]
                low = [min(v) for v in by_step]
                high = [max(v) for v in by_step]
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
            ax.set_title(f"{title}, {group}", fontsize=9)
            ax.set_xlabel("step")
        axes[row][0].legend(fontsize=8)
    fig.suptitle("Random rewards (+-1, p = 1/2): what the clip bounds alone do; mean, min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    runs = load()
    print(table(runs))
    plot(runs, os.path.join(HERE, "random_reward.png"))
