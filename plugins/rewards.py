"""Built-in reward functions (slime's signature: ``async rm(args, sample) -> float``).

Selected with ``--rm-type``:

- ``math``: the final answer of the response (the last ``\\boxed{...}``, else the last number)
  compared with the label, numerically when both parse as numbers.
- ``exact_match``: the stripped response equals the stripped label.
- ``toy_arithmetic``: the toy task's checker: the response is exactly the label's number,
  optionally followed by one end-of-sequence token (``"19"`` or ``"19<eos>"``).
- ``remote``: ``POST --rm-url`` with ``{prompt, response, label, metadata}``; the answer is a
  number or ``{"reward": number}`` (used automatically when ``--rm-url`` is given).
- ``deepscaler`` (slime's rule): the answer is the last ``\\boxed{}`` of the text after the last
  ``</think>`` (or after ``###Response``); no such marker, no boxed answer or an empty label is 0.
  The comparison is ``answers_match`` (numbers, ``\\frac``, normalised strings), not slime's
  mathd/sympy graders.
- ``remote_rm`` (slime's): ``POST --rm-url`` with ``{prompt, response, label}``; the JSON answer is
  the reward as it is (a number, or a dict read with ``--reward-key``); failures are retried up to
  10 times with backoff, as slime does.

- ``dapo`` (slime's): DAPO's rule (``slime.rollout.rm_hub.math_dapo_utils.compute_score``): the last
  ``Answer: ...`` line of the response's last 300 characters against the label; returns DAPO's dict
  ``{"score": 1.0 or -1.0, "acc", "pred"}``, so it needs ``--reward-key score``.
- ``f1`` (slime's): token-level F1 of the response against the label after SQuAD's normalisation
  (lower case, no punctuation, no articles); a yes/no/noanswer on either side must match exactly.
- ``gpqa`` (slime's): multiple choice. The chosen letter is read from the text after ``</think>``
  ("answer is B", "B is correct", else the last standalone valid capital letter) and compared
  with the correct letter (``sample.metadata["correct_letter"]``, a one-letter label, or a label
  that is an option's index or text in ``metadata["choices"]``); without a letter, the correct
  option's text (or the label) appearing in the response counts.
- ``random`` (slime's): 0 or 1 at random.
- ``boxed_<type>`` (slime's prefix, any rule above but the remote ones): the rule applied to the
  content of the response's last ``\\boxed{}`` (an empty response when there is none).

slime's ``ifbench`` is refused at start-up (``check_rm_type``): its checkers are IFBench's
``evaluation_lib``, which slime clones from GitHub and pip-installs at import time.

The rule-based ones return 1.0 for correct and 0.0 for wrong (dapo: -1.0); they raise on bad input
(e.g. a missing label), which the rollout manager records as a failed sample.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from typing import Any, Callable

from plugins.math_answers import answers_match, dapo_score, extract_answer, last_boxed, strip_latex  # noqa: F401

_TRAILING_SPECIAL = re.compile(r"(?:<\|?[A-Za-z_/][\w/]*\|?>|</s>)\s*$")


def _need_label(sample: Any) -> str:
    if sample.label is None:
        raise ValueError(f"sample {sample.index}: no label to compare with (set --label-key)")
    return str(sample.label).strip()


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


def deepscaler_reward(response: str, label: Any) -> float:
    """slime's ``deepscaler`` rule on a response and a label (see the module doc)."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    answer = last_boxed(solution)
    label = "" if label is None else str(label)
    if answer is None or label == "":
        return 0.0
    truth = last_boxed(label) if "\\boxed" in label else label
    if truth is None:
        return 0.0
    return 1.0 if answers_match(strip_latex(answer), strip_latex(truth)) else 0.0


async def deepscaler_rm(args: Any, sample: Any) -> float:
    """slime's ``deepscaler`` rule: the boxed answer after the reasoning, compared with the label."""
    return deepscaler_reward(sample.response, sample.label)


async def slime_remote_rm(args: Any, sample: Any, max_retries: int = 10) -> Any:
    """slime's ``remote_rm``: POST ``{prompt, response, label}`` to ``--rm-url``; the JSON answer as it is."""
    import asyncio
    import random

    import aiohttp

    if not getattr(args, "rm_url", None):
        raise ValueError("--rm-type remote_rm needs --rm-url")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    for attempt in range(max_retries):
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                async with session.post(args.rm_url, json=payload) as resp:
                    resp.raise_for_status()
                    return await resp.json(content_type=None)
        except Exception:
            if attempt + 1 >= max_retries:
                raise
            await asyncio.sleep(min(2 ** attempt, 30) * (0.5 + random.random() / 2))


async def dapo_rm(args: Any, sample: Any) -> dict[str, Any]:
    """slime's ``dapo`` rule: DAPO's ``{"score", "acc", "pred"}`` (read with ``--reward-key score``)."""
    return dapo_score(sample.response, _need_label(sample))


_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_NO_PUNCT = str.maketrans("", "", string.punctuation)
_YES_NO = ("yes", "no", "noanswer")


def _squad_normalise(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_NO_PUNCT)).split())


def f1_reward(prediction: str | None, truth: str) -> tuple[float, float, float]:
    """slime's ``f1``: ``(f1, precision, recall)`` of the normalised tokens (see the module doc)."""
    if prediction is None:
        return 0.0, 0.0, 0.0
    pred, gold = _squad_normalise(prediction), _squad_normalise(truth)
    if (pred in _YES_NO or gold in _YES_NO) and pred != gold:
        return 0.0, 0.0, 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0, 0.0, 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


