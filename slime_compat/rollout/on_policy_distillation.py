"""``slime.rollout.on_policy_distillation``: slime's OPD post-process hook, for ``--use-opd --opd-type sglang``.

slime's ``reward_func`` asks the teacher (``--rm-url``) for the log-probs of each sample's tokens and
returns its whole answer as the reward; ``post_process_rewards`` (a ``--custom-reward-post-process-path``)
then moves them to ``sample.teacher_log_probs`` and trains on zero rewards: pure distillation, the
advantages are the reverse-KL term alone. In Reservoir the rollout manager asks the teacher itself
(``--opd-teacher-url`` / ``--opd-teacher-load``, ``rollout_manager/teacher.py``), so the reward stays the
task's (the evaluation's accuracy still means something) and only ``post_process_rewards`` is
needed for pure distillation. ``reward_func`` is not provided: a reward that is a whole SGLang
answer has no place in a buffer of scalar rewards.
"""

from __future__ import annotations

from typing import Any

from buffer.sample import Sample


def post_process_rewards(args: Any, samples: list[Sample], **kwargs: Any) -> tuple[list[float], list[float]]:
    """Zero rewards for every sample (slime's ``(raw_rewards, rewards)``): pure on-policy
    distillation. The teacher's log-probs are on the samples already; a sample whose reward is
    the teacher's SGLang answer (slime's ``reward_func``) has them taken from it, the last
    ``response_length`` of ``input_token_logprobs[1:]``, as slime does."""
    for s in samples:
        reward = s.reward
        if isinstance(reward, dict) and "meta_info" in reward:
            lps = [x[0] for x in reward["meta_info"]["input_token_logprobs"][1:]]
            s.teacher_log_probs = lps[len(lps) - s.response_length:]
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
