#!/usr/bin/env bash
# One device-machine session: build with CUDA, run the CUDA twins (`pytest -m cuda`, or PYTEST_ARGS), the
# native tests and the host-call bench (unless NATIVE=0), and the GPU benches given as arguments, each
# optionally led by environment settings for that bench alone, e.g.
#   bash scripts/gpu_check.sh "p2p.py --reps 5" "PIPECOMM_IPC_SM_MAX_BYTES=65536 p2p.py --reps 5" "e2e.py --configs compute"
# Everything lands in /tmp/pipecomm-gpu and, when $OUT is set (the device tool), in $OUT/results.tgz,
# rewritten after every stage: a run cut short still brings back what it measured, and the tool's cap
# on returned files never drops any.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# The image's Python was configured with /opt/gcc, whose g++ links libstdc++ statically; an extension
# so linked crashes formatting error messages next to torch's shared libstdc++. Use the system g++.
export CC=gcc CXX=g++ LDSHARED="g++ -shared"
work=/tmp/pipecomm-gpu
mkdir -p "$work"
started=$(date +%s)
stage() {  # name: prints the elapsed time and packs what exists so far
  echo "== $1 done at $(( $(date +%s) - started )) s"
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tgz" -C "$work" .; fi
}
{ git log --oneline -1; git status --short; } > "$work/commit.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$work/gpu.txt"
if ! PIPECOMM_USE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install --no-build-isolation --no-deps -e . \
    >"$work/build.log" 2>&1; then
  grep -E "error|Error" "$work/build.log" | head -40
  stage build
  exit 1
fi
python3 -c "import pipecomm; print(pipecomm.build_info())"
stage build
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest ${PYTEST_ARGS:--m cuda tests} -q -p no:cacheprovider \
  >"$work/pytest.txt" 2>&1
echo "pytest exit $?"
grep -E "passed|failed|error" "$work/pytest.txt" | tail -8
stage pytest
if [ "${NATIVE:-1}" = 1 ]; then
  { cmake -S . -B build/native -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build build/native; } \
    >"$work/native.log" 2>&1 && ctest --test-dir build/native --output-on-failure >"$work/ctest.txt" 2>&1
  echo "native exit $?"
  tail -4 "$work/ctest.txt" 2>/dev/null || tail -30 "$work/native.log"
  if [ -x build/native/bench_host_calls ]; then
    build/native/bench_host_calls --json "$work/host_calls.json" | tee "$work/host_calls.txt"
  fi
  stage native
fi
for bench in "$@"; do
  read -ra words <<< "$bench"
  settings=()
  while [[ "${words[0]}" == *=* ]]; do settings+=("${words[0]}"); words=("${words[@]:1}"); done
  base=$(basename "${words[0]}" .py) name=$base run=1
  while [ -e "$work/$name.txt" ]; do run=$((run + 1)) name=$base-$run; done  # the same bench twice
  echo "# $bench" > "$work/$name.txt"
  timeout "${BENCH_TIMEOUT:-300}" env "${settings[@]}" python3 "bench/${words[0]}" "${words[@]:1}" \
    --json "$work/$name.json" >>"$work/$name.txt" 2>"$work/$name.err"
  echo "$name exit $? ($bench)"
  grep -v "^# [a-z_0-9]*:" "$work/$name.txt" | tail -40
  stage "$name"
done
