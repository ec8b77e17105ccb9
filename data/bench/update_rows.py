"""Time one update's forward and backward on the demo model, one row per sample against shared-prompt
rows, at a given micro-batch budget: what set the cpu preset's share_prompt and micro_batch_tokens.

    python data/bench/update_rows.py single 16 4096
    python data/bench/update_rows.py shared 16 1024 [--profile]

Groups like the TRL comparison's: a 97-token prompt and 8 responses of 15-64 tokens (random ids), fp32."""
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import dapo  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

mode, n_groups, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
random.seed(0)
model = AutoModelForCausalLM.from_pretrained("models/SmolLM2-135M-Instruct", dtype=torch.float32,
                                             attn_implementation="sdpa")


def group(prompt_len=97, size=8):
    prompt = [random.randrange(100, 40000) for _ in range(prompt_len)]
    samples = []
    for _ in range(size):
        n = random.randint(15, 64)
        ids = [random.randrange(100, 40000) for _ in range(n)]
        samples.append(dapo.Sample(ids=ids, finish="stop", engine_logp=[0.0] * n, adv=1.0))
    return dapo.Group(idx=0, pos=0, prompt_ids=prompt, answer="1", samples=samples)


cfg = dapo.Config(share_prompt=mode == "shared", micro_batch_tokens=budget, bf16=False)
rows = sorted(dapo.make_rows([group() for _ in range(n_groups)], cfg), key=dapo.row_len)
micro = dapo.micro_batches(rows, budget)


def update():
    t = time.time()
    for mb in micro:
        b = dapo.collate(mb, 0, torch.device("cpu"))
        logp, _ = dapo.token_logp(model, b, 1.0, 1024)
        (logp * b["loss_mask"]).sum().backward()
    return time.time() - t


update()  # warm-up
times = [update() for _ in range(2)]
tokens = sum(map(dapo.row_len, rows))
print(f"{mode}: {len(rows)} rows, {len(micro)} micro-batches, {tokens} tokens, "
      f"{', '.join(f'{t:.1f}' for t in times)} s, {tokens / min(times):.0f} tokens/s")
if "--profile" in sys.argv:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
