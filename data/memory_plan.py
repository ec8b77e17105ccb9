"""The memory plan behind `python dapo.py ... --estimate_memory N`: a run's per-GPU memory by
phase, simulated without a GPU or weights.

The model is built from its config.json alone on fake tensors, sharded with dapo.py's own
`shard()` over a fake N-rank process group, and run for two training micro-steps of one longest
sequence (prompt + response limits) through FSDP2's `FSDPMemTracker`; the second step, the one
with AdamW state, is reported. The engine's share (`--engine_mem` of the GPU, by default from
what the trainer holds while it samples; or its weights and `--engine_kv_cache_gb`) is added for
the rollout phase and, unless it sleeps, for every phase.
Not counted, so keep 5-10% free: CUDA context, NCCL buffers, kernel workspaces, fragmentation.
With a process group already up (the tests' check on CPU) the same steps run on real tensors.

Also dapo.py's memory and layout machinery: the fit check from a model's config before any weight
is read, the engine sizes a model takes, and on CPU glibc's allocator settings and each step's
memory figures (each skipped where absent: macOS, Windows).
"""

import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dapo  # noqa: E402


def model_config(cfg):
    """The model's config.json from its folder or the hub; when the hub cannot be reached, the
    copy shipped in data/ under the hub id's name in lower case (data/qwen2.5-math-1.5b for
    Qwen/Qwen2.5-Math-1.5B), so a plan runs offline."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model)
    except OSError as e:
        shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                               os.path.basename(cfg.model.rstrip("/")).lower())
        if not os.path.exists(os.path.join(shipped, "config.json")):
            raise SystemExit(f"dapo: cannot read {cfg.model!r}'s config.json "
                             f"({str(e).splitlines()[0]}) and data/ ships no copy of it") from e
        print(f"dapo: {cfg.model} not reachable: planning with {shipped}/config.json", flush=True)
        return AutoConfig.from_pretrained(shipped)


def estimate_memory(cfg, n_gpus):
    """Per-GPU memory by phase and category on n_gpus GPUs, printed (the last line one JSON
    object). No GPU, no weights: fake tensors and a fake process group. With a process group
    already up (the CPU check in the tests): real tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    # registers the "fake" backend
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM, masking_utils

    t0 = time.time()
    fake = not dist.is_initialized()
    config = model_config(cfg)
    check_layout(config, cfg.rollout_tp, n_gpus)
    layout = dapo.Layout(rank=0, world=n_gpus, tp=cfg.rollout_tp, dp_rank=0,
                         n_dp=n_gpus // cfg.rollout_tp, device=torch.device("cpu"))
    # One longest row (validate: it fits micro_batch_tokens).
    T = cfg.max_prompt_len + cfg.max_response_len
    R = cfg.max_response_len
    response = torch.randint(0, config.vocab_size, (R,)).tolist()
    longest = dapo.Sample(ids=response, finish="stop", engine_logp=[0.0] * R, adv=1.0)
    batch = dapo.collate([dapo.Row([0] * (T - R), [longest])], 0, layout.device)
    with contextlib.ExitStack() as stack:
        # FSDP2's default mesh follows a visible GPU: keep it with the batch, on CPU.
        cpu = torch.device("cpu")
        stack.enter_context(mock.patch("torch._C._get_accelerator", return_value=cpu))
        if fake:
            dist.init_process_group("fake", rank=0, world_size=n_gpus, store=FakeStore())
            stack.callback(dist.destroy_process_group)
        # meta: no memory, no initialisation
        with torch.device("meta" if fake else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        # as on a GPU; outside fake mode (the mesh is real)
        dapo.shard(model, cfg, layout, bf16_params=cfg.bf16)
        if fake:
            # to_empty: meta -> fake
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            # DTensor's shape propagation reuses an ambient fake mode: the tracker would
            # count its full-size scratch.
            stack.enter_context(
                mock.patch(
                    "torch.distributed.tensor._sharding_prop.detect_fake_mode", return_value=None
                )
            )
            # transformers takes fake tensors for tracing (a [T, T] mask, repeated K/V):
            # skip the mask as a real run does.
            skip_mask = masking_utils._ignore_causal_mask_sdpa

            def skip_mask_untraced(padding_mask, *args, **kwargs):
                return skip_mask(None, *args, **kwargs)

            stack.enter_context(
                mock.patch.object(masking_utils, "_ignore_causal_mask_sdpa", skip_mask_untraced)
            )
            model.to_empty(device="cpu")
        model.train()
        optim = dapo.make_optimizer(model, cfg)
        tracker = FSDPMemTracker(model, optim)
        peaks = {}
        device = batch["ids"].device

        def mark(phase):
            """The peak since the last mark; then restart the running peak."""
            # garbage in reference cycles would otherwise enter the next phase's peak
            gc.collect()
            peaks[phase] = tracker.get_tracker_snapshot("peak")[device]
            tracker._peak_mem_snap = tracker.get_tracker_snapshot()
            tracker._peak_mem = {k: v["Total"] for k, v in tracker._peak_mem_snap.items()}

        with tracker:
            # the second step, the one with AdamW state, is reported
            for _ in range(2):
                logp = dapo.token_logp(model, batch, cfg.temperature, cfg.logp_chunk_tokens)[0]
                # policy_loss adds only (N, R)-sized tensors
                loss = -logp.mean()
                mark("train.forward")
                (loss * n_gpus).backward()
                mark("train.backward")
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optim.step()
                optim.zero_grad(set_to_none=True)
                mark("train.optimizer")
                # else the tracker refuses the next root forward
                tracker.reset_mod_stats()
            # rollout: what stays (sharded params, AdamW state) once the cache is emptied
            peaks["rollout"] = tracker.get_tracker_snapshot()[device]
    # CPUOffloadPolicy keeps these categories in host memory.
    on_host = ()
    if cfg.offload_optimizer:
        on_host = ("Sharded Param", "Sharded Grad", "OptState")
    # vLLM in each rank: gpu_memory_utilization is its whole share (bf16 weights / tp, KV
    # cache, scratch), by default what the trainer leaves on the GPU while it samples.
    rollout = {getattr(c, "value", c): v for c, v in peaks["rollout"].items() if c != "Total"}
    share = engine_share(cfg, sum(v for c, v in rollout.items() if c not in on_host),
                         cfg.gpu_gib * GiB)
    engine_weights = 2 * n_params / cfg.rollout_tp
    engine = share * cfg.gpu_gib * GiB
    if cfg.engine_kv_cache_gb > 0:
        engine = engine_weights + cfg.engine_kv_cache_gb * GiB
    if cfg.engine == "transformers":
        # The policy samples itself: its weights gathered once for each generate batch (dapo's
        # `gathered`, in FSDP2's param dtype) beside the KV cache of one batch's rows, T tokens
        # each; no engine share.
        width = 2 if cfg.bf16 else 4
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        kv_cache = (dapo.GENERATE_BATCH_ROWS * T * config.num_hidden_layers * 2 * kv_heads
                    * head_dim * width)
        engine_weights = 0
        engine = n_params * width + kv_cache
    phases = {}
    host = 0
    for phase, peak in peaks.items():
        by_category = {getattr(c, "value", c): v for c, v in peak.items() if v and c != "Total"}
        # asleep (level 2), the engine's KV cache and weights are freed
        by_category["Engine"] = 0
        # offloaded on one GPU, dapo keeps the gradient there between micro-batches
        # (keep_gradients_until): fp32, from the first backward to the optimizer step
        if cfg.offload_optimizer and n_gpus == 1 and phase in ("train.forward", "train.backward"):
            by_category["Kept Grad"] = 4 * n_params
        if phase == "rollout" or not (cfg.engine_sleep or cfg.engine == "transformers"):
            by_category["Engine"] = engine
        by_category["Total"] = sum(v for c, v in by_category.items() if c not in on_host)
        phases[phase] = {c: round(v / GiB, 4) for c, v in by_category.items() if c not in on_host}
        host = max(host, sum(v for c, v in by_category.items() if c in on_host))
    peak_phase = max(phases, key=lambda phase: phases[phase]["Total"])
    peak_gib = phases[peak_phase]["Total"]
    # a node's host memory: each rank's offloaded state (sleep level 2 backs no weights up)
    host_per_node = min(n_gpus, 8) * host / GiB
    fits = peak_gib <= cfg.gpu_gib and engine > engine_weights
    out = dict(model=cfg.model, n_gpus=n_gpus, gpu_gib=cfg.gpu_gib, tokens=T, params=n_params,
               peak_phase=peak_phase, peak_gib=peak_gib, fits=fits, engine_mem=share,
               engine_kv_gib=round((engine - engine_weights) / GiB, 2),
               seconds=round(time.time() - t0, 1), phases=phases,
               host_gib_per_node=round(host_per_node, 1),
               not_counted="CUDA context, NCCL buffers, kernel workspaces, fragmentation: 5-10%")
    if cfg.offload_optimizer:
        out["offload_traffic_gib"] = offload_traffic(cfg, n_params, n_gpus, T)
    for phase, by_category in phases.items():
        sizes = ", ".join(f"{c} {v:.2f}" for c, v in by_category.items())
        print(f"dapo: {phase:>15}: {sizes} GiB")
    if cfg.offload_optimizer:
        traffic = out["offload_traffic_gib"]
        print(f"dapo: offload traffic per GPU: a micro-batch moves {traffic['micro_batch_h2d']} "
              f"GiB host to GPU, and {traffic['micro_batch_d2h']} GiB of gradients back; a step "
              f"of {traffic['micro_batches']} micro-batches {traffic['step_h2d']} GiB to the GPU "
              f"and {traffic['step_d2h']} GiB back ({traffic['step_d2h_each_micro_batch']} GiB "
              "if each micro-batch sent its gradients back)")
    print(json.dumps(out), flush=True)
    return out


GiB = 2**30

def offload_traffic(cfg, n_params, n_gpus, tokens):
    """Host<->GPU bytes (GiB) per GPU under CPUOffloadPolicy, by reading FSDP2: each unit's fp32
    shard (4 bytes a parameter / GPUs) is copied to the GPU when it is gathered, for the forward
    and again for the backward (layers reshard after forward), and its fp32 gradient shard comes
    back after each micro-batch's reduce-scatter (on one GPU once an update); the pi_old pass
    (mu > 1) gathers once per micro-batch; the transformers engine once per generate batch;
    AdamW steps on the host.
    Micro-batches: the plan's longest rows, micro_batch_tokens // tokens to a micro-batch, over
    a step's prompts_per_step x group_size rows (an upper bound: real rows are shorter)."""
    shard = 4 * n_params / n_gpus
    rows_per_micro = max(1, cfg.micro_batch_tokens // tokens)
    mu = cfg.prompts_per_step // cfg.mini_batch_prompts
    rows_per_update = math.ceil(cfg.mini_batch_prompts * cfg.group_size / n_gpus)
    micro = mu * math.ceil(rows_per_update / rows_per_micro)
    old_pass = micro if mu > 1 else 0
    rollout = 0
    if cfg.engine == "transformers":
        rollout = math.ceil(cfg.prompts_per_step * cfg.group_size / dapo.GENERATE_BATCH_ROWS)
    h2d = shard * (2 * micro + old_pass + rollout)
    # one GPU: the gradient comes back once an update, not once a micro-batch
    # (keep_gradients_until)
    back = micro
    if n_gpus == 1:
        back = mu
    return dict(micro_batch_h2d=round(2 * shard / GiB, 2), micro_batch_d2h=round(shard / GiB, 2),
                micro_batches=micro, step_h2d=round(h2d / GiB, 1),
                step_d2h=round(back * shard / GiB, 1),
                step_d2h_each_micro_batch=round(micro * shard / GiB, 1))


# What the plan does not count (CUDA context, NCCL buffers, workspaces, fragmentation): 5-10%.
NOT_COUNTED = 0.1


def engine_share(cfg, trainer_bytes, gpu_bytes):
    """The engine's gpu_memory_utilization: --engine_mem, or (0) from the plan. With the optimizer
    offloaded, and the engine asleep while the trainer runs, the trainer holds only trainer_bytes
    on the GPU while it samples (the plan's rollout phase: rotary buffers; 0 in the static
    check): the engine takes the rest, less the 10% the plan does not count. Otherwise half: the
    trainer's fp32 state (12-16 bytes a parameter / GPUs) stays beside it."""
    if cfg.engine_mem:
        return cfg.engine_mem
    if not (cfg.offload_optimizer and cfg.engine_sleep):
        return 0.5
    return round(1 - NOT_COUNTED - trainer_bytes / gpu_bytes, 2)


def check_fit(cfg, n_params, world, gpu_bytes):
    """One GPU, static: fp32 params, grads and AdamW state (16 bytes a parameter / world;
    none under offload) beside the engine's share, in which its bf16 weights (2 bytes a
    parameter / rollout_tp) must leave room for a KV cache."""
    share = engine_share(cfg, 0, gpu_bytes) * gpu_bytes
    trainer = 0 if cfg.offload_optimizer else 16 * n_params / world
    tps = [t for t in range(cfg.rollout_tp, world + 1) if world % t == 0]
    tps = [t for t in tps if 2 * n_params / t < share]
    fixes = []
    if not tps:
        fixes.append("a larger --engine_mem")
    elif tps[0] != cfg.rollout_tp:
        fixes.append(f"--rollout_tp {tps[0]}")
    if trainer > gpu_bytes - share:
        fixes.append("--offload_optimizer true")
    if fixes:
        raise SystemExit(
            f"dapo: {n_params / 1e9:.1f}B parameters do not fit {world} x "
            f"{gpu_bytes / 2**30:.0f} GiB as configured: try {' and '.join(fixes)} "
            f"(--estimate_memory {world} plans it in full)"
        )


def check_fit_from_config(cfg):
    """On GPUs, before any weight is read, from the model's config on meta (a 32B checkpoint is
    65 GB to read first): the GPU's free memory against the engine's share (cfg.engine_mem, set
    here when 0, lowered to what is free when the plan still fits), the plan's static check,
    and the host memory the run needs. Each refusal is one line."""
    if not torch.cuda.is_available():
        return
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(cfg))
    n_params = sum(p.numel() for p in model.parameters())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank0 = os.environ.get("RANK", "0") == "0"
    if cfg.engine == "vllm":
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        asked = cfg.engine_mem
        if not cfg.engine_mem:
            cfg.engine_mem = engine_share(cfg, 0, gpu_bytes)
        lowered = check_free_gpu(cfg, asked, n_params, world, gpu_bytes, rank0)
        if rank0 and not (asked or lowered):
            print(f"dapo: the engine takes {cfg.engine_mem} of each GPU while it samples "
                  "(--engine_mem sets it)", flush=True)
        if not cfg.engine_kv_cache_gb:
            check_fit(cfg, n_params, world, gpu_bytes)
    check_host(cfg, n_params, world)


def check_free_gpu(cfg, asked, n_params, world, gpu_bytes, rank0):
    """vLLM refuses to start unless free memory >= gpu_memory_utilization x the GPU's TOTAL
    (another process, a desktop, takes some): lower an automatic share to what is free when the
    plan still fits with it (returns True, having said so), else stop, in one line."""
    free, total = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))
    if free >= cfg.engine_mem * total:
        return False
    lower = math.floor(100 * free / total - 1) / 100
    message = (f"dapo: the GPU has {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB; the "
               f"engine's share {cfg.engine_mem} needs {cfg.engine_mem * total / GiB:.1f} GiB "
               f"free at start: free the GPU, or lower --engine_mem (at most {max(lower, 0)})")
    if asked or lower <= 0:
        raise SystemExit(message)
    try:
        check_fit(dataclasses.replace(cfg, engine_mem=lower), n_params, world, gpu_bytes)
    except SystemExit as e:
        raise SystemExit(f"{message}; with {lower} the plan does not fit "
                         f"({e.code.removeprefix('dapo: ')})") from None
    if rank0:
        print(f"dapo: the GPU has {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB: the "
              f"engine takes {lower} of it, not the plan's {cfg.engine_mem} (--engine_mem sets "
              "it)", flush=True)
    cfg.engine_mem = lower
    return True


