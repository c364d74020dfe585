#!/usr/bin/env bash
# The GPU check, one command: bash tests/gpu/run.sh
#
# On a machine with one or more NVIDIA GPUs: installs rdkeras with the CUDA extra into a fresh venv,
# then (tests/gpu/check.py) trains 2 data-parallel workers and a 2-stage pipeline on the GPU(s)
# (2 workers share one GPU where there is only one), checks their weights against one process, and
# prints throughput against one GPU alone (python -m rdkeras.bench fit). Elsewhere it prints SKIP and
# the reason, and exits 0. About 4-6 minutes, most of it the install.
#
#   RDKERAS_GPU_VENV=DIR   the venv to make (default: a fresh one under /tmp, removed afterwards)
#   PIP_INDEX_URL / PIP_FIND_LINKS   pip's own variables, for a machine without PyPI (a wheelhouse)
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v nvidia-smi > /dev/null 2>&1; then
  echo "SKIP: no NVIDIA GPU here (nvidia-smi not found)"
  exit 0
fi
if ! gpus=$(nvidia-smi -L 2> /dev/null) || [ -z "$gpus" ]; then
  echo "SKIP: no NVIDIA GPU here (nvidia-smi -L lists none)"
  exit 0
fi
echo "$gpus"
started=$(date +%s)
venv=${RDKERAS_GPU_VENV:-}
if [ -z "$venv" ]; then
  scratch=$(mktemp -d /tmp/rdkeras-gpu-XXXXXX)
  trap 'rm -rf "$scratch"' EXIT
  venv=$scratch/venv
fi
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q --upgrade pip
pip install -q -e ".[and-cuda,test]"
echo "installed in $(($(date +%s) - started)) s: $(python -c 'import tensorflow as tf; print("tensorflow", tf.__version__, len(tf.config.list_physical_devices("GPU")), "GPU(s)")')"
PYTHONPATH=$PWD timeout 420 python -m tests.gpu.check
echo "GPU check passed in $(($(date +%s) - started)) s"
