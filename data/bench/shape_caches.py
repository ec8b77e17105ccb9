"""What the CPU's per-shape kernel caches keep (README, "Memory from step to step").

oneDNN (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep (LRU_CACHE_CAPACITY) keep a compiled kernel for every
matrix shape they meet, 1,024 of each by default; bf16 matmuls on a CPU go through them. A run's micro-batches
change shape every step, so the heap grows until both caches are full. This script loads the TRL side-by-side
workload at half size (8 prompts x 8 samples), samples 5 rollouts, trains on each (new shapes), then on the
first 3 again (shapes seen), printing glibc's heap in use (mallinfo2, after malloc_trim) and each update's time.
Set the two variables to compare (dapo.py sets both to 128 unless they are set):

    ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 LRU_CACHE_CAPACITY=1024 python data/bench/shape_caches.py
"""
import ctypes
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dapo  # noqa: E402


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2


def report(tag):
    gc.collect()
    libc.malloc_trim(0)
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGESIZE")
    print(f"{tag:<22} heap in use {libc.mallinfo2().uordblks / 2**20:7.1f} MiB, resident {rss / 2**20:7.1f} MiB",
          flush=True)


if __name__ == "__main__":
    print("caches: oneDNN", os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], "ideep", os.environ["LRU_CACHE_CAPACITY"])
    cfg = dapo.parse_args(
        "--train_data data/demo_train_template.jsonl --prompts_per_step 8 --group_size 8 --gen_prompts_per_round 8 "
        "--max_response_len 64 --overlong_buffer_len 16 --dynamic_sampling false --mini_batch_prompts 8 "
        "--eval_every 0 --save_every 0 --out_dir runs/shape_caches".split())[0]
    dapo.quiet_libraries()
    d, tok, model, train_set, eval_set, engine = dapo.start(cfg)
    optim = dapo.make_optimizer(model, cfg)
    steps = []
    n, g = cfg.prompts_per_step, cfg.group_size
    for i in range(5):
        prompts = dapo.take_prompts(train_set, i * n, n, cfg.seed)
        samples = dapo.generate(engine, [p["prompt_ids"] for p in prompts], g, cfg.max_response_len,
                                cfg.temperature, cfg.top_p, [p["pos"] * g for p in prompts])
        groups = [dapo.Group(**p, samples=s) for p, s in zip(prompts, samples)]
        dapo.score_groups(groups, tok, cfg)
        dapo.assign_advantages(groups, cfg.adv_eps)
        steps.append(groups)
    report("after 5 rollouts")
    for tag, groups in [(f"update {i} (new shapes)", g) for i, g in enumerate(steps)] + \
                       [(f"update {i} (seen)", g) for i, g in enumerate(steps[:3])]:
        t0 = time.time()
        # one mini-batch: mini_batch_prompts = B
        micro = dapo.rank_micro_batches(groups, cfg, d)
        dapo.policy_gradient(model, groups, micro, cfg, d, tok.pad_token_id, True, {})
        dapo.clip_and_step(model, optim, cfg)
        report(f"{tag} {time.time() - t0:4.1f} s")
    dapo.close(engine)
