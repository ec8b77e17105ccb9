#!/usr/bin/env bash
# The node's layout on CPU: 8 ranks as two engines of four (--rollout_tp 4), one end-to-end run
# through vLLM (rounds, kept groups, the update, the push, an evaluation, a checkpoint), checked
# by test_node_layout_eight_ranks_two_engines_of_four. Minutes on 2 cores, so opt-in, not in CI:
#   bash data/bench/eight_ranks.sh     # writes data/results/eight_ranks.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
{ echo "commit $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with local changes)')"
  lscpu | grep -E "Model name|^CPU\(s\)|CPU family|^Model:"
  echo "flags: $(lscpu | grep -o -E 'avx2|avx512f|avx512_bf16|amx_tile' | sort -u | tr '\n' ' ')"
} > data/results/eight_ranks.txt
DAPO_SLOW_TESTS=1 python -m pytest -q -s -rs test_dapo.py -k eight_ranks 2>&1 | tail -n 15 \
    | tee -a data/results/eight_ranks.txt
