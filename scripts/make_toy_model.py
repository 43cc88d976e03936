"""Build the toy task offline: a tiny llama-architecture chat model with a character-level
tokenizer, and a synthetic arithmetic task (train/eval prompts with labels).

    python scripts/make_toy_model.py --out examples/toy/model [--warmup-steps 200]

Writes ``DIR/`` (an HF checkpoint that ``AutoModelForCausalLM``/``AutoTokenizer`` and the
sglang-router load offline) and ``DIR/data/{train,eval}.jsonl`` with ``{"prompt", "label"}``
rows, e.g. ``{"prompt": "12+7=", "label": "19"}``. With ``--warmup-steps`` the model is first
fine-tuned briefly on correct answers, so that RL starts from a low but non-zero accuracy.

``--tool-task`` builds the multi-turn tool task instead (docs/agent.md): the vocabulary gains a
``<|tool|>`` role token (at its end: the other ids are unchanged; without the flag nothing differs),
the prompts are products of two-digit numbers (``{"prompt": "37*48=", "label": "1776"}``), which
the toy model cannot compute in its head, and the warm-up teaches two ways to answer: a share
``--tool-warmup-frac`` of its examples call the Python tool and copy its answer
(``<|assistant|><code>eval(q)</code><eos><|tool|>1776<|assistant|>1776<eos>``: the environment
gives the code the question as ``q``), the others guess directly (``<|assistant|>1776<eos>``). RL
with ``--agent-env plugins.python_env.make_toy_tool_env`` then learns to prefer the tool.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
TOOL_ROLE = "<|tool|>"  # --tool-task only: appended after CHARS, so every other id stays as it is
# The --tool-task's tool call: the question is the code's variable q (plugins.python_env.make_toy_tool_env),
# so the toy need not learn to copy the operands (a warm-up of affordable CPU time does not teach it)
TOOL_CALL = "<code>eval(q)</code>"
CHARS = list("0123456789+-*=?.,:;!()[]{}<>/\\'\" _#") + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
    [chr(c) for c in range(ord("A"), ord("Z") + 1)] + ["\n"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(out: Path, tool_role: bool = False):
    """A character-level fast tokenizer: every character is one token, specials are atomic
    (``tool_role``: with the ``<|tool|>`` role token last)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS + ([TOOL_ROLE] if tool_role else []))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>",
                                   additional_special_tokens=SPECIALS[4:] + ([TOOL_ROLE] if tool_role else []))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(vocab_size: int, seed: int, hidden: int, layers: int):
    import torch  # here, not at the top: the launcher reads DEFAULT_DIR while parsing, before torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         torch_dtype="float32")
    return LlamaForCausalLM(config)


