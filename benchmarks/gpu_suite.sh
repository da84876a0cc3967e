#!/usr/bin/env bash
# The GPU suite, one command on a GPU machine that has no network (about 8 minutes on one H200):
#   1. installs the wheels carried in benchmarks/wheels/ (made on a networked machine by `make gpu-wheels`:
#      tokamax and the pure-Python packages the GPU image lacks; JAX with CUDA comes from the image);
#   2. checks every GPU kernel path against its reference path on the GPU (benchmarks/gpu_check.py);
#   3. benchmarks each config at the largest batch that fits (from the deviceless H200 compile,
#      docs/observability.md), halving the batch if it does not: tokens/s, TFLOP/s, MFU, peak memory;
#   4. with time left, A/Bs on bench-v3-1b: FP8 GEMMs (train.fp8=true), XLA's default order
#      (train.latency_hiding=false) and cuBLAS GEMMs.
# Everything is appended as JSON lines to OUT_DIR (check.jsonl, bench.jsonl) and printed.
#
#   benchmarks/gpu_suite.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/gpu_suite.sh OUT_DIR}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

if compgen -G "benchmarks/wheels/*.whl" > /dev/null; then
  for pkg in $(grep -v "^#" benchmarks/gpu-wheels.txt); do  # one at a time: one missing wheel stops nothing else
    "$PYTHON" -m pip install -q --no-index --no-deps --disable-pip-version-check --find-links benchmarks/wheels \
      "$pkg" 2>&1 | grep -v "^WARNING" | tail -1
  done
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
if ! "$PYTHON" -c "import jax, sys; sys.exit(jax.devices()[0].platform != 'gpu')"; then
  echo "error: no GPU visible to JAX" >&2
  exit 2
fi
"$PYTHON" -c "import jax, tokamax; print('jax', jax.__version__, 'tokamax', tokamax.__version__, jax.devices())"

echo "== kernel checks ($(elapsed) s)"
timeout 180 "$PYTHON" benchmarks/gpu_check.py --out "$OUT/check.jsonl"
echo "kernel checks exit $? ($(elapsed) s)"

bench() {  # config, batch, extra overrides...: the batch, else half of it
  local config=$1 batch=$2
  shift 2
  for b in "$batch" $(( batch / 2 )); do
    echo "== $config batch $b $* ($(elapsed) s)"
    if timeout 240 "$PYTHON" benchmarks/bench_step.py --config "configs/$config.yaml" --steps 6 \
        --results "$OUT/bench.jsonl" "train.batch_size=$b" "$@"; then
      return 0
    fi
  done
}

# batch: the largest that the deviceless H200 compile fits in 0.92 of the memory with train.remat=none
bench bench-v3-1b 32
bench bench-v2-lite-8l 8
bench bench-dense-1b 16

if [ "$(elapsed)" -lt 330 ]; then
  # FP8 GEMMs (train.fp8=true: rowwise on sm_89/sm_90, MXFP8 on sm_100) against the bfloat16 step above
  bench bench-v3-1b 32 train.fp8=true
fi
if [ "$(elapsed)" -lt 360 ]; then
  # the step compiles with XLA's latency-hiding scheduler (train.latency_hiding, the default): against XLA's
  # default order; and cuBLAS instead of Triton GEMMs, which MaxText's and JAX's GPU guides set
  bench bench-v3-1b 32 train.latency_hiding=false
  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" bench bench-v3-1b 32
fi
echo "== done ($(elapsed) s)"
