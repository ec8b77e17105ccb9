"""The trainer half of a DAPO step on one CUDA GPU, through dapo.py's own code, beside the memory
plan's prediction for the same shapes. Run by data/bench/gpu_check.sh (with the `-k cuda` tests);
needs only torch and transformers (no vLLM, no network).

    python data/bench/gpu_check.py            # one GPU: Qwen2.5-0.5B's shape (data/qwen2.5-0.5b)
    python data/bench/gpu_check.py --dry      # CPU: a tiny Qwen2, the same code (a test runs it)

For --offload_optimizer false and true: a randomly initialised model built from the config,
FSDP2-sharded (bf16 parameters on a GPU), activation checkpointing and the chunked LM head on;
two updates (policy_gradient + clip_and_step) on groups whose every row is the longest sequence,
so each micro-batch is the plan's one longest row. Printed per update mode: tokens/s of the
second update, the peak GPU memory of its gradient pass and of its AdamW step
(torch.cuda.max_memory_allocated), the plan's forward/backward and optimizer peaks
(`dapo.py --estimate_memory 1`), and their ratio. The last line is one JSON object.
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import dapo  # noqa: E402
import torch  # noqa: E402

TINY = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=1024,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def plan(flags):
    """The memory plan's phases for these flags, as `dapo.py --estimate_memory 1` gives them
    (called before the process group is up: the plan fakes its own GPU and process group)."""
    assert not torch.distributed.is_initialized()
    cfg = dapo.parse_config([*flags, "--estimate_memory", "1"])
    return dapo.load_memory_plan().estimate_memory(cfg, 1)["phases"]


def make_groups(cfg, vocab, n_groups):
    """n_groups groups of G samples, every row max_prompt_len + max_response_len tokens long,
    advantages of both signs."""
    generator = torch.Generator().manual_seed(0)
    R = cfg.max_response_len
    groups = []
    for i in range(n_groups):
        prompt = torch.randint(0, vocab, (cfg.max_prompt_len,), generator=generator).tolist()
        samples = []
        for j in range(cfg.group_size):
            ids = torch.randint(0, vocab, (R,), generator=generator).tolist()
            samples.append(dapo.Sample(ids=ids, finish="stop", engine_logp=[0.0] * R,
                                       adv=float(2 * (j % 2) - 1)))
        groups.append(dapo.Group(idx=i, pos=i, prompt_ids=prompt, answer="1", samples=samples))
    return groups


def peak_gib(layout):
    if layout.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def reset_peak(layout):
    if layout.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def one_mode(cfg, layout, config, groups):
    """Two updates; the second's tokens/s and phase peaks (the plan reports the step with AdamW
    state)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="sdpa")
    dapo.shard(model, cfg, layout).train()
    if not cfg.offload_optimizer:
        model.to(layout.device)
    optim = dapo.make_optimizer(model, cfg)
    micro = dapo.rank_micro_batches(groups, cfg, layout)
    denominators = dapo.loss_denominators(groups)
    tokens = sum(dapo.row_len(row) for rows in micro for row in rows)
    result = {}
    for _ in range(2):
        reset_peak(layout)
        start = time.time()
        dapo.policy_gradient(model, micro, denominators, cfg, layout, 0, True, {})
        result["gradient_peak_gib"] = peak_gib(layout)
        reset_peak(layout)
        result["grad_norm"] = dapo.clip_and_step(model, optim, cfg)
        result["optimizer_peak_gib"] = peak_gib(layout)
        result["tokens_per_s"] = round(tokens / (time.time() - start), 1)
    result["micro_batches"] = len(micro)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU, a tiny model (the test)")
    args = parser.parse_args()
    from transformers import AutoConfig
    folder = tempfile.mkdtemp()
    if args.dry:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(TINY, f)
        lengths = ["--max_prompt_len", "16", "--max_response_len", "48", "--micro_batch_tokens",
                   "64", "--overlong_buffer_len", "8"]
        n_groups = 2
    else:
        folder = os.path.join(ROOT, "data", "qwen2.5-0.5b")
        lengths = ["--max_prompt_len", "512", "--max_response_len", "3584",
                   "--micro_batch_tokens", "4096", "--overlong_buffer_len", "512"]
        n_groups = 2
    flags = ["--preset", "dapo", "--model", folder, "--rollout_tp", "1", "--group_size", "4",
             "--logp_chunk_tokens", "1024", *lengths]
    cfg = dapo.parse_config(flags)
    dapo.quiet_libraries()
    phases = {offload: plan([*flags, "--offload_optimizer", str(offload).lower()])
              for offload in (False, True)}
    config = AutoConfig.from_pretrained(folder)
    layout = dapo.init_distributed(cfg)
    groups = make_groups(cfg, config.vocab_size, n_groups)
    report = dict(device=str(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"),
                  model=os.path.basename(folder), tokens_per_row=cfg.max_prompt_len
                  + cfg.max_response_len, rows=n_groups * cfg.group_size, modes={})
    for offload in (False, True):
        mode_cfg = dataclasses.replace(cfg, offload_optimizer=offload)
        measured = one_mode(mode_cfg, layout, config, groups)
        planned = phases[offload]
        planned_gradient = max(planned["train.forward"]["Total"],
                               planned["train.backward"]["Total"])
        planned_optimizer = planned["train.optimizer"]["Total"]
        measured.update(plan_gradient_gib=planned_gradient, plan_optimizer_gib=planned_optimizer)
        if measured["gradient_peak_gib"] is not None:
            measured["gradient_ratio"] = round(measured["gradient_peak_gib"] / planned_gradient, 3)
            measured["optimizer_ratio"] = round(
                measured["optimizer_peak_gib"] / max(planned_optimizer, 1e-9), 3)
        report["modes"][f"offload_{str(offload).lower()}"] = measured
    print(f"{'mode':<15} {'tokens/s':>10} {'grad GiB':>9} {'plan':>7} {'opt GiB':>8} {'plan':>7}")
    for mode, m in report["modes"].items():
        cells = [m["gradient_peak_gib"], m["plan_gradient_gib"], m["optimizer_peak_gib"],
                 m["plan_optimizer_gib"]]
        cells = ["-" if c is None else f"{c:.2f}" for c in cells]
        print(f"{mode:<15} {m['tokens_per_s']:>10} {cells[0]:>9} {cells[1]:>7} {cells[2]:>8} "
              f"{cells[3]:>7}")
    print(json.dumps(report), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
