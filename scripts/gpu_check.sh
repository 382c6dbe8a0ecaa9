#!/usr/bin/env bash
# One device-machine session: build with CUDA, run the CUDA test twins (PYTEST_ARGS), the native tests (unless
# NATIVE=0) and the GPU benches named as arguments, logging to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# The image's Python was configured with /opt/gcc, whose g++ links libstdc++ statically; an extension
# so linked crashes formatting error messages next to torch's shared libstdc++. Use the system g++.
export CC=gcc CXX=g++ LDSHARED="g++ -shared"
out=${OUT:-/tmp/pipecomm-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pytest', pytest.__version__)"
if ! PIPECOMM_USE_CUDA=1 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40
  exit 1
fi
python3 -c "import pipecomm; print(pipecomm.build_info())"
python3 -m pytest ${PYTEST_ARGS:-tests} -q -p no:cacheprovider 2>&1 | tail -25 | tee "$out/pytest.txt"
[ "${NATIVE:-1}" = 1 ] && cmake -S . -B build/native -G Ninja -DCMAKE_BUILD_TYPE=Release >"$out/native.log" 2>&1 \
  && cmake --build build/native >>"$out/native.log" 2>&1 \
  && ctest --test-dir build/native --output-on-failure 2>&1 | tail -6 | tee "$out/ctest.txt" \
  || tail -30 "$out/native.log"
for bench in "$@"; do
  name=$(basename "${bench%% *}" .py)
  python3 bench/$bench --json "$out/$name.json" 2>"$out/$name.err" | tee "$out/$name.txt"
done
