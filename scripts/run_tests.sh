#!/usr/bin/env bash
# Runs the CPU test suite inside a loopback-only network namespace (needs root, as CI is).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && . .venv/bin/activate
export PYTHONUNBUFFERED=1  # Ray's token auth stays on (Ray's default)
exec unshare -n bash -c 'ip link set lo up && exec python -m pytest -q "$@"' bash "$@"
