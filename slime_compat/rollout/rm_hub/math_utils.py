"""``slime.rollout.rm_hub.math_utils``: boxed-answer extraction and answer grading.

``extract_answer`` is the last ``\\boxed{}`` (or ``\\fbox{}``) content; ``grade_answer_verl`` compares
a response's boxed answer with the label using Reservoir's ``answers_match`` (numbers, fractions,
normalised strings; not slime's sympy-based grader)."""

from __future__ import annotations

from plugins.math_answers import answers_match, last_boxed, strip_latex


def extract_answer(passage: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), or None."""
    if "\\boxed" not in passage and "\\fbox" in passage:
        passage = passage.replace("\\fbox", "\\boxed")
    return last_boxed(passage)


def grade_answer_verl(solution_str: str, ground_truth: str) -> bool:
    """Whether the last boxed answer of ``solution_str`` equals ``ground_truth`` (itself maybe boxed)."""
    if not ground_truth:
        return False
    truth = last_boxed(ground_truth) if "\\boxed" in ground_truth else ground_truth
    answer = extract_answer(solution_str)
    if answer is None or truth is None:
        return False
    return answers_match(strip_latex(answer), strip_latex(truth))
