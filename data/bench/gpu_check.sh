#!/usr/bin/env bash
# The first GPU's check, one prepared run of at most about 8 minutes on one H100 with only what that
# machine has (torch with CUDA, transformers, pytest; no vLLM, no network):
#   bash data/bench/gpu_check.sh        # writes data/results/gpu_check/{cuda_tests.txt,trainer.txt}
# 1. the `-k cuda` tests (FSDP2 bf16 with and without offload, chunked head, DCP, memory plan);
# 2. data/bench/gpu_check.py: the trainer half of a step on Qwen2.5-0.5B's shape, tokens/s and
#    peak memory per phase against the memory plan. `--dry` runs its Python on CPU (a test does).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=data/results/gpu_check
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
timeout 300 python -m pytest -q -rs test_dapo.py -k cuda 2>&1 | tail -n 30 | tee "$out/cuda_tests.txt"
timeout 180 python data/bench/gpu_check.py 2>&1 | tail -n 20 | tee "$out/trainer.txt"
