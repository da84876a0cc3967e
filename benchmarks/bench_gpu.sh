#!/usr/bin/env bash
# Train-step throughput and MFU of a ~1B-parameter DeepSeek-V3-style model (configs/bench-v3-1b.yaml) in
# bfloat16 on one GPU. Installs nothing: run it in the environment made by `pip install -e ".[gpu]"`.
#
#   benchmarks/bench_gpu.sh [--steps N] [section.key=value ...]      e.g. train.batch_size=8 train.remat=full
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if ! "$PYTHON" -c "import jax, sys; sys.exit(jax.devices()[0].platform != 'gpu')" 2>/dev/null; then
  echo "error: no GPU visible to JAX; install the CUDA build with pip install -e '.[gpu]' and check nvidia-smi" >&2
  exit 2
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
exec "$PYTHON" benchmarks/bench_step.py --config configs/bench-v3-1b.yaml "$@"
