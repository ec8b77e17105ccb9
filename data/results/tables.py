"""The README's results tables, in markdown, from the committed runs under data/results/<cpu-kind>/.

    python data/results/tables.py                     # the results tables (README, "Results"), then Table 1 at CPU scale
    python data/results/tables.py RUN.jsonl           # one run, step by step

Each <cpu-kind>/ folder holds the runs' metrics JSONL (one line per step, written by dapo.py) and command.txt:
its '# cpu:' line names the CPU (lscpu model and flags), its other lines say how each run was made.
"""
import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load(path):
    """A run's training steps (step 0, the evaluation before training, has no rollout)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if "reward/accuracy" in row]


def cpu_name(folder):
    """The CPU its command.txt names; an experiment's folder (ablation/...) goes by its name."""
    if not os.path.exists(os.path.join(folder, "command.txt")):
        return os.path.basename(folder)
    with open(os.path.join(folder, "command.txt")) as f:
        return next((line[len("# cpu:"):].strip() for line in f if line.startswith("# cpu:")), os.path.basename(folder))


def evals(ms):
    return ", ".join(f"{v:.3f} (step {m['step']})" for m in ms for k, v in m.items() if k.startswith("eval/avg@"))


def summary(folder):
    """One row per run: accuracy over the first and the last 5 steps, eval avg@k, step time, memory, clipping."""
    root = os.path.dirname(os.path.dirname(HERE))
    rows = [f"{cpu_name(folder)} (`{os.path.relpath(folder, root)}/`):", "",
            "| run | steps | accuracy, first 5 -> last 5 steps | eval avg@k (step) | median step s "
            "| peak RSS GB (metrics) | steps with high clip > 0 |", "|" + " --- |" * 7]
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        ms = load(path)
        acc = [m["reward/accuracy"] for m in ms]
        rows.append(
            f"| `{os.path.basename(path)}` "
            f"| {len(ms)} | {statistics.mean(acc[:5]):.3f} -> {statistics.mean(acc[-5:]):.3f} | {evals(ms)} "
            f"| {statistics.median(m['perf/step_s'] for m in ms):.1f} "
            f"| {max(m.get('perf/peak_rss_gb', 0) for m in ms):.1f} "
            f"| {sum(m.get('loss/clip_frac_high', 0) > 0 for m in ms)} of {len(ms)} |")
    return "\n".join(rows)


def seeds(folder):
    """Runs named NAME_s<seed>.jsonl, mean ± sd over their seeds (README, "The CPU demo")."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "*_s[0-9]*.jsonl"))):
        runs.setdefault(os.path.basename(path).rsplit("_s", 1)[0], []).append(load(path))
    if not runs:
        return ""

    def ms(xs):
        return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.3f}"
    rows = [f"Mean ± sd over seeds, `{os.path.relpath(folder, os.path.dirname(os.path.dirname(HERE)))}/`:", "",
            "| runs | seeds | accuracy, first 5 steps | last 5 steps | eval avg@k, last eval | steps with high clip > 0 "
            "| median step s |", "|" + " --- |" * 7]
    for name, rs in runs.items():
        acc = [[m["reward/accuracy"] for m in r] for r in rs]
        last_eval = [[v for m in r for k, v in m.items() if k.startswith("eval/avg@")][-1] for r in rs]
        rows.append(f"| `{name}_s*` | {len(rs)} | {ms([statistics.mean(a[:5]) for a in acc])} "
                    f"| {ms([statistics.mean(a[-5:]) for a in acc])} | {ms(last_eval)} "
                    f"| {', '.join(str(sum(m.get('loss/clip_frac_high', 0) > 0 for m in r)) for r in rs)} of "
                    f"{len(rs[0])} | {statistics.median(m['perf/step_s'] for r in rs for m in r):.1f} |")
    return "\n".join(rows)


def memory(folder):
    """The memory profile: peak and end-of-step resident memory (GiB) of 10-step runs, by step."""
    rows = [f"Memory, `{os.path.relpath(folder, os.path.dirname(os.path.dirname(HERE)))}/`:", "",
            "| run | perf/peak_rss_gb at steps 1, 2, 5, 10 | its highest after step 2 | resident at the end of steps 1, "
            "2, 5, 10 | median step s |", "|" + " --- |" * 5]
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        ms = {m["step"]: m for m in load(path)}
        at = [s for s in (1, 2, 5, 10) if s in ms]
        rows.append(f"| `{os.path.basename(path)}` | " + ", ".join(f"{ms[s]['perf/peak_rss_gb']:.2f}" for s in at)
                    + f" | {max(m['perf/peak_rss_gb'] for s, m in ms.items() if s > 2):.2f}"
                    + " | " + ", ".join(f"{ms[s]['perf/rss_gb']:.2f}" for s in at)
                    + f" | {statistics.median(m['perf/step_s'] for m in ms.values()):.1f} |")
    return "\n".join(rows)


def steps(path):
    """One run step by step."""
    cols = [("reward/accuracy", "accuracy", 3), ("dynamic_sampling/kept_groups", "kept groups", 0),
            ("dynamic_sampling/rounds", "rounds", 0), ("rollout/response_len_mean", "mean length", 1),
            ("rollout/truncated_frac", "truncated", 2), ("loss/entropy", "entropy", 2),
            ("loss/clip_frac_low", "clip low", 4), ("loss/clip_frac_high", "clip high", 4),
            ("perf/rollout_s", "rollout s", 1), ("perf/old_logp_s", "old log-probs s", 1),
            ("perf/update_s", "updates s", 1), ("perf/step_s", "step s", 1)]
    ms = load(path)
    k_eval = sorted({k for m in ms for k in m if k.startswith("eval/avg@")})
    rows = ["| step | " + " | ".join(c[1] for c in cols) + "".join(f" | {k[5:]}" for k in k_eval) + " |",
            "|" + " --- |" * (1 + len(cols) + len(k_eval))]
    for m in ms:
        cells = [f"{m[k]:.{d}f}" if k in m else "" for k, _, d in cols] + [f"{m[k]:.3f}" if k in m else ""
                                                                           for k in k_eval]
        rows.append(f"| {m['step']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(steps(sys.argv[1]))
    else:
        for folder in sorted(glob.glob(os.path.join(HERE, "*", "command.txt"))):
            print(summary(os.path.dirname(folder)) + "\n")
            by_seed = seeds(os.path.dirname(folder))
            if by_seed:
                print(by_seed + "\n")
            if os.path.isdir(os.path.join(os.path.dirname(folder), "memory")):
                print(memory(os.path.join(os.path.dirname(folder), "memory")) + "\n")
        # the experiments (ablation/, clip_higher/, random_reward/, each with its run.sh): a row a run
        for run_sh in sorted(glob.glob(os.path.join(HERE, "*", "run.sh"))):
            print(summary(os.path.dirname(run_sh)) + "\n")
        sys.path.insert(0, os.path.join(HERE, "ablation"))
        import plot  # data/results/ablation/plot.py: Table 1 at CPU scale
        print(plot.table(plot.load(plot.HERE)))