def host_need(cfg, n_params, world):
    """Host bytes a node needs: rank 0 reads the checkpoint (2 bytes a parameter in bf16), and
    with offload each local rank keeps its fp32 params, grads and AdamW moments (16 bytes a
    parameter / world) there; sleep level 2 keeps no engine weights."""
    local = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    offloaded = 16 * n_params / world * local if cfg.offload_optimizer else 0
    return 2 * n_params + offloaded


def host_memory():
    """(total, available) bytes of this machine's memory, from /proc/meminfo; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return None
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))


def check_host(cfg, n_params, world):
    """Stop, in one line, if the machine has less memory available than the run needs (the
    kernel would kill it mid-load)."""
    memory = host_memory()
    need = host_need(cfg, n_params, world)
    if memory is None or memory[1] >= need:
        return
    fixes = "more GPUs (the offloaded state divides by them)"
    if cfg.offload_optimizer:
        fixes = "--offload_optimizer false (the state on the GPU, 80 GB) or " + fixes
    raise SystemExit(f"dapo: host memory: {memory[1] / GiB:.1f} GiB available of "
                     f"{memory[0] / GiB:.1f} GiB, the run needs {need / GiB:.1f} GiB (the "
                     f"checkpoint read, and the offloaded optimizer): try {fixes}")


# --- The rank layout the model takes ---


def valid_rollout_tps(heads, kv_heads, world):
    """Engine sizes vLLM accepts: dividing world and heads, dividing or a multiple of KV heads."""
    sizes = [tp for tp in range(1, world + 1) if world % tp == 0 and heads % tp == 0]
    return [tp for tp in sizes if kv_heads % tp == 0 or tp % kv_heads == 0]


def check_layout(config, tp, world):
    """An engine size the model cannot take: one line before any weight loads, not vLLM's."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    valid = valid_rollout_tps(heads, kv_heads, world)
    if tp not in valid:
        options = " or ".join(f"--rollout_tp {size}" for size in valid)
        raise SystemExit(f"dapo: --rollout_tp {tp} does not fit the model's {heads} attention "
                         f"heads and {kv_heads} key-value heads on {world} ranks: use {options}")


