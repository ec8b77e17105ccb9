"""The first GPU's check through dapo.py's own code, in two parts that data/bench/gpu_check.sh runs
(with the `-k cuda` tests); needs only torch and transformers (no vLLM, no `datasets`, no network).

    python3 data/bench/gpu_check.py                # the trainer half, Qwen2.5-0.5B's shape
    python3 data/bench/gpu_check.py --step         # a whole DAPO step: dapo.py, 2 steps, resumed
    python3 data/bench/gpu_check.py --offload      # the 24 GB path: dapo_1.5b's shapes, offloaded
    python3 data/bench/gpu_check.py --dry          # CPU, a tiny Qwen2: the same code (a test runs
    python3 data/bench/gpu_check.py --dry --step --offload   # these, without datasets and vLLM)

The trainer half, for --offload_optimizer false and true: a randomly initialised model built from
data/qwen2.5-0.5b's config, FSDP2-sharded (bf16 parameters on a GPU), activation checkpointing and
the chunked LM head on; two updates (policy_gradient + clip_and_step) on each of two batches:
- unpadded: every row the longest sequence, so each micro-batch is the plan's one longest row;
- padded: two rows of unequal lengths in each micro-batch, right-padded (a 4-D mask: SDPA cannot
  take its flash kernel), as a rollout's rows are.
Printed per mode and batch: tokens/s of the second update (real tokens, padding not counted), the
peak GPU memory of its gradient pass and of its AdamW step (torch.cuda.max_memory_allocated), the
memory plan's forward/backward and optimizer peaks (`dapo.py --estimate_memory 1`, for the
unpadded row) and the torch version. Each mode frees its model before the next, so each peak is
its own. The plan's tracker must skip the ops of DTensor's own fake mode: a line says when the
installed torch's does not (the plan's numbers may then differ).

The whole step (--step): a random model of the same config with data/tokenizer (the CPU demo's
tokenizer, small enough to carry), the demo's data and reward; dapo.py --engine transformers runs
step 1 and checkpoints it, then resumes for step 2 and evaluates. Printed: each step's metrics.
The last line of either part is one JSON object.
"""

import argparse
import dataclasses
import gc
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import dapo  # noqa: E402
import random_model  # noqa: E402 (beside this file)
import torch  # noqa: E402

TINY = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=1024,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)

# The whole step's flags, on the GPU: 2 updates a step (the pi_old pass), micro-batches of several
# rows, the LM head in chunks, an evaluation at step 2 only. No offload: it would copy every
# weight to the GPU for each sampled token (the trainer half runs offload). Dynamic sampling is
# off: a random model answers nothing, so every group is all wrong, Eq. 11 would keep none and the
# update would be skipped; without the filter every group trains (at zero advantage: the update's
# passes all run, its gradient is zero). The round flags act only with dynamic sampling.
STEP_FLAGS = ["--reward_mode", "last_number", "--prompts_per_step", "8", "--group_size", "4",
              "--gen_prompts_per_round", "16", "--max_gen_rounds", "2", "--max_prompt_len", "256",
              "--max_response_len", "64", "--overlong_buffer_len", "16",
              "--mini_batch_prompts", "4", "--micro_batch_tokens", "2048",
              "--logp_chunk_tokens", "128", "--eval_every", "2", "--eval_k", "2",
              "--eval_before_train", "false", "--save_every", "1", "--dynamic_sampling", "false",
              "--offload_optimizer", "false"]
# Evaluated on the first problems of data/demo_eval.jsonl: each is a generate call of its own.
EVAL_ROWS = 8
# The same on CPU, smaller.
STEP_FLAGS_DRY = ["--prompts_per_step", "4", "--group_size", "2", "--mini_batch_prompts", "2",
                  "--max_prompt_len", "64", "--max_response_len", "8", "--overlong_buffer_len", "2",
                  "--micro_batch_tokens", "128", "--logp_chunk_tokens", "8"]
