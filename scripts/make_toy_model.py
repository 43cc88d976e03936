"""Build the toy task offline: a tiny llama-architecture chat model with a character-level
tokenizer, and a synthetic arithmetic task (train/eval prompts with labels).

    python scripts/make_toy_model.py --out examples/toy/model [--warmup-steps 200]

Writes ``DIR/`` (an HF checkpoint that ``AutoModelForCausalLM``/``AutoTokenizer`` and the
sglang-router load offline) and ``DIR/data/{train,eval}.jsonl`` with ``{"prompt", "label"}``
rows, e.g. ``{"prompt": "12+7=", "label": "19"}``. With ``--warmup-steps`` the model is first
fine-tuned briefly on correct answers, so that RL starts from a low but non-zero accuracy.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARS = list("0123456789+-*=?.,:;!()[]{}<>/\\'\" _#") + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
    [chr(c) for c in range(ord("A"), ord("Z") + 1)] + ["\n"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(out: Path):
    """A character-level fast tokenizer: every character is one token, specials are atomic."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>",
                                   additional_special_tokens=SPECIALS[4:])
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


def write_task(out: Path, train: list[dict], evals: list[dict]) -> None:
    """Write the task as ``out/data/{train,eval}.jsonl`` (one ``{"prompt", "label"}`` row a line)."""
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", evals)):
        with open(out / "data" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def warmup(model, tok, rows: list[dict], steps: int, lr: float, batch: int, seed: int) -> None:
    """Supervised warm-up on ``<|user|>q<|assistant|>answer<eos>``, loss on the answer only."""
    import torch

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    encoded = []
    for r in rows:
        p = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                    tokenize=False)
        p_ids = tok(p, add_special_tokens=False)["input_ids"]
        a_ids = tok(r["label"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        encoded.append((p_ids, a_ids))
    model.train()
    for step in range(steps):
        idx = torch.randint(len(encoded), (batch,), generator=g).tolist()
        seqs = [encoded[i][0] + encoded[i][1] for i in idx]
        T = max(map(len, seqs))
        ids = torch.full((batch, T), tok.pad_token_id)  # [B, T]
        labels = torch.full((batch, T), -100)  # [B, T]
        attn = torch.zeros((batch, T), dtype=torch.long)  # [B, T]
        for j, i in enumerate(idx):
            p, a = encoded[i]
            ids[j, :len(p) + len(a)] = torch.tensor(p + a)
            labels[j, len(p):len(p) + len(a)] = torch.tensor(a)
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
    args = ap.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(args.out)
    model = build_model(len(tok), args.seed, args.hidden_size, args.num_layers)
    train = make_task(args.num_train, args.max_operand, args.seed + 1)
    evals = make_task(args.num_eval, args.max_operand, args.seed + 2)
    if args.warmup_steps:
        warmup(model, tok, train, args.warmup_steps, args.warmup_lr, args.warmup_batch_size, args.seed)
    model.save_pretrained(args.out, safe_serialization=True)
    write_task(args.out, train, evals)
    print(f"wrote {args.out} ({sum(p.numel() for p in model.parameters())} parameters, vocab {len(tok)})")
    return args.out


if __name__ == "__main__":
    main()