# --- Memory on CPU: the allocator's settings and the per-step figures (dapo.py's) ---


def cpu_setup(layout):
    """On CPU glibc keeps freed memory within a step: by default each freed block over 32 MB
    was page-faulted in again (28% of the demo's CPU time). memory_metrics trims the heap after
    each step. The kernel-cache caps set at import: at 1,024 kernels per shape (the default)
    oneDNN's and ideep's caches grew the heap 60-130 MB a step. And no torch.compile: vLLM on
    CPU runs eagerly (enforce_eager) but compiled two sampler kernels with g++ at first use,
    6.4 s of a tiny run's first rollout from a fresh cache (1.7 s warm)."""
    if layout.device.type == "cpu":
        torch._dynamo.config.disable = True
    libc = glibc()
    if layout.device.type != "cpu" or libc is None:
        return
    # M_MMAP_MAX: big blocks from the heap, not mmap
    libc.mallopt(-4, 0)
    # M_TRIM_THRESHOLD: never trim the heap's top
    libc.mallopt(-1, 2**31 - 1)


def glibc():
    """glibc's malloc controls, or None where the C library has none (macOS, Windows, musl)."""
    import ctypes
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    return libc


# Linux's per-process files; where absent (macOS, Windows) the memory figures are not logged.
PROC = "/proc/self"


