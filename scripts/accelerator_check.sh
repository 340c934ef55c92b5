#!/usr/bin/env bash
# The accelerator tier, in one prepared command for a machine with a TPU or GPU (at most
# ~10 minutes): the transfer floor, the tests marked `accelerator`, and the lm benchmark,
# into one log. On such a machine jax (with its accelerator plugin), flax, optax,
# orbax-checkpoint and tensorstore are expected installed; crc32c and ml_dtypes may need
# carrying as wheels. tpu_ckpt itself runs from this checkout (PYTHONPATH).
#   usage: scripts/accelerator_check.sh [LOG]     (default: $OUT/accelerator_check.log or ./)
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${1:-${OUT:-.}/accelerator_check.log}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export JAX_PLATFORMS=""   # tests/conftest.py picks CPU unless told otherwise: any platform here
(
  status=0
  echo "== $(date -u) $(uname -m) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" || status=1
  echo "== transfer floor"
  timeout 120 "$PY" benchmarks/transfer_floor.py --megabytes 1024 --reps 5 || status=1
  echo "== accelerator tier"
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m accelerator tests/project/test_accelerator.py tests/saving/test_host_copies.py -rs || status=1
  echo "== benchmark: lm"
  timeout 240 "$PY" benchmarks/benchmark.py --workload lm --scale 0.5 --reps 2 || status=1
  echo "== exit $status"
  exit "$status"
) 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
