#!/usr/bin/env bash
# TRL's GRPOTrainer for the GPU machine (no internet there): the wheels bench/e2e.py --gpu needs for
# its TRL side, beside the SGLang bundle of ../shared/device/make_sglang_bundle.sh (which brings
# transformers). Builds OUT (default .device/trl, ~15 MB): whl/ and setup_trl.sh; on the GPU machine,
# `source .device/trl/setup_trl.sh` installs them into /tmp/trl-site and puts it on PYTHONPATH.
# pyarrow (55 MB) is left out: the GPU machine has it (Reservoir's buffer writes Parquet there);
# setup_trl.sh says what is still missing by importing trl.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.device/trl}
PY=${PY:-3.12}   # the GPU machine's python (../shared/ENVIRONMENT.md)
rm -rf "$OUT" && mkdir -p "$OUT/whl"
python -m pip download -q -d "$OUT/whl" --python-version "$PY" --only-binary=:all: --no-deps \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "trl==1.16.0" "accelerate==1.16.0" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" xxhash \
    "fsspec==2026.9.0" pandas psutil 2>&1 | grep -v "is ignored" || true
cat > "$OUT/setup_trl.sh" <<'SETUP'
# Source on the GPU machine from the repository root: TRL and what it needs beyond that machine's packages.
_t=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -d /tmp/trl-site/trl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/trl-site "$_t"/whl/*.whl 2>&1 | grep -v WARN || true
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/trl-site   # after the SGLang bundle's transformers
python3 -c "import trl, datasets, accelerate; print('trl', trl.__version__, 'datasets', datasets.__version__)" \
  || echo "setup_trl.sh: TRL does not import here (above: what is missing)"
SETUP
du -sh "$OUT"
