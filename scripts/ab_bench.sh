#!/usr/bin/env bash
# A/B of a change in one device session: A = this tree, B = this tree with PATCH applied, each built in its
# own copy (no editable install, which would shadow the other through its import hook), then one bench
# alternated A, B, A, B, ... ROUNDS times, e.g.
#   git diff main pending/x > scratch/x.patch
#   bash scripts/ab_bench.sh scratch/x.patch "p2p.py --sizes 4K --tuple-sizes 64K --no-gemm --reps 9" 3
# With AB_PYTEST="-m cuda tests/test_transport.py ..." it first runs those tests against B.
# Outputs land in /tmp/pipecomm-ab (and $OUT/ab.tgz when $OUT is set): A-1.txt, B-1.txt, ...
set -uo pipefail
patch_file=$(realpath "$1") bench=$2 rounds=${3:-3}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# The image's /opt/gcc g++ links libstdc++ statically, which breaks next to torch's; see gpu_check.sh.
export CC=gcc CXX=g++ LDSHARED="g++ -shared"
work=/tmp/pipecomm-ab
rm -rf "$work" && mkdir -p "$work/A" "$work/B"
python3 -m pip uninstall -y -q pipecomm > /dev/null 2>&1
for side in A B; do
  tar cf - --exclude=./build --exclude=./.git --exclude='./pipecomm/_C*.so' . | tar xf - -C "$work/$side"
done
(cd "$work/B" && patch -p1 -s < "$patch_file") || { echo "the patch does not apply"; exit 1; }
for side in A B; do
  (cd "$work/$side" && MAX_JOBS=8 python3 setup.py -q build_ext --inplace > "$work/build-$side.log" 2>&1) &
done
wait
for side in A B; do
  ls "$work/$side"/pipecomm/_C*.so > /dev/null 2>&1 || { echo "build $side failed:"; grep -m5 error "$work/build-$side.log"; exit 1; }
  imported=$(cd "$work/$side" && PYTHONPATH="$work/$side" python3 -c "import pipecomm; print(pipecomm.__file__)")
  [ "$imported" = "$work/$side/pipecomm/__init__.py" ] || { echo "side $side imports $imported"; exit 1; }
done
if [ -n "${AB_PYTEST:-}" ]; then
  # shellcheck disable=SC2086  # pytest's own arguments split on spaces
  (cd "$work/B" && PYTHONPATH="$work/B" timeout "${AB_PYTEST_TIMEOUT:-300}" python3 -m pytest $AB_PYTEST -q \
    -p no:cacheprovider > "$work/pytest-B.txt" 2>&1)
  echo "pytest on B exit $?"; tail -3 "$work/pytest-B.txt"
fi
read -ra words <<< "$bench"
for round in $(seq "$rounds"); do
  for side in A B; do
    # shellcheck disable=SC2086  # the bench's own arguments split on spaces
    (cd "$work/$side" && PYTHONPATH="$work/$side" timeout "${BENCH_TIMEOUT:-120}" python3 "bench/${words[0]}" \
      "${words[@]:1}" --json "$work/$side-$round.json" > "$work/$side-$round.txt" 2> "$work/$side-$round.err")
    echo "$side round $round exit $?"
    grep -v "^# [a-z_0-9]*:" "$work/$side-$round.txt" | head -${AB_LINES:-6}
  done
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/ab.tgz" -C "$work" --exclude=A --exclude=B .; fi
done
