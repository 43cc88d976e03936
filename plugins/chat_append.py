"""Chat-template token appends for multi-turn rollouts: the ids of new tool/user turns (and the next
generation prompt), rendered by the tokenizer's own chat template after the conversation so far,
without re-tokenizing that conversation.

A multi-turn generate holds the ids the engine saw and produced (token in, token out). After the
model's turn it must add the environment's turns as the chat template would write them::

    from plugins.chat_append import append_ids, check_append_stable

    check_append_stable(tok)                      # once, at start-up: refuses an unstable template
    new = append_ids(tok, messages, [{"role": "tool", "content": "42"}], ids=sample.tokens)
    sample.tokens += new                          # loss mask 0, log-prob 0.0 on these ids

``append_ids`` renders ``messages`` (the conversation so far, ending with the model's turn) and
``messages + new_messages`` with the template, checks that the first is a token prefix of the
second and returns the tail. Consecutive tool messages must be appended as one group (one call):
templates such as Qwen's write a run of tool results as one block whose closing depends on what
follows each result. Whatever the template puts after an assistant turn that the held ids lack
(ChatML's ``\\n`` after the model's ``<|im_end|>``, or the whole close when the model stopped on a
stop string or hit its length limit) is added first (``template_close``).

Tails are taken from renders of the real conversation, so a template that looks at earlier turns
(a default system prompt on the first turn, the last user query's index) renders them correctly;
a template that rewrites earlier turns when later ones arrive (Qwen3 dropping an earlier
``<think>``) cannot be appended to: ``ChatAppendError``. ``check_append_stable`` probes a
tokenizer with a fixed conversation (system, user, assistant, two tools, assistant, user,
assistant) and refuses, in one line naming the tokenizer, when the conversation rendered whole
differs from its turns appended one by one.

Works with any HF tokenizer that has a chat template; ids come from rendering text and encoding
it with ``add_special_tokens=False``, as the rollout manager encodes prompts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ChatAppendError", "PROMPT_STANDIN", "PROBE_CONVERSATION", "render_text", "render_ids", "template_close",
           "close_remainder", "append_ids", "append_groups", "check_append_stable", "tokenizer_name"]

#: The conversation ``check_append_stable`` renders whole and appends turn by turn.
PROBE_CONVERSATION: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "<think>12 plus 7</think>Let me compute it."},
    {"role": "tool", "content": "19"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "The answer is 19."},
    {"role": "user", "content": "Thanks. And 4 * 4?"},
    {"role": "assistant", "content": "16"},
)
#: A stand-in for a prompt whose messages are unknown (a prompt given as templated text): tails
#: rendered after it are what an append-stable template writes after any prompt.
PROMPT_STANDIN: tuple[dict[str, str], ...] = ({"role": "user", "content": "?"},)
_SENTINEL = "\x00reservoir-sentinel\x00"


class ChatAppendError(ValueError):
    """The chat template cannot be appended to token by token (the message names the tokenizer)."""


def tokenizer_name(tokenizer: Any) -> str:
    """How errors name a tokenizer: its path (``name_or_path``) or its class."""
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def render_text(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool, tools: list[dict] | None = None,
                **template_kwargs: Any) -> str:
    """``messages`` through the tokenizer's chat template, as text."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatAppendError(f"tokenizer {tokenizer_name(tokenizer)} has no chat template")
    kwargs = dict(template_kwargs)
    if tools is not None:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **kwargs)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def render_ids(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool, tools: list[dict] | None = None,
               **template_kwargs: Any) -> list[int]:
    """``messages`` through the chat template, encoded as the rollout manager encodes prompts."""
    return _encode(tokenizer, render_text(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                          tools=tools, **template_kwargs))


def template_close(tokenizer: Any, tools: list[dict] | None = None, **template_kwargs: Any) -> list[int]:
    """The ids the template writes after an assistant turn's content (ChatML: ``<|im_end|>\\n``;
    empty for a template that closes nothing). Found by rendering a sentinel reply."""
    msgs = [*PROMPT_STANDIN, {"role": "assistant", "content": _SENTINEL}]
    text = render_text(tokenizer, msgs, add_generation_prompt=False, tools=tools, **template_kwargs)
    at = text.rfind(_SENTINEL)
    if at < 0:
        raise ChatAppendError(f"chat template of {tokenizer_name(tokenizer)} does not render an assistant "
                              "message's content")
    return _encode(tokenizer, text[at + len(_SENTINEL):])


def close_remainder(ids: list[int], close: list[int]) -> list[int]:
    """What of ``close`` is missing after ``ids``: ``ids`` ending with ``close[:k]`` (the longest
    such k) lacks ``close[k:]`` (all of it when the model stopped before its close)."""
    for k in range(min(len(close), len(ids)), 0, -1):
        if ids[len(ids) - k:] == close[:k]:
            return close[k:]
    return list(close)


