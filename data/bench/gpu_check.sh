#!/usr/bin/env bash
# The first GPU's check, one prepared run (not yet run on a GPU: about 10 minutes on one H100 by
# estimate, its parts' limits add to 14) with only what that machine has (torch with CUDA,
# transformers, pytest; no vLLM, no `datasets`, no network):
#   bash data/bench/gpu_check.sh    # writes data/results/gpu_check/*.txt
#   PYTHON=/path/to/python bash data/bench/gpu_check.sh    # another interpreter (default python3)
# 1. data/bench/gpu_check.py: the trainer half of a step on Qwen2.5-0.5B's shape, unpadded and
#    padded micro-batches, tokens/s and peak memory per phase against the memory plan;
# 2. data/bench/gpu_check.py --step: dapo.py itself, --engine transformers, on a random model of
#    that shape: step 1 and its checkpoint, then resumed for step 2 and an evaluation;
# 3. data/bench/gpu_check.py --offload: the 24 GB path, one step of dapo_1.5b's shapes
#    with the optimizer offloaded and the transformers engine (rollout tokens/s, update seconds,
#    the plan's peak beside the measured one);
# 4. the `-k cuda` tests (FSDP2 bf16 with and without offload, chunked head, DCP, memory plan).
# `--dry` runs the Python of 1 to 3 on CPU (a test does). Each part has its own time limit (14
# minutes in all at most), the new parts first.
set -uo pipefail
cd "$(dirname "$0")/../.."
# the interpreter that holds torch: the machine has python3, no `python`
PY=${PYTHON:-python3}
out=data/results/gpu_check
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
timeout 120 "$PY" data/bench/gpu_check.py 2>&1 | tail -n 20 | tee "$out/trainer.txt"
timeout 240 "$PY" data/bench/gpu_check.py --step --timeout 100 2>&1 | tail -n 40 \
    | tee "$out/step.txt"
timeout 300 "$PY" data/bench/gpu_check.py --offload --timeout 240 2>&1 | tail -n 20 \
    | tee "$out/offload_step.txt"
timeout 180 "$PY" -m pytest -q -rs test_dapo.py -k cuda 2>&1 | tail -n 30 \
    | tee "$out/cuda_tests.txt"
