"""An AVX2-only CPU as torch, oneDNN, inductor and vLLM see it, on a CPU with AVX-512 (README, "Tests").

Python imports this file at start-up when its folder is on PYTHONPATH, so every process the tests spawn
(torchrun ranks, dapo.py runs) gets it too. With EMULATE_AVX2=1 torch's CPU-feature checks say no AVX-512
and no AMX: vLLM loads its AVX2 kernels (_C_AVX2) and dapo.py's cpu preset picks fp32, as on an AVX2-only
CPU. The variables hold ATen's kernels, oneDNN's and inductor's generated code to AVX2 (inductor compiles
with -march=native by default, which here would mix AVX-512 code into its AVX2 kernels and miscompute):

    EMULATE_AVX2=1 PYTHONPATH=data/bench/avx2_emulation ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        TORCHINDUCTOR_CPP_MARCH=haswell python -m pytest -q test_dapo.py

Not a real AVX2 machine: ATen's, oneDNN's, inductor's and vLLM's kernels are AVX2's, but other libraries (MKL)
may still pick AVX-512 code, and caches, timings and memory are this CPU's.
"""
import os

if os.environ.get("EMULATE_AVX2"):
    import torch
    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)