EVAL_ROWS_DRY = 2
# The 24 GB path (--offload): dapo_1.5b's shapes (Qwen2.5-Math-1.5B's config, random
# weights), the optimizer in host memory, the transformers engine (the lent machine has no vLLM),
# one step of 16 prompts x 16 samples with responses cut to 256 tokens, 4 updates.
OFFLOAD_FLAGS = ["--reward_mode", "last_number", "--max_prompt_len", "1024",
                 "--max_response_len", "256", "--overlong_buffer_len", "64",
                 "--prompts_per_step", "16", "--group_size", "16", "--mini_batch_prompts", "4",
                 "--micro_batch_tokens", "8192", "--dynamic_sampling", "false",
                 "--eval_every", "0", "--save_every", "0", "--offload_optimizer", "true",
                 "--steps", "1"]
OFFLOAD_FLAGS_DRY = ["--max_prompt_len", "64", "--max_response_len", "8",
                     "--overlong_buffer_len", "2", "--prompts_per_step", "4", "--group_size", "2",
                     "--mini_batch_prompts", "2", "--micro_batch_tokens", "128"]
STEP_METRICS = ["step", "reward/accuracy", "dynamic_sampling/rounds", "loss/policy",
                "loss/grad_norm", "eval/avg@2", "perf/step_s", "perf/rollout_s"]


# --- The trainer half ---


def plan(flags):
    """The memory plan's phases for these flags, as `dapo.py --estimate_memory 1` gives them
    (called before the process group is up: the plan fakes its own GPU and process group), or
    the error that stopped it: the GPU's one run still measures what it can."""
    assert not torch.distributed.is_initialized()
    cfg = dapo.parse_args([*flags, "--estimate_memory", "1"])[0]
    try:
        return dapo.load_memory_plan().estimate_memory(cfg, 1)["phases"], None
    except Exception as e:  # noqa: BLE001 (reported in the output, and the measurement goes on)
        first_line = (str(e).splitlines() or [""])[0]
        return None, f"{type(e).__name__}: {first_line}"


def tracker_skips_nested_fake_mode():
    """Whether torch's FSDPMemTracker skips the ops run under a fake mode other than the one it
    was entered in: DTensor's sharding propagation runs in its own, on full-size scratch tensors,
    which the plan must not count. torch 2.13's tracker has this branch; older ones may not."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    return "_fake_mode_on_entry" in inspect.getsource(FSDPMemTracker)


def make_groups(cfg, vocab, n_groups, response_lens):
    """n_groups groups of G samples, each prompt max_prompt_len tokens, sample j's response
    response_lens[j % len(response_lens)] tokens; advantages of both signs."""
    generator = torch.Generator().manual_seed(0)
    groups = []
    for i in range(n_groups):
        prompt = torch.randint(0, vocab, (cfg.max_prompt_len,), generator=generator).tolist()
        samples = []
        for j in range(cfg.group_size):
            n = response_lens[j % len(response_lens)]
            ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
            samples.append(dapo.Sample(ids=ids, finish="stop", engine_logp=[0.0] * n,
                                       adv=float(2 * (j % 2) - 1)))
        groups.append(dapo.Group(idx=i, pos=i, prompt_ids=prompt, answer="1", samples=samples))
    return groups


def padded_micro_batches(groups):
    """Each group's samples in micro-batches of two rows, a long and a short one (its samples
    alternate), right-padded to the long one by collate."""
    micro = []
    for group in groups:
        rows = [dapo.Row(group.prompt_ids, [sample]) for sample in group.samples]
        micro += [rows[i : i + 2] for i in range(0, len(rows), 2)]
    return micro


def peak_gib(layout):
    if layout.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def reset_peak(layout):
    if layout.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def two_updates(model, optim, micro, groups, cfg, layout):
    """Two updates on the same micro-batches; the second's tokens/s and phase peaks (the plan
    reports the step with AdamW state)."""
    real = sum(dapo.row_len(row) for rows in micro for row in rows)
    padded = sum(len(rows) * max(map(dapo.row_len, rows)) for rows in micro)
    result = {}
    for _ in range(2):
        reset_peak(layout)
        start = time.time()
        dapo.policy_gradient(model, groups, micro, cfg, layout, 0, True, {})
        result["gradient_peak_gib"] = peak_gib(layout)
        reset_peak(layout)
        result["grad_norm"] = dapo.clip_and_step(model, optim, cfg)
        result["optimizer_peak_gib"] = peak_gib(layout)
        seconds = time.time() - start
    result["tokens_per_s"] = round(real / seconds, 1)
    result["padding_frac"] = round(1 - real / padded, 3)
    result["micro_batches"] = len(micro)
    return result


def one_mode(cfg, layout, config, batches):
    """One model and optimizer for one update mode, two updates on each batch; both freed after."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="sdpa")
    dapo.shard(model, cfg, layout).train()
    if not cfg.offload_optimizer:
        model.to(layout.device)
    optim = dapo.make_optimizer(model, cfg)
    results = {}
    for name, (groups, micro) in batches.items():
        if micro is None:
            micro = dapo.rank_micro_batches(groups, cfg, layout)
        results[name] = two_updates(model, optim, micro, groups, cfg, layout)
    # FSDP2's hooks hold the model in a reference cycle: without the collection its memory would
    # stay allocated into the next mode's peak.
    del model, optim
    gc.collect()
    if layout.device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak(layout)
    return results


