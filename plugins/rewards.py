"""Built-in reward functions (slime's signature: ``async rm(args, sample) -> float``).

Selected with ``--rm-type``:

- ``math``: the final answer of the response (the last ``\\boxed{...}``, else the last number)
  compared with the label, numerically when both parse as numbers.
- ``exact_match``: the stripped response equals the stripped label.
- ``toy_arithmetic``: the toy task's checker: the response is exactly the label's number,
  optionally followed by one end-of-sequence token (``"19"`` or ``"19<eos>"``).
- ``remote``: ``POST --rm-url`` with ``{prompt, response, label, metadata}``; the answer is a
  number or ``{"reward": number}`` (used automatically when ``--rm-url`` is given).

All return 1.0 for correct and 0.0 for wrong; they raise on bad input (e.g. a missing label),
which the rollout manager records as a failed sample.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_TRAILING_SPECIAL = re.compile(r"(?:<\|?[A-Za-z_/][\w/]*\|?>|</s>)\s*$")


def _need_label(sample: Any) -> str:
    if sample.label is None:
        raise ValueError(f"sample {sample.index}: no label to compare with (set --label-key)")
    return str(sample.label).strip()


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None  # unbalanced: no answer


def extract_answer(text: str) -> str | None:
    """The final answer: the last ``\\boxed{}`` content, else the last number in the text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(s: str) -> float | None:
    s = s.strip().strip("$").replace(",", "").replace(" ", "")
    if s.startswith("\\frac{") or "/" in s:
        m = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}|(-?[\d.]+)/(-?[\d.]+)", s)
        if m:
            a, b = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            try:
                return float(a) / float(b) if float(b) != 0 else None
            except ValueError:
                return None
    try:
        return float(s)
    except ValueError:
        return None


def answers_match(answer: str | None, label: str) -> bool:
    """Numeric comparison when both sides are numbers (relative tolerance 1e-6), else string equality."""
    if answer is None:
        return False
    a, b = _as_number(answer), _as_number(label)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    norm = lambda s: s.strip().strip("$").replace(" ", "").lower()  # noqa: E731
    return norm(answer) == norm(label)


async def math_rm(args: Any, sample: Any) -> float:
    """1.0 if the final answer (``\\boxed{}`` or last number) equals the label, else 0.0."""
    label = _need_label(sample)
    label_answer = last_boxed(label) or label
    return 1.0 if answers_match(extract_answer(sample.response), label_answer) else 0.0


async def exact_match_rm(args: Any, sample: Any) -> float:
    """1.0 if the stripped response equals the stripped label."""
    return 1.0 if sample.response.strip() == _need_label(sample) else 0.0


async def toy_arithmetic_rm(args: Any, sample: Any) -> float:
    """The toy task (``"12+7="`` -> ``"19"``): the response is the number, maybe then one EOS token."""
    label = _need_label(sample)
    text = _TRAILING_SPECIAL.sub("", sample.response, count=1).strip()
    return 1.0 if text == label else 0.0


async def remote_rm(args: Any, sample: Any) -> float:
    """POST the sample to ``args.rm_url``; the reward model answers a number or ``{"reward": x}``."""
    import aiohttp

    if not args.rm_url:
        raise ValueError("--rm-type remote needs --rm-url")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
               "metadata": sample.metadata}
    async with aiohttp.ClientSession() as session:
        async with session.post(args.rm_url, json=payload, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            if resp.status >= 400:
                raise RuntimeError(f"--rm-url {args.rm_url}: HTTP {resp.status}: {(await resp.text())[:200]}")
            out = await resp.json(content_type=None)
    value = out["reward"] if isinstance(out, dict) else out
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RuntimeError(f"--rm-url {args.rm_url}: expected a number or {{'reward': number}}, got {out!r}")
    return float(value)


BUILTIN_RMS: dict[str, Callable] = {
    "math": math_rm,
    "exact_match": exact_match_rm,
    "toy_arithmetic": toy_arithmetic_rm,
    "remote": remote_rm,
}
