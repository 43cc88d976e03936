#!/usr/bin/env bash
# The real-SGLang GPU tier (tests/test_sglang_gpu.py, marker sglang), on a GPU machine, from the
# repository root. SGLang (0.5.15.post1), Ray, sglang-router and megatron-core come from the
# folders that ../shared/device/make_sglang_bundle.sh and make_bundle.sh build (.device/sglang,
# .device/bundle) when they are here, else from the installed packages. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .device/sglang/setup_sglang.sh ]; then source .device/sglang/setup_sglang.sh; fi
if [ -f .device/bundle/setup.sh ]; then source .device/bundle/setup.sh; fi
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec python3 -m pytest -m sglang -p no:cacheprovider -s -q tests/test_sglang_gpu.py "$@"
