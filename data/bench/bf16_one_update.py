"""How many of the demo model's weights differ in bf16 after 1-4 real AdamW updates at the demo's lr (README,
"Why bf16 needs the dither"): fp32 master weights from the bf16 checkpoint, bf16 autocast, no dither.

    python data/bench/bf16_one_update.py        # after the CPU demo converted models/SmolLM2-135M-Instruct
"""
import torch
from transformers import AutoModelForCausalLM

if __name__ == "__main__":
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained("models/SmolLM2-135M-Instruct", dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)
    start = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(100, 40000, (4, 48))
    n = sum(p.numel() for p in model.parameters())
    for k in range(1, 5):
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        moved = sum((a.bfloat16() != p.detach().bfloat16()).sum().item() for a, p in zip(start, model.parameters()))
        print(f"after {k} update(s) at lr 1e-5: {100 * moved / n:.2f}% of the weights differ in bf16", flush=True)