def make_task(n: int, max_operand: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(max_operand), rng.randrange(max_operand)
        rows.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
    return rows


def make_tool_task(n: int, seed: int) -> list[dict]:
    """Products of two two-digit numbers: ``{"prompt": "37*48=", "label": "1776"}``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        rows.append({"prompt": f"{a}*{b}=", "label": str(a * b)})
    return rows


def tool_transcript(prompt: str, label: str, use_tool: bool) -> list[dict]:
    """The conversation the --tool-task warm-up teaches for one row: with the tool (call it on the
    prompt's expression, copy its answer) or without (answer directly)."""
    messages = [{"role": "user", "content": prompt}]
    if use_tool:
        messages += [{"role": "assistant", "content": TOOL_CALL},
                     {"role": "tool", "content": label}]
    return messages + [{"role": "assistant", "content": label}]


def write_task(out: Path, train: list[dict], evals: list[dict], prefix: str = "") -> None:
    """Write the task as ``out/data/{prefix}{train,eval}.jsonl`` (one ``{"prompt", "label"}`` row a line)."""
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", evals)):
        with open(out / "data" / f"{prefix}{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def _plain_example(tok, r: dict) -> tuple[list[int], list[int]]:
    p = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                tokenize=False)
    p_ids = tok(p, add_special_tokens=False)["input_ids"]
    return p_ids, tok(r["label"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def _tool_example(tok, r: dict, use_tool: bool) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, the rest, its loss mask: 1 on the assistant turns only)."""
    messages = tool_transcript(r["prompt"], r["label"], use_tool)
    p_ids = tok(tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"]
    ids = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    rest, mask = ids[len(p_ids):], [1] * (len(ids) - len(p_ids))
    if use_tool:  # the tool's turn and the next generation prompt are not the model's
        env = tok(tok.apply_chat_template(messages[:3], add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        call = tok(tok.apply_chat_template(messages[:2], tokenize=False), add_special_tokens=False)["input_ids"]
        mask[len(call) - len(p_ids):len(env) - len(p_ids)] = [0] * (len(env) - len(call))
    return p_ids, rest, mask


def warmup(model, tok, rows: list[dict], steps: int, lr: float, batch: int, seed: int,
           tool_frac: float | None = None) -> None:
    """Supervised warm-up on ``<|user|>q<|assistant|>answer<eos>``, loss on the answer only
    (``tool_frac``: the --tool-task's transcripts, that share of them with the tool, loss on the
    assistant turns only)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    encoded = [_plain_example(tok, r) for r in rows] if tool_frac is None else \
        [_tool_example(tok, r, random.Random(seed + i).random() < tool_frac) for i, r in enumerate(rows)]
    model.train()
    for step in range(steps):
        idx = torch.randint(len(encoded), (batch,), generator=g).tolist()
        seqs = [encoded[i][0] + encoded[i][1] for i in idx]
        T = max(map(len, seqs))
        ids = torch.full((batch, T), tok.pad_token_id)  # [B, T]
        labels = torch.full((batch, T), -100)  # [B, T]
        attn = torch.zeros((batch, T), dtype=torch.long)  # [B, T]
        for j, i in enumerate(idx):
            p, a = encoded[i][:2]
            mask = encoded[i][2] if len(encoded[i]) == 3 else [1] * len(a)
            ids[j, :len(p) + len(a)] = torch.tensor(p + a)
            labels[j, len(p):len(p) + len(a)] = torch.tensor([t if m else -100 for t, m in zip(a, mask)])
            attn[j, :len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"warmup step {step}: loss {loss.item():.4f}")
    model.eval()


DEFAULT_DIR = Path(__file__).resolve().parents[1] / "examples" / "toy" / "model"  # the toy config's path


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, type=Path, help="output directory (HF checkpoint + data/)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--max-operand", type=int, default=10, help="operands are drawn from [0, max-operand)")
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--num-eval", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=0, help="supervised warm-up steps (0 = none)")
    ap.add_argument("--warmup-lr", type=float, default=3e-3)
    ap.add_argument("--warmup-batch-size", type=int, default=32)
    ap.add_argument("--tool-task", action="store_true", help="the multi-turn tool task: a <|tool|> role token, "
                    "two-digit products, a warm-up with and without the Python tool (see above)")
    ap.add_argument("--tool-warmup-frac", type=float, default=0.3,
                    help="--tool-task: share of warm-up examples that call the tool")
    args = ap.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(args.out, tool_role=args.tool_task)
    model = build_model(len(tok), args.seed, args.hidden_size, args.num_layers)
    if args.tool_task:
        train, evals = make_tool_task(args.num_train, args.seed + 1), make_tool_task(args.num_eval, args.seed + 2)
    else:
        train = make_task(args.num_train, args.max_operand, args.seed + 1)
        evals = make_task(args.num_eval, args.max_operand, args.seed + 2)
    if args.warmup_steps:
        warmup(model, tok, train, args.warmup_steps, args.warmup_lr, args.warmup_batch_size, args.seed,
               tool_frac=args.tool_warmup_frac if args.tool_task else None)
    model.save_pretrained(args.out, safe_serialization=True)
    write_task(args.out, train, evals)
    print(f"wrote {args.out} ({sum(p.numel() for p in model.parameters())} parameters, vocab {len(tok)})")
    return args.out


if __name__ == "__main__":
    main()