async def f1_rm(args: Any, sample: Any) -> float:
    """slime's ``f1`` rule: token F1 of the response against the label."""
    return f1_reward(sample.response, _need_label(sample))[0]


# slime's gpqa: where a response names its option, tried in this order (first match of each)
_LETTER_PATTERNS = [re.compile(p, re.IGNORECASE) for p in (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])",
    r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])")]


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if text else ""


def _plain(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _chosen_letter(response: str, valid: list[str]) -> str | None:
    text = _after_thinking(response)
    for pattern in _LETTER_PATTERNS:
        m = pattern.search(text)
        if m and m.group(1).upper() in valid:
            return m.group(1).upper()
    standalone = [c for c in re.findall(r"\b([A-Z])\b", text) if c in valid]
    return standalone[-1] if standalone else None


def gpqa_reward(response: str | None, label: Any, metadata: dict | None = None) -> float:
    """slime's ``gpqa`` rule on a response, its label and the sample's metadata (module doc)."""
    if not response:
        return 0.0
    metadata = metadata or {}
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else (list(choices) if choices is not None else None)
    if metadata.get("valid_letters"):
        valid = [str(x).upper() for x in metadata["valid_letters"]]
    else:
        valid = list(string.ascii_uppercase[:len(choices) if choices else 10])
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = label.strip() if isinstance(label, str) else None
    if label_text is not None:
        if len(label_text) == 1 and label_text.upper() in valid and not correct:
            correct = label_text.upper()
    elif isinstance(label, (int, float)) and 0 <= int(label) < len(valid):
        correct = valid[int(label)]
    targets = [label_text] if label_text else []
    if not correct and choices and label_text:  # a label giving the option's text names its letter
        for i, choice in enumerate(choices):
            if _plain(str(choice)) == _plain(label_text):
                correct = valid[i]
                break
    chosen = _chosen_letter(response, valid)
    if chosen and correct:
        return 1.0 if chosen == correct else 0.0
    if correct and choices and correct in valid and valid.index(correct) < len(choices):
        targets.append(str(choices[valid.index(correct)]))
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    said = _plain(_after_thinking(response))
    if any(_plain(t) and _plain(t) in said for t in targets):
        return 1.0
    if chosen and not correct and label_text:
        return 1.0 if chosen == label_text.upper() else 0.0
    return 0.0


async def gpqa_rm(args: Any, sample: Any) -> float:
    """slime's ``gpqa`` rule (multiple choice; reads ``sample.metadata``)."""
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    return gpqa_reward(sample.response, sample.label, metadata)


async def random_rm(args: Any, sample: Any) -> int:
    """slime's ``random``: 0 or 1, each with probability 1/2."""
    return random.randint(0, 1)


def _on_boxed(rule: Callable) -> Callable:
    """slime's ``boxed_`` prefix: ``rule`` sees only the last ``\\boxed{}`` content of the response."""
    async def rm(args: Any, sample: Any) -> Any:
        return await rule(args, sample.copy(response=last_boxed(sample.response) or ""))

    rm.__name__ = rm.__qualname__ = f"boxed_{rule.__name__}"
    rm.__doc__ = f"``{rule.__name__}`` on the content of the response's last ``\\\\boxed{{}}``."
    return rm


_RULES: dict[str, Callable] = {
    "math": math_rm,
    "exact_match": exact_match_rm,
    "toy_arithmetic": toy_arithmetic_rm,
    "deepscaler": deepscaler_rm,
    "dapo": dapo_rm,
    "f1": f1_rm,
    "gpqa": gpqa_rm,
    "random": random_rm,
}
REMOTE_RMS = ("remote", "remote_rm")  # the --rm-type values that post to --rm-url
#: every ``--rm-type`` value: the rules, each also with slime's ``boxed_`` prefix, and the remote ones
BUILTIN_RMS: dict[str, Callable] = {**_RULES, **{f"boxed_{k}": _on_boxed(f) for k, f in _RULES.items()},
                                    "remote": remote_rm, "remote_rm": slime_remote_rm}
#: rm types slime ships that cannot run here, and why
REFUSED_RMS = {
    "ifbench": "slime's ifbench rule runs IFBench's instruction checkers (allenai/IFBench's evaluation_lib), "
               "which slime git-clones and pip-installs when the rule is first imported; Reservoir does not "
               "fetch code at run time. Score it with a --custom-rm-path function that imports evaluation_lib",
}
#: rules returning a dict, read with --reward-key
DICT_RMS = ("dapo", "boxed_dapo")


def check_rm_type(rm_type: str, reward_key: str | None = None) -> None:
    """ValueError naming ``--rm-type``, the value and why, for a value that cannot run."""
    base = rm_type.removeprefix("boxed_")
    if rm_type in REFUSED_RMS or base in REFUSED_RMS:
        raise ValueError(f"--rm-type {rm_type}: not supported: {REFUSED_RMS[base]}")
    if rm_type not in BUILTIN_RMS:
        raise ValueError(f"--rm-type {rm_type!r}: choose one of {sorted(BUILTIN_RMS)}")
    if rm_type in DICT_RMS and not reward_key:
        raise ValueError(f"--rm-type {rm_type} returns DAPO's dict {{score, acc, pred}}: add --reward-key score")
