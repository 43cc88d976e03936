#!/usr/bin/env bash
# The main job on a fresh machine: set up the environment, then train the toy model with GRPO on
# the CPU (2 embedded engines behind sglang-router, the buffer actor, the torch trainer).
# The toy model is built on first use. Extra arguments are passed to scripts/train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
set -euo pipefail
export PYTHONUNBUFFERED=1  # Ray's token auth stays on (Ray's default)
# Ray binds every interface; keep it on loopback only (needs root; falls back to the host network).
if unshare -n true 2>/dev/null; then
  exec unshare -n bash -c 'ip link set lo up && exec python scripts/train.py "$@"' bash \
    --config examples/toy/grpo_cpu.yaml --output-dir runs/toy "$@"
fi
exec python scripts/train.py --config examples/toy/grpo_cpu.yaml --output-dir runs/toy "$@"