def trainer_half(dry):
    from transformers import AutoConfig
    folder = os.path.join(ROOT, "data", "qwen2.5-0.5b")
    lengths = ["--max_prompt_len", "512", "--max_response_len", "3584",
               "--micro_batch_tokens", "4096", "--overlong_buffer_len", "512"]
    if dry:
        folder = tempfile.mkdtemp()
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(TINY, f)
        lengths = ["--max_prompt_len", "16", "--max_response_len", "48", "--micro_batch_tokens",
                   "64", "--overlong_buffer_len", "8"]
    n_groups = 2
    flags = ["--preset", "dapo", "--model", folder, "--rollout_tp", "1", "--group_size", "4",
             "--logp_chunk_tokens", "1024", *lengths]
    cfg = dapo.parse_args(flags)[0]
    dapo.quiet_libraries()
    phases = {}
    plan_errors = {}
    for offload in (False, True):
        phases[offload], plan_errors[offload] = plan([*flags, "--offload_optimizer",
                                                      str(offload).lower()])
    config = AutoConfig.from_pretrained(folder)
    layout = dapo.init_distributed(cfg)
    R = cfg.max_response_len
    unpadded = make_groups(cfg, config.vocab_size, n_groups, [R])
    # rows of half and three eighths of a micro-batch: 2 a micro-batch, 1/8 of it padding
    long_len = cfg.micro_batch_tokens // 2 - cfg.max_prompt_len
    short_len = cfg.micro_batch_tokens * 3 // 8 - cfg.max_prompt_len
    padded = make_groups(cfg, config.vocab_size, n_groups, [long_len, short_len])
    batches = {"unpadded": (unpadded, None), "padded": (padded, padded_micro_batches(padded))}
    device = "cpu"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    report = dict(device=device, torch=torch.__version__,
                  tracker_skips_nested_fake_mode=tracker_skips_nested_fake_mode(),
                  model=os.path.basename(folder), tokens_per_row=cfg.max_prompt_len + R,
                  rows=n_groups * cfg.group_size, modes={})
    for offload in (False, True):
        mode_cfg = dataclasses.replace(cfg, offload_optimizer=offload)
        measured = one_mode(mode_cfg, layout, config, batches)
        if phases[offload] is None:
            measured["unpadded"]["plan_error"] = plan_errors[offload]
        else:
            add_plan(measured["unpadded"], phases[offload])
        report["modes"][f"offload_{str(offload).lower()}"] = measured
    print_trainer_table(report)
    print(json.dumps(report), flush=True)
    torch.distributed.destroy_process_group()


