#!/usr/bin/env bash
# The multi-GPU measurement on one host of 4 GPUs (2 suffice for the p = 2 phases), phase by phase:
#   bash scripts/multi_gpu.sh build twins e2e4 p2p ...
# Phases: build, twins (the multi-GPU CUDA twins), nccl-twins (the NCCL ones, to the first failure), e2e4 and e2e2 (bench/e2e.py at p = 4 and p = 2, the
# p = 2 halves on GPUs 0,1 and 2,3 at once), e2e4-llama (bench/e2e.py's Hugging Face Llama config at p = 4),
# dist (the 2-stage pipeline forced onto NCCL, against torch and IPC), hf2 and hf4 (examples/train_hf.py with every
# schedule), 3d-fsdp and 3d-tp (bench/parallel_3d.py), p2p, inference.
# Each phase writes /tmp/pipecomm-gpu/<phase>*.{txt,json}; after each the whole folder is packed into
# $OUT/results.tgz, so a run cut short still brings back what it measured.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# The image's Python was configured with /opt/gcc, whose g++ links libstdc++ statically; an extension so linked
# crashes formatting error messages next to torch's shared libstdc++. Use the system g++.
export CC=gcc CXX=g++ LDSHARED="g++ -shared"
work=/tmp/pipecomm-gpu
mkdir -p "$work"
started=$(date +%s)
SCHEDULES="gpipe 1f1b interleaved-1f1b zb-h1 zb-h2 zb-v auto"
# A Llama-architecture model big enough that compute, not launches, fills a step.
HF_ARGS=${HF_ARGS:-"--hidden 1024 --heads 16 --kv-heads 4 --layers 8 --seq 512 --vocab 32000 --micro-batch-size 2 \
--micro-batches 8 --steps 8 --dtype bfloat16"}

packed() {  # name: prints the elapsed time and packs what exists so far
  echo "== $1 done at $(($(date +%s) - started)) s"
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tgz" -C "$work" .; fi
}

on_gpus() {  # devices name command...: runs the command on those GPUs, its output in $work/name.txt
  local devices=$1 name=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$devices timeout "${PHASE_TIMEOUT:-400}" "$@" >"$work/$name.txt" 2>"$work/$name.err"
  echo "$name exit $?"
}

hf_schedules() {  # devices pp port name: every schedule through examples/train_hf.py
  local devices=$1 pp=$2 port=$3 name=$4
  for schedule in $SCHEDULES; do
    CUDA_VISIBLE_DEVICES=$devices timeout 120 torchrun --nproc_per_node "$pp" --master_port "$port" \
      examples/train_hf.py --pp "$pp" --schedule "$schedule" $HF_ARGS >>"$work/$name.txt" 2>>"$work/$name.err"
    echo "$name $schedule exit $?" | tee -a "$work/$name.txt"
  done
}

phase() {
  case $1 in
    build)
      { git log --oneline -1; git status --short; } >"$work/commit.txt"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$work/gpu.txt"
      nvidia-smi topo -m >"$work/topo.txt" 2>&1
      if ! PIPECOMM_USE_CUDA=1 MAX_JOBS=${MAX_JOBS:-32} python3 -m pip install --no-build-isolation --no-deps -e . \
          >"$work/build.log" 2>&1; then
        grep -E "error|Error" "$work/build.log" | head -40
        return 1
      fi
      python3 -c "import pipecomm; print(pipecomm.build_info())" ;;
    twins)
      timeout 400 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_dist_channel.py tests/test_exactness.py \
        tests/test_cuda_graphs.py tests/test_pipeline.py >"$work/twins.txt" 2>&1
      echo "twins exit $?"
      tail -3 "$work/twins.txt" ;;
    e2e4)
      on_gpus 0,1,2,3 e2e4-compute python3 bench/e2e.py --ranks 4 --configs compute --steps 10 --timeout 60 \
        --trace "$work/trace-p4" --json "$work/e2e4-compute.json"
      on_gpus 0,1,2,3 e2e4-medium-overhead python3 bench/e2e.py --ranks 4 --configs medium,overhead --steps 10 \
        --timeout 60 --json "$work/e2e4-medium-overhead.json" ;;
    e2e4-llama)
      on_gpus 0,1,2,3 e2e4-llama python3 bench/e2e.py --ranks 4 --configs llama --steps 10 --timeout 60 \
        --json "$work/e2e4-llama.json" ;;
    e2e2)  # the compute config, then the NCCL path, on GPUs 0,1 while medium and overhead run on GPUs 2,3
      { on_gpus 0,1 e2e2-compute python3 bench/e2e.py --ranks 2 --configs compute --steps 10 --timeout 60 \
          --trace "$work/trace-p2" --json "$work/e2e2-compute.json"
        phase dist; } &
      on_gpus 2,3 e2e2-medium-overhead python3 bench/e2e.py --ranks 2 --configs medium,overhead --steps 10 \
        --timeout 60 --json "$work/e2e2-medium-overhead.json" &
      wait ;;
    dist)  # a deadline inside the phase's timeout, so that a hang comes back with every rank's stacks
      NCCL_DEBUG=WARN on_gpus 0,1 dist python3 bench/e2e.py --ranks 2 --configs compute,medium --transport auto,dist \
        --schedules "1f1b,1f1b+graphs,torch 1F1B" --steps 10 --timeout 60 --deadline "${DIST_DEADLINE:-300}" \
        --json "$work/dist.json" ;;
    nccl-twins)  # stops at the first failure, its traceback kept
      timeout 120 python3 -m pytest -m cuda -x -q --tb=short -p no:cacheprovider tests/test_dist_channel.py \
        >"$work/nccl-twins.txt" 2>&1
      echo "nccl-twins exit $?"
      tail -3 "$work/nccl-twins.txt" ;;
    hf2)  # on each GPU pair of HF2_PAIRS at once (default both halves: two samples)
      local port=29511 half=a
      for pair in ${HF2_PAIRS:-0,1 2,3}; do
        hf_schedules "$pair" 2 "$port" "hf-pp2-$half" &
        port=$((port + 1)) half=b
      done
      wait ;;
    hf4)
      hf_schedules 0,1,2,3 4 29513 hf-pp4 ;;
    3d-fsdp | 3d-tp)
      on_gpus 0,1,2,3 "$1" python3 bench/parallel_3d.py --composition "${1#3d-}" --deadline 150 ${THREE_D_ARGS:-} \
        --trace "$work/trace-3d" --json "$work/$1.json" ;;
    p2p)
      on_gpus 0,1 p2p python3 bench/p2p.py --sizes 4K,64M,256M --no-gemm --reps 5 --json "$work/p2p.json" ;;
    inference)
      on_gpus 0,1,2,3 inference python3 bench/inference.py --ranks 4 --json "$work/inference.json" ;;
    *)
      echo "unknown phase $1"
      return 1 ;;
  esac
}

for name in "$@"; do
  phase "$name" || { packed "$name (failed)"; [ "$name" = build ] && exit 1; continue; }
  packed "$name"
done
