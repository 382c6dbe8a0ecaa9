#!/usr/bin/env bash
# bench/p2p.py (transfer rows, no GEMM phase) between every pair of visible GPUs, with the channel's backend chosen
# by auto-selection; prints each pair's table and chosen backend. Extra arguments go to p2p.py.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
count=$(python3 -c "import torch; print(torch.cuda.device_count())")
for ((i = 0; i < count; i++)); do
  for ((j = i + 1; j < count; j++)); do
    echo "## cuda:$i -> cuda:$j"
    CUDA_VISIBLE_DEVICES=$i,$j python3 bench/p2p.py --backend auto --no-gemm --sizes 4K,1M,64M,256M --reps 3 "$@" \
      2>/dev/null | grep -E "^# (pipecomm_backend|peer_access)|^size|^----|^[0-9]+[KM] "
  done
done