def add_plan(measured, phases):
    """The plan's gradient-pass and optimizer peaks beside the measured ones, and their ratios."""
    planned_gradient = max(phases["train.forward"]["Total"], phases["train.backward"]["Total"])
    planned_optimizer = phases["train.optimizer"]["Total"]
    measured.update(plan_gradient_gib=planned_gradient, plan_optimizer_gib=planned_optimizer)
    if measured["gradient_peak_gib"] is None:
        return
    measured["gradient_ratio"] = round(measured["gradient_peak_gib"] / planned_gradient, 3)
    ratio = measured["optimizer_peak_gib"] / max(planned_optimizer, 1e-9)
    measured["optimizer_ratio"] = round(ratio, 3)


def print_trainer_table(report):
    skips = report["tracker_skips_nested_fake_mode"]
    print(f"torch {report['torch']} on {report['device']}; the plan's tracker skips DTensor's "
          f"fake-mode ops: {'yes' if skips else 'no'}")
    if not skips:
        print("  this torch's tracker may count DTensor's full-size scratch too: the plan's "
              "numbers were checked on a newer one (torch 2.13's) and may differ here")
    print(f"{'mode':<15} {'batch':<9} {'tokens/s':>10} {'pad':>5} {'grad GiB':>9} {'plan':>7} "
          f"{'opt GiB':>8} {'plan':>7}")
    for mode, rows in report["modes"].items():
        for batch in ("unpadded", "padded"):
            row = rows[batch]
            cells = [row["gradient_peak_gib"], row.get("plan_gradient_gib"),
                     row["optimizer_peak_gib"], row.get("plan_optimizer_gib")]
            cells = ["-" if c is None else f"{c:.2f}" for c in cells]
            print(f"{mode:<15} {batch:<9} {row['tokens_per_s']:>10} {row['padding_frac']:>5} "
                  f"{cells[0]:>9} {cells[1]:>7} {cells[2]:>8} {cells[3]:>7}")
        if "plan_error" in rows["unpadded"]:
            print(f"  {mode}: the memory plan failed: {rows['unpadded']['plan_error']}")


# --- The whole step: dapo.py itself, --engine transformers ---


