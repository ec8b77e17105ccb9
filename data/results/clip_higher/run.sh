#!/usr/bin/env bash
# Clip-Higher at CPU scale (README, "Ablations"; the paper's Figure 2): DAPO's eps_high 0.28 against
# symmetric clipping (0.2), everything else equal, in a regime where the upper clip binds: the CPU demo
# with 8 updates a step (one group each) for 24 steps. The probes that chose it are in the README. Each
# run's per-step metrics land in data/results/clip_higher/<config>_s<seed>.jsonl; runs already
# there are skipped, so the script can be stopped and started again. From the repository root:
#     bash data/results/clip_higher/run.sh       # 6 runs
set -euo pipefail
REGIME="--mini_batch_prompts 1 --steps 24 --eval_every 12"
declare -A CONFIGS=([clip_higher]="--eps_high 0.28" [symmetric]="--eps_high 0.2")
for seed in ${SEEDS:-0 1 2}; do
  for name in clip_higher symmetric; do
    out=data/results/clip_higher/${name}_s${seed}.jsonl
    [ -e "$out" ] && continue
    rm -rf "runs/clip_higher/${name}_s${seed}"  # a run stopped midway starts again
    start=$(date +%s)
    # shellcheck disable=SC2086
    python dapo.py --preset cpu $REGIME ${CONFIGS[$name]} --seed "$seed" --save_every 0 \
      --out_dir "runs/clip_higher/${name}_s${seed}"
    cp "runs/clip_higher/${name}_s${seed}/metrics.jsonl" "$out"
    echo -e "${name}\t${seed}\t$(( $(date +%s) - start ))\t$(git rev-parse --short HEAD)" \
      >> data/results/clip_higher/wall_s.tsv
  done
done
