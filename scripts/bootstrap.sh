#!/usr/bin/env bash
# Installs what building and testing pipecomm needs, only what is missing: a GPU machine keeps its torch.
set -euo pipefail
python=${PYTHON:-python3}

missing=()
# torch==2.13.0 is the CPU wheel on this project's machines; a bare "torch" would pull a CUDA build.
"$python" -c "import torch" 2>/dev/null || missing+=("torch==2.13.0")
"$python" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 64)" 2>/dev/null \
  || missing+=("setuptools>=64")
# numpy: torch's wheel does not pull it in, but torch.distributed's object collectives (all_gather_object,
# gather_object, which pipecomm uses) need it.
# transformers: the real-model tests build Hugging Face models from configs (no weights are downloaded);
# pinned, since its models' code is what the capture tests exercise.
# numba: the schedule simulator's and planner's inner loops (pipecomm/fast_simulation.py).
# tqdm: the demo's progress bar (examples/demo.py).
for module_and_package in wheel:wheel numpy:numpy numba:numba tqdm:tqdm pytest:pytest \
    pytest_benchmark:pytest-benchmark transformers:transformers==5.24.0; do
  "$python" -c "import ${module_and_package%%:*}" 2>/dev/null || missing+=("${module_and_package#*:}")
done
command -v ninja >/dev/null || missing+=(ninja)
command -v cmake >/dev/null || missing+=(cmake)

if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  "$python" -m pip install --quiet "${missing[@]}"
fi
