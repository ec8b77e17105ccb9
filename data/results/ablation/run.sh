#!/usr/bin/env bash
# Table 1 at CPU scale (README, "Ablations"): the CPU demo's workload with each DAPO
# technique switched off in turn, and naive GRPO, for 3 seeds. Each run's per-step
# metrics land in data/results/ablation/<config>_s<seed>.jsonl; runs already there are skipped,
# so the script can be stopped and started again. Run from the repository root:
#     bash data/results/ablation/run.sh            # all 18 runs, about 8 minutes each on 2 cores
set -euo pipefail
declare -A CONFIGS=(
  [dapo]=""
  [no_clip_higher]="--eps_high 0.2"
  [no_dynamic_sampling]="--dynamic_sampling false"
  [no_token_level_loss]="--token_level_loss false"
  [no_overlong_shaping]="--overlong_buffer_len 0"
  [grpo]="--eps_high 0.2 --dynamic_sampling false --token_level_loss false --overlong_buffer_len 0"
)
ORDER="dapo no_clip_higher no_dynamic_sampling no_token_level_loss no_overlong_shaping grpo"
for seed in ${SEEDS:-0 1 2}; do
  for name in $ORDER; do
    out=data/results/ablation/${name}_s${seed}.jsonl
    [ -e "$out" ] && continue
    start=$(date +%s)
    # shellcheck disable=SC2086
    python dapo.py --preset cpu ${CONFIGS[$name]} --seed "$seed" --save_every 0 \
      --out_dir "runs/ablation/${name}_s${seed}"
    cp "runs/ablation/${name}_s${seed}/metrics.jsonl" "$out"
    echo -e "${name}\t${seed}\t$(( $(date +%s) - start ))\t$(git rev-parse --short HEAD)" \
      >> data/results/ablation/wall_s.tsv
  done
done
