"""Where a run's wall time goes, by phase: dapo.main with the given flags, its set-up and each
step's work timed by wrapping dapo's own functions (nothing else changes). Writes one JSON object
and prints a table: start-up (imports, flags), model conversion (the demo's model, once), the
policy and data load, the engine's start, each evaluation, and per step its rollout, pi_old pass,
update, push and checkpoint.

    python data/bench/demo_phases.py OUT.json                  # plain `python dapo.py`
    python data/bench/demo_phases.py OUT.json --engine transformers
"""
import json
import os
import sys
import time

T0 = time.time()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dapo  # noqa: E402

PHASES = {
    "ensure_demo_model": "model conversion",
    "load_tokenizer": "policy and data load",
    "load_examples": "policy and data load",
    "load_policy": "policy and data load",
    "make_engine": "engine start",
    "evaluate": "evaluation",
    "generate": "rollout",
    "old_log_probs": "pi_old pass",
    "policy_gradient": "update",
    "clip_and_step": "update",
    "push_weights": "push",
    "save_checkpoint": "checkpoint",
}
totals = {}
steps = {}
state = {"step": 0, "inside": None}


def timed(name, fn):
    def run(*args, **kwargs):
        # the outermost phase counts (evaluation's generate is evaluation)
        if state["inside"] is not None:
            return fn(*args, **kwargs)
        state["inside"] = PHASES[name]
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds = time.time() - start
            phase = PHASES[name]
            totals[phase] = totals.get(phase, 0.0) + seconds
            per_step = steps.setdefault(state["step"], {})
            per_step[phase] = per_step.get(phase, 0.0) + seconds
            state["inside"] = None
    return run


# (an older dapo.py may lack a name: it is not timed)
for function_name in PHASES:
    if hasattr(dapo, function_name):
        setattr(dapo, function_name, timed(function_name, getattr(dapo, function_name)))
log_metrics = dapo.log_metrics


def logged(cfg, logger, metrics):
    log_metrics(cfg, logger, metrics)
    state["step"] = metrics["step"] + 1


dapo.log_metrics = logged

if __name__ == "__main__":
    out = sys.argv[1]
    start = time.time()
    dapo.main(sys.argv[2:])
    wall = time.time() - T0
    totals["start-up (imports, flags, processes)"] = wall - sum(totals.values())
    report = dict(wall_s=round(wall, 1), imports_s=round(start - T0, 1),
                  phases_s={k: round(v, 1) for k, v in sorted(totals.items())},
                  steps_s={step: {k: round(v, 2) for k, v in phases.items()}
                           for step, phases in sorted(steps.items())})
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wall {report['wall_s']} s; by phase:")
    for phase, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {phase:<40} {seconds:7.1f} s  {100 * seconds / wall:5.1f}%")
    sys.stdout.flush()
    # as dapo.py's own __main__ (vLLM's teardown at exit)
    if sys.modules.get("vllm") is None:
        os._exit(0)
