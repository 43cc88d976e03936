"""Final answers of math responses, and how two of them compare: the primitives of the built-in
math rewards (``plugins.rewards``) and DAPO's rule, which slime plugins import as
``slime.rollout.rm_hub.math_dapo_utils`` (``slime_compat`` re-exports it from here).

DAPO's rule: ``compute_score(solution_str, ground_truth, strict_box_verify=False)`` looks at the
last 300 characters of the solution: the answer is the last ``Answer: ...`` line (or, with
``strict_box_verify``, the last ``\\boxed{}``), normalised and compared with the label. It returns
DAPO's dict, ``{"score": 1.0 or -1.0, "acc": bool, "pred": str}`` (read it with ``--reward-key
score``). The normalisation is ours (LaTeX wrappers dropped, numbers compared as numbers), not the
upstream list of substitutions, so rare answers may grade differently.
"""

from __future__ import annotations

import math
import re
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


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


def strip_latex(s: str) -> str:
    """Drop the LaTeX wrappers that do not change a final answer (``\\text{}``, ``\\left``, ``^\\circ``...)."""
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "^\\circ", "^{\\circ}", "\\%", "$"):
        s = s.replace(token, "")
    return s.replace("dfrac", "frac").replace("tfrac", "frac").strip()


_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def last_boxed_only_string(string: str) -> str | None:
    """The last ``\\boxed{...}`` of ``string`` with its wrapper, or None."""
    inner = last_boxed(string.replace("\\fbox", "\\boxed"))
    return None if inner is None else "\\boxed{" + inner + "}"


def remove_boxed(s: str) -> str:
    return s[len("\\boxed{"):-1] if s.startswith("\\boxed{") and s.endswith("}") else s


def normalize_final_answer(answer: str) -> str:
    """The answer without LaTeX wrappers, the text before a final ``=``, and trailing punctuation."""
    answer = answer.split("=")[-1]
    inner = last_boxed(answer)
    if inner is not None:
        answer = inner
    return strip_latex(answer).strip().rstrip(".").strip()


def is_correct_minerva(solution_str: str, gt: str, gt_need_extract: bool = False,
                       answer_pattern: str = _ANSWER.pattern) -> tuple[bool, str]:
    """The last ``Answer: ...`` of the solution against ``gt``: (correct, the prediction)."""
    matches = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(matches[-1]) if matches else "[INVALID]"
    if gt_need_extract:
        gt = normalize_final_answer(remove_boxed(last_boxed_only_string(gt) or gt))
    else:
        gt = normalize_final_answer(gt)
    return (matches != [] and answers_match(pred, gt)), pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """The last boxed answer against ``gt``: (1 or -1, the extracted answer)."""
    if pause_tokens_index is not None and len(pause_tokens_index) == 4:
        pred = pred[pause_tokens_index[-1] - 100:]
    else:
        pred = pred[-100:]
    boxed = last_boxed_only_string(pred)
    extracted = normalize_final_answer(remove_boxed(boxed)) if boxed is not None else None
    return (1 if extracted is not None and answers_match(extracted, normalize_final_answer(gt)) else -1), extracted


def verify(solution_str: str, answer: str, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    if strict_box_verify:
        correct, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return correct == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    """DAPO's reward: ``{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}``."""
    correct, pred = verify(solution_str[-300:], str(ground_truth), strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


dapo_score = compute_score  # the name plugins.rewards dispatches ``--rm-type dapo`` to
