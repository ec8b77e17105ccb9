#!/usr/bin/env bash
# Clip-Higher's mechanism isolated from learning (README, "Ablations"; data/results/README.md): the
# CPU demo's model and prompts with random rewards (--reward_mode random: +1 or -1 with probability
# 1/2, whatever the response), so the expected unclipped policy gradient is zero and whatever moves
# entropy comes from the clip bounds. 8 updates a step (one group each) for 24 steps, as in
# data/results/clip_higher/; the upper bound at 0.2 (symmetric), 0.28 (DAPO) and 0.4, each also
# without the soft overlong penalty, and a lower bound of 0.1 with the upper at 0.2. Each run's
# per-step metrics land in data/results/random_reward/<config>_s<seed>.jsonl; runs already there
# are skipped, so the script can be stopped and started again. From the repository root:
#     bash data/results/random_reward/run.sh       # 21 runs, about 5 minutes each on 2 cores alone
set -euo pipefail
REGIME="--reward_mode random --eval_every 0 --mini_batch_prompts 1 --steps 24"
declare -A CONFIGS=([eps_high_0.2]="--eps_high 0.2" [eps_high_0.28]="--eps_high 0.28"
                    [eps_high_0.4]="--eps_high 0.4" [eps_low_0.1]="--eps_low 0.1 --eps_high 0.2")
# The same without the soft overlong penalty (Eq. 13), which the demo preset keeps on and which
# rewards short responses: with it off the shaped reward is the coin flip alone.
for name in eps_high_0.2 eps_high_0.28 eps_high_0.4; do
  CONFIGS[no_penalty_$name]="${CONFIGS[$name]} --overlong_buffer_len 0"
done
# The three upper bounds first, seed by seed; then without the penalty; then the lower bound.
for run in {0,1,2}/{eps_high_0.2,eps_high_0.28,eps_high_0.4} \
           {0,1,2}/{no_penalty_eps_high_0.2,no_penalty_eps_high_0.28,no_penalty_eps_high_0.4} \
           {0,1,2}/eps_low_0.1; do
  seed=${run%%/*}
  name=${run#*/}
  out=data/results/random_reward/${name}_s${seed}.jsonl
  [ -e "$out" ] && continue
  rm -rf "runs/random_reward/${name}_s${seed}"  # a run stopped midway starts again
  start=$(date +%s)
  # shellcheck disable=SC2086
  python dapo.py --preset cpu $REGIME ${CONFIGS[$name]} --seed "$seed" --save_every 0 \
    --out_dir "runs/random_reward/${name}_s${seed}"
  cp "runs/random_reward/${name}_s${seed}/metrics.jsonl" "$out"
  echo -e "${name}\t${seed}\t$(( $(date +%s) - start ))\t$(git rev-parse --short HEAD)" \
    >> data/results/random_reward/wall_s.tsv
done