def run_dapo(flags, timeout):
    """dapo.py in its own process, as a user runs it; its output, or a SystemExit with its end."""
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    # no network on the GPU machine: no hub look-ups, which would wait for their timeouts
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, os.path.join(ROOT, "dapo.py"), *flags]
    start = time.time()
    try:
        p = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        # what it printed before it was stopped (bytes, whatever text= said)
        printed = e.stderr or b""
        if isinstance(printed, bytes):
            printed = printed.decode(errors="replace")
        raise SystemExit(f"gpu_check: dapo.py {' '.join(flags)} ran past {timeout} s:\n"
                         f"{printed[-3000:]}") from None
    if p.returncode != 0:
        raise SystemExit(f"gpu_check: dapo.py {' '.join(flags)} exited {p.returncode}:\n"
                         f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p.stdout, round(time.time() - start, 1)


def random_policy(work, config_dir, dry):
    """A random model of config_dir's shape in work/model; dry: the tiny Qwen2 instead, with a
    vocabulary that holds the tokenizer's ids. Returns (the config's folder, the model's)."""
    if dry:
        config_dir = os.path.join(work, "tiny-qwen2")
        os.makedirs(config_dir)
        with open(os.path.join(config_dir, "config.json"), "w") as f:
            json.dump(dict(TINY, vocab_size=49152), f)
    return config_dir, random_model.write_random_model(config_dir, os.path.join(work, "model"))


def whole_step(dry, timeout):
    work = tempfile.mkdtemp()
    sizes = []
    eval_rows = EVAL_ROWS
    if dry:
        sizes = STEP_FLAGS_DRY
        eval_rows = EVAL_ROWS_DRY
    config_dir, model_dir = random_policy(work, os.path.join(ROOT, "data", "qwen2.5-0.5b"), dry)
    eval_data = os.path.join(work, "eval.jsonl")
    with open(os.path.join(ROOT, "data", "demo_eval.jsonl")) as f:
        rows = f.readlines()[:eval_rows]
    with open(eval_data, "w") as f:
        f.writelines(rows)
    out_dir = os.path.join(work, "run")
    flags = ["--model", model_dir, "--train_data", "data/demo_train.jsonl", "--eval_data",
             eval_data, "--out_dir", out_dir, "--engine", "transformers", *STEP_FLAGS, *sizes]
    _, first_s = run_dapo([*flags, "--steps", "1"], timeout)
    resumed, second_s = run_dapo([*flags, "--steps", "2", "--resume", "true"], timeout)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    saved = dapo.list_checkpoints(os.path.join(out_dir, "ckpt"))
    checkpoints = [os.path.basename(path) for path in saved]
    report = dict(torch=torch.__version__, model=os.path.basename(config_dir),
                  run_s=[first_s, second_s], resumed="resumed from" in resumed,
                  checkpoints=checkpoints,
                  steps=[{k: m[k] for k in STEP_METRICS if k in m} for m in steps])
    shutil.rmtree(work)
    print(f"whole step: dapo.py --engine transformers on a random {report['model']}, "
          f"{report['run_s'][0]} s + {report['run_s'][1]} s (resumed: {report['resumed']}), "
          f"checkpoints {', '.join(checkpoints)}")
    print(" ".join(f"{name.split('/')[-1]:>11}" for name in STEP_METRICS))
    for metrics in report["steps"]:
        cells = []
        for name in STEP_METRICS:
            value = metrics.get(name, "-")
            if isinstance(value, float):
                value = f"{value:.3f}"
            cells.append(f"{value:>11}")
        print(" ".join(cells))
    print(json.dumps(report), flush=True)


def offloaded_step(dry, timeout):
    """One step of the 24 GB path: rollout tokens/s, the update's seconds, and the plan's peak
    beside the measured torch.cuda.max_memory_allocated (perf/gpu_peak_gib; none on CPU)."""
    work = tempfile.mkdtemp()
    sizes = []
    if dry:
        sizes = OFFLOAD_FLAGS_DRY
    config_dir, model_dir = random_policy(work, os.path.join(ROOT, "data", "qwen2.5-math-1.5b"),
                                          dry)
    out_dir = os.path.join(work, "run")
    flags = ["--model", model_dir, "--train_data", "data/demo_train.jsonl", "--engine",
             "transformers", *OFFLOAD_FLAGS, *sizes]
    _, seconds = run_dapo([*flags, "--out_dir", out_dir], timeout)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f][-1]
    phases, error = plan(flags)
    report = dict(torch=torch.__version__, model=os.path.basename(config_dir), run_s=seconds,
                  rollout_tokens_per_s=metrics["perf/rollout_tokens_per_s"],
                  rollout_s=metrics["perf/rollout_s"], update_s=metrics["perf/update_s"],
                  updates=metrics["loss/updates"], grad_norm=metrics["loss/grad_norm"],
                  gpu_peak_gib=metrics.get("perf/gpu_peak_gib"), plan_error=error,
                  plan_peak_gib=None)
    if phases:
        report["plan_peak_gib"] = max(phase["Total"] for phase in phases.values())
        report["plan_rollout_gib"] = phases["rollout"]["Total"]
    shutil.rmtree(work)
    print(f"24 GB path: dapo.py --engine transformers, offloaded, on a random {report['model']}: "
          f"rollout {report['rollout_tokens_per_s']:.0f} tokens/s ({report['rollout_s']:.1f} s), "
          f"update {report['update_s']:.1f} s ({report['updates']} AdamW steps); GPU peak "
          f"{report['gpu_peak_gib']} GiB measured, {report['plan_peak_gib']} GiB planned")
    print(json.dumps(report), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU, a tiny model (the test)")
    parser.add_argument("--step", action="store_true", help="the whole step (dapo.py, 2 steps)")
    parser.add_argument("--offload", action="store_true",
                        help="the 24 GB path (1.5B shapes, offload, one step); after --step's")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per dapo.py run")
    args = parser.parse_args()
    if args.dry:
        # a tiny model: its ops are too small to share among threads (3 times faster on one
        # thread on 2 busy cores); dapo.py's processes inherit it
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    if args.step:
        whole_step(args.dry, args.timeout)
    if args.offload:
        offloaded_step(args.dry, args.timeout)
    if not (args.step or args.offload):
        trainer_half(args.dry)


if __name__ == "__main__":
    main()
