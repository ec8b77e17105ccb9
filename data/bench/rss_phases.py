"""Where a CPU run's resident memory goes, phase by phase and step by step (README, "Memory from step to step").

Runs dapo.main with the given flags while a thread samples, every 25 ms, the process's resident memory and
glibc's heap counters (mallinfo2: bytes in use and bytes free inside the heap). Each sample is tagged with the
phase the run is in: rollout, forward, backward, clip, optimizer, push, eval, other. Writes one JSONL row per
(step, phase) with the peaks, and prints the table. Heap in use that grows from step to step is memory kept;
resident memory that grows while the heap in use does not is memory freed inside the heap but not reusable
(fragmentation).

    python data/bench/rss_phases.py OUT.jsonl --train_data data/demo_train_template.jsonl ... --steps 10
"""
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch  # noqa: E402

import dapo  # noqa: E402
from shape_caches import libc  # noqa: E402  glibc, its mallinfo2 returning the struct

PAGE, GiB = os.sysconf("SC_PAGESIZE"), 2 ** 30
state = dict(step=1, phase="other")
peaks = {}  # (step, phase) -> {rss, heap_used, heap_free, mmapped}


def sample():
    while True:
        rss = int(open("/proc/self/statm").read().split()[1]) * PAGE
        mi = libc.mallinfo2()
        row = peaks.setdefault((state["step"], state["phase"]), dict(rss=0, heap_used=0, heap_free=0, mmapped=0))
        for k, v in (("rss", rss), ("heap_used", mi.uordblks), ("heap_free", mi.fordblks), ("mmapped", mi.hblkhd)):
            row[k] = max(row[k], v / GiB)
        time.sleep(0.025)


def tagged(fn, phase, after=None):
    def run(*a, **k):
        state["phase"] = phase
        try:
            return fn(*a, **k)
        finally:
            state["phase"] = after or "other"
    return run


dapo.generate = tagged(dapo.generate, "rollout")
dapo.token_logp = tagged(dapo.token_logp, "forward", after="backward")  # the loss and backward follow it
dapo.push_weights = tagged(dapo.push_weights, "push")
dapo.evaluate = tagged(dapo.evaluate, "eval")
torch.nn.utils.clip_grad_norm_ = tagged(torch.nn.utils.clip_grad_norm_, "clip", after="optimizer")
_log = dapo.log_metrics


def log_metrics(cfg, logger, metrics):
    _log(cfg, logger, metrics)
    state["step"] = metrics["step"] + 1


dapo.log_metrics = log_metrics

if __name__ == "__main__":
    out = sys.argv[1]
    threading.Thread(target=sample, daemon=True).start()
    dapo.main(sys.argv[2:])
    phases = ["rollout", "forward", "backward", "clip", "optimizer", "push", "eval", "other"]
    with open(out, "w") as f:
        for (step, phase), row in sorted(peaks.items(), key=lambda kv: (kv[0][0], phases.index(kv[0][1]))):
            f.write(json.dumps(dict(step=step, phase=phase, **{k: round(v, 3) for k, v in row.items()})) + "\n")
    print(f"peak resident GiB by step and phase (heap in use / free inside the heap at their peaks); {out}")
    print("step " + "".join(f"{p:>20}" for p in phases))
    for step in sorted({s for s, _ in peaks}):
        cells = [peaks.get((step, p)) for p in phases]
        print(f"{step:>4} " + "".join(f"{'-':>20}" if c is None else
                                      f"{c['rss']:>6.2f} ({c['heap_used']:.2f}/{c['heap_free']:.2f})" .rjust(20)
                                      for c in cells))
