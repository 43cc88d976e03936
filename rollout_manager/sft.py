"""Supervised fine-tuning data: conversations (``messages``) become training samples whose loss
mask covers the assistant turns; no engine generates anything.

slime's SFT is ``--rollout-function-path slime.rollout.sft_rollout.generate_rollout`` with
``--loss-type sft_loss``; ``slime_compat.rollout.sft_rollout`` is :func:`generate_rollout` here.
Each ``--prompt-data`` row's ``--input-key`` holds a list of ``{role, content}`` messages (the
row's metadata may hold ``tools`` for the template). When the manager runs this rollout it loads
the rows as conversations (:func:`conversation_check`): a row without messages, without an
assistant turn, or one the chat template cannot render is skipped, logged and counted with its
file and line (an error with ``--strict-data``), before any step.

The loss mask (slime's ``MultiTurnLossMaskGenerator``, ``slime/utils/mask_utils.py``, by
``--loss-mask-type``):

- ``qwen`` / ``qwen3``: the conversation as the chat template renders it; an assistant turn's
  tokens after its generation prompt (its content and the template's close, ChatML's
  ``<|im_end|>\\n``) are 1, every other token 0, as slime masks Qwen templates. Here the tokens of
  each turn are what the template adds when that turn is appended (any template whose render of
  a conversation extends the render of its beginning); a template that rewrites earlier turns
  (Qwen3 dropping an earlier ``<think>``) is refused for that row. A message with
  ``step_loss_mask`` other than 1 is masked out, as in slime.
- ``distill_qwen``: the first message with the generation prompt, then the last message's
  content as plain tokens (no close), all of them 1.

A sample's response starts at its first loss token (slime's ``get_response_lengths``): the
tokens before it are its prompt, and its ``loss_mask`` covers the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from buffer.sample import Sample, Status
from plugins.chat_append import render_ids

__all__ = ["conversation_tokens", "conversation_check", "generate_rollout", "is_sft_rollout"]
log = logging.getLogger(__name__)


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"not a conversation: expected a list of {{role, content}} messages, got "
                         f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"bad message {i}: expected a {{role, content}} object")
    if not any(m["role"] == "assistant" and m.get("step_loss_mask", 1) == 1 for m in messages):
        raise ValueError("no assistant turn to train on")
    return messages


def conversation_tokens(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                        mask_type: str = "qwen") -> tuple[list[int], list[int]]:
    """``(token ids, loss mask)`` of a whole conversation (the module doc says which tokens are 1).
    ``ValueError`` with a one-line reason for a conversation that cannot be trained on."""
    messages = _check_messages(messages)
    try:
        if mask_type == "distill_qwen":
            prompt = render_ids(tokenizer, messages[:1], add_generation_prompt=True, tools=tools)
            response = list(tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"])
            on = int(messages[-1].get("step_loss_mask", 1) == 1)
            return prompt + response, [0] * len(prompt) + [on] * len(response)
        if mask_type not in ("qwen", "qwen3"):
            raise ValueError(f"--loss-mask-type {mask_type!r}: expected qwen, qwen3 or distill_qwen")
        ids: list[int] = []
        mask: list[int] = []
        for k, m in enumerate(messages):
            whole = render_ids(tokenizer, messages[:k + 1], add_generation_prompt=False, tools=tools)
            # the tokens this turn adds begin at len(ids); an assistant's content after its generation prompt
            head = render_ids(tokenizer, messages[:k], add_generation_prompt=True, tools=tools) \
                if m["role"] == "assistant" else ids
            start = len(head)
            if whole[:len(ids)] != ids or head[:len(ids)] != ids or whole[:start] != head:
                raise ValueError(f"chat template rewrites the conversation before message {k} ({m['role']}) "
                                 "when it is appended: the turns have no tokens of their own")
            on = int(m["role"] == "assistant" and m.get("step_loss_mask", 1) == 1)
            mask += [0] * (start - len(ids)) + [on] * (len(whole) - start)
            ids = whole
    except ValueError:
        raise
    except Exception as e:  # the template's own error (a role it refuses, a missing variable)
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"chat template cannot render the conversation: {type(e).__name__}: {first}") from e
    if not any(mask):
        raise ValueError("no assistant token to train on (empty assistant turns)")
    return ids, mask


def conversation_check(tokenizer: Any, mask_type: str) -> Callable[[Any, dict], list[int]]:
    """What the prompt loader calls on each row under this rollout: ``(messages, metadata) -> token
    ids``, raising ``ValueError`` (the row is then skipped and counted, with its line)."""
    def check(messages: Any, metadata: dict) -> list[int]:
        return conversation_tokens(tokenizer, messages, metadata.get("tools"), mask_type)[0]

    return check


def generate_rollout(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False) -> list[list[Sample]]:
    """slime's ``sft_rollout.generate_rollout``: ``--rollout-batch-size`` groups of the data
    source's conversations as trainable samples (reward 0, no log-probs, weight version
    ``rollout_id``); nothing is generated."""
    if evaluation:
        raise ValueError("the SFT rollout does not evaluate: leave --eval-prompt-data and --eval-interval out")
    from rollout_manager.plugin_api import current_context

    ctx = current_context(None)
    if ctx is not None and ctx.tokenizer is not None:
        tokenizer = ctx.tokenizer
    else:  # called outside a rollout manager
        from rollout_manager.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.hf_checkpoint)
    mask_type = getattr(args, "loss_mask_type", "qwen")
    groups = data_buffer.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            ids, mask = conversation_tokens(tokenizer, sample.prompt, (sample.metadata or {}).get("tools"), mask_type)
            response_length = len(mask) - mask.index(1)
            sample.tokens = ids
            sample.response_length = response_length
            sample.loss_mask = mask[-response_length:]
            sample.rollout_log_probs = None
            sample.reward = 0.0
            sample.status = Status.COMPLETED
            # no policy made it: tagged with this rollout's id (the newest version it can be trained
            # at), so the buffer's staleness bound never drops it
            sample.weight_versions = [rollout_id]
    return groups


def is_sft_rollout(fn: Any) -> bool:
    """Whether ``fn`` is this rollout (its data is loaded as conversations)."""
    return fn is generate_rollout