# --- FSDP2's memory and traffic, as dapo.py runs it (the plan above counts both) ---


@contextlib.contextmanager
def gathered(model):
    """FSDP2's units gathered once for the block, resharded after: generate runs a forward per
    token, and each would gather every decoder layer again (with offload, copy its fp32 shard
    from host memory). The root unit keeps its parameters after forward anyway."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    layers = [unit for unit in units if unit is not model]
    for unit in layers:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in layers:
            unit.set_reshard_after_forward(True, recurse=False)
        for unit in units:
            unit.reshard()


def keep_gradients_until(model, cfg, layout, last):
    """FSDP2 reduces the gradients after every micro-batch's backward and, offloaded, copies them
    to host memory. On one GPU with offload the unsharded gradient is no larger than its shard:
    it stays on the GPU until the mini-batch's last micro-batch (the plan counts it), a third
    less host traffic. Elsewhere it would be world times the shard (131 GB at 32B)."""
    if cfg.offload_optimizer and layout.world == 1 and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)


# --- bf16 on CPU ---


@torch.no_grad()
def dither_bf16_(x):
    """In place: a weight on the bf16 grid moves uniformly inside its rounding cell (bf16 sees
    the same value), so an update shows in bf16 with probability |update| / ulp, not only
    after the master drifts half an ulp (25 updates for the demo's median weight)."""
    on_grid = (x == x.bfloat16().float()) & (x != 0)
    # x = m 2^e, |m| in [0.5, 1); at a power of two, the finer cell below
    _, exponent = torch.frexp(x * (1 - 2**-10))
    # bf16 keeps 8 significant bits
    half_ulp = torch.ldexp(torch.ones_like(x), exponent - 9)
    x.add_((2 * torch.rand_like(x) - 1) * 0.999 * half_ulp * on_grid)


def reset_peak_memory():
    """Resets the kernel's peak RSS (VmHWM), so perf/peak_rss_gb is this step's (Linux)."""
    if os.path.exists(os.path.join(PROC, "clear_refs")):
        with open(os.path.join(PROC, "clear_refs"), "w") as f:
            f.write("5")


def memory_metrics(layout):
    """This step's peak RSS and GPU peak (then reset, for the next step's); on CPU the heap's
    free pages back to the OS; the RSS after."""
    libc = glibc()
    if layout.device.type == "cpu" and libc is not None:
        libc.malloc_trim(0)
    metrics = {}
    if layout.device.type == "cuda":
        metrics["perf/gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    if not os.path.exists(os.path.join(PROC, "status")):
        return metrics
    with open(os.path.join(PROC, "status")) as f:
        peak_kib = int(f.read().split("VmHWM:")[1].split()[0])
    with open(os.path.join(PROC, "statm")) as f:
        rss_pages = int(f.read().split()[1])
    rss_gb = rss_pages * os.sysconf("SC_PAGESIZE") / 2**30
    reset_peak_memory()
    return {**metrics, "perf/peak_rss_gb": peak_kib / 2**20, "perf/rss_gb": rss_gb}
