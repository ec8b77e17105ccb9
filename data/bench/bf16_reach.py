"""How long a bf16 checkpoint's weights take to show an update in bf16 compute (README, "Why bf16 needs the dither").

An fp32 master weight upcast from a bf16 checkpoint sits exactly on the bf16 grid; bf16 compute and a
bf16 engine see it move only once it has drifted half a bf16 ulp. AdamW moves a weight by at most
about lr per update, so a weight needs at least half_ulp / lr same-sign updates. Prints, for a
safetensors checkpoint and a learning rate, the share of weights that can have moved after k updates.

    python data/bench/bf16_reach.py models/SmolLM2-135M-Instruct/model.safetensors 1e-5
"""
import sys

import torch
from safetensors.torch import load_file


def updates_needed(w, lr):
    """Same-sign updates of size lr before the bf16 value of each weight w (on the bf16 grid) changes."""
    _, e = torch.frexp(w.abs() * (1 - 2 ** -10))  # |w| = m 2^e, m in [0.5, 1); a power of two: the cell below
    return (torch.ldexp(torch.ones_like(w), e - 9) / lr).ceil()  # half an ulp: bf16 keeps 8 significant bits


if __name__ == "__main__":
    path, lr = sys.argv[1], float(sys.argv[2])
    w = torch.cat([v.float().flatten() for v in load_file(path).values()])
    need = updates_needed(w[w != 0], lr)
    print(f"{w.numel() / 1e6:.0f}M weights, median |w| {w.abs().median():.4f}, lr {lr}: "
          f"median {need.median():.0f} same-sign updates before a weight moves in bf16")
    for k in (1, 4, 16, 48, 160, 1600):
        print(f"  after {k:>5} updates: at most {100 * (need <= k).float().mean():5.1f}% of weights can differ in bf16")
    for m in (0.01, 0.02, 0.05, 1.0):
        print(f"  a weight of {m}: {updates_needed(torch.tensor([m]), lr).item():.0f} updates")