def append_ids(tokenizer: Any, messages: list[dict], new_messages: list[dict], *, ids: list[int] | None = None,
               add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **template_kwargs: Any) -> list[int]:
    """The ids to append after ``ids`` for ``new_messages`` (one group: e.g. every tool result of
    one model turn), with the next generation prompt unless ``add_generation_prompt=False``.

    ``messages``: the conversation so far (its last message the model's turn, content as text);
    ``ids``: the tokens held for it, whose end is checked against the template's close of the
    assistant turn (what is missing is added first); None when they end where the template's
    render of ``messages`` ends. ``ChatAppendError`` when the template renders ``messages``
    differently once ``new_messages`` follow (it rewrites history, or tokens merge across the join)."""
    if not new_messages:
        return []
    before = render_ids(tokenizer, messages, add_generation_prompt=False, tools=tools, **template_kwargs)
    after = render_ids(tokenizer, [*messages, *new_messages], add_generation_prompt=add_generation_prompt,
                       tools=tools, **template_kwargs)
    if after[:len(before)] != before:
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        roles = "+".join(m.get("role", "?") for m in new_messages)
        raise ChatAppendError(f"chat template of {tokenizer_name(tokenizer)}: appending {roles} changes the "
                              f"conversation's earlier tokens (first at token {at} of {len(before)}): it rewrites "
                              "history or merges tokens across the join")
    bridge: list[int] = []
    if ids is not None and messages and messages[-1].get("role") == "assistant":
        bridge = close_remainder(list(ids), template_close(tokenizer, tools=tools, **template_kwargs))
    return bridge + after[len(before):]


def append_groups(messages: list[dict]) -> list[list[dict]]:
    """``messages`` split into append groups: each assistant message alone, each run of other
    messages (tool results, a user turn) as one group."""
    groups: list[list[dict]] = []
    for m in messages:
        if m.get("role") == "assistant" or not groups or groups[-1][-1].get("role") == "assistant":
            groups.append([m])
        else:
            groups[-1].append(m)
    return groups


def check_append_stable(tokenizer: Any, tools: list[dict] | None = None,
                        conversation: list[dict] | tuple[dict, ...] = PROBE_CONVERSATION,
                        **template_kwargs: Any) -> None:
    """Refuse (``ChatAppendError``, one line naming the tokenizer) a chat template whose appends are
    not stable: ``conversation`` rendered whole must equal its prompt, then each model turn as a
    model emits it (the template's ids for its content, then its stop token: the close's first
    id) and each group of other messages through ``append_ids``."""
    name = tokenizer_name(tokenizer)
    conv = list(conversation)
    try:
        groups = append_groups(conv)
        first_reply = next((i for i, g in enumerate(groups) if g[0]["role"] == "assistant"), len(groups))
        messages = [m for g in groups[:first_reply] for m in g]
        held = render_ids(tokenizer, messages, add_generation_prompt=True, tools=tools, **template_kwargs)
        close = template_close(tokenizer, tools=tools, **template_kwargs)
        for group in groups[first_reply:]:
            if group[0]["role"] == "assistant":
                prompt = render_ids(tokenizer, messages, add_generation_prompt=True, tools=tools, **template_kwargs)
                whole = render_ids(tokenizer, [*messages, *group], add_generation_prompt=False, tools=tools,
                                   **template_kwargs)
                if whole[:len(prompt)] != prompt or (close and whole[len(whole) - len(close):] != close):
                    raise ChatAppendError(f"chat template of {name}: an assistant turn does not extend its "
                                          "generation prompt and end with the template's close")
                held += whole[len(prompt):len(whole) - len(close)] + close[:1]  # the model stops at its stop token
            else:
                held += append_ids(tokenizer, messages, group, ids=held, tools=tools, **template_kwargs)
            messages += group
        held += close_remainder(held, close) if conv[-1]["role"] == "assistant" else []
        whole = render_ids(tokenizer, conv, add_generation_prompt=conv[-1]["role"] != "assistant", tools=tools,
                           **template_kwargs)
    except ChatAppendError:
        raise
    except Exception as e:  # a template that refuses a role (no tool role, no system prompt) raises its own error
        raise ChatAppendError(f"chat template of {name} cannot render the probe conversation: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    if held != whole:
        at = next((i for i, (a, b) in enumerate(zip(held, whole)) if a != b), min(len(held), len(whole)))
        raise ChatAppendError(f"chat template of {name} is not append-stable: the probe conversation rendered "
                              f"whole ({len(whole)} tokens) differs from its turns appended one by one "
                              f"({len(held)} tokens) at token {at}")
