"""Chat-template token appends (plugins/chat_append.py) on the toy tokenizer's template and on
SmolLM2's ChatML: appends equal the whole render, the template's close is completed, tool results
go as one group, and unstable templates are refused in one line naming the tokenizer."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from plugins.chat_append import (PROBE_CONVERSATION, ChatAppendError, append_groups, append_ids,
                                 check_append_stable, close_remainder, render_ids, template_close)

# Qwen2.5's way with tool results: a run of them is one user block, closed after the last one
QWEN_TOOLS = ("{%- for m in messages %}{%- if m.role == 'tool' %}"
              "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
              "\n<tool_response>\n{{ m.content }}\n</tool_response>"
              "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
              "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
              "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
# Qwen3's way with reasoning: an assistant turn before the last user message loses its <think>
DROPS_THINK = ("{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
               "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
               "{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 < ns.last %}"
               "<|im_start|>assistant\n{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
               "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
               "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
NO_TOOL_ROLE = ("{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
                "{{ raise_exception('roles must be system, user or assistant') }}{%- endif %}"
                "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
                "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(params=["toy", "smollm2"])
def tok(request, toy_model_dir):
    if request.param == "toy":
        return AutoTokenizer.from_pretrained(toy_model_dir)
    return copy.deepcopy(request.getfixturevalue("smollm2_tokenizer"))  # tests change its template


def _encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_appends_equal_the_whole_render(tok):
    check_append_stable(tok)
    convo = [{"role": "user", "content": "12+7="}]
    held = render_ids(tok, convo, add_generation_prompt=True)
    for reply, env in [("<calc>12+7</calc>", [{"role": "tool", "content": "19"}, {"role": "tool", "content": "ok"}]),
                       ("19", [{"role": "user", "content": "and 3*3?"}])]:
        held += _encode(tok, reply) + [tok.eos_token_id]  # the model's turn: its text, then its stop token
        convo.append({"role": "assistant", "content": reply})
        held += append_ids(tok, convo, env, ids=held)
        convo += env
    assert held == render_ids(tok, convo, add_generation_prompt=True)


def test_the_templates_close_is_completed(smollm2_tokenizer):
    tok = smollm2_tokenizer
    im_end, nl = _encode(tok, "<|im_end|>\n")
    assert template_close(tok) == [im_end, nl]
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    prompt = render_ids(tok, convo[:1], add_generation_prompt=True)
    tool = [{"role": "tool", "content": "42"}]
    turn = _encode(tok, "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    # the model emitted <|im_end|>: only ChatML's newline is missing
    assert append_ids(tok, convo, tool, ids=prompt + _encode(tok, "yo") + [im_end]) == [nl] + turn
    # stopped by a stop string or the length limit: the whole close
    assert append_ids(tok, convo, tool, ids=prompt + _encode(tok, "yo")) == [im_end, nl] + turn
    assert append_ids(tok, convo, tool) == turn  # ids=None: they end where the render of convo ends
    assert close_remainder([5, im_end, nl], [im_end, nl]) == [] and close_remainder([nl], [im_end, nl]) == [im_end, nl]


def test_consecutive_tool_results_are_one_group(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = QWEN_TOOLS
    check_append_stable(tok)  # the probe appends its two tool results as one group
    convo = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "calling"}]
    tools = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    held = render_ids(tok, convo, add_generation_prompt=False)
    assert held + append_ids(tok, convo, tools) == render_ids(tok, convo + tools, add_generation_prompt=True)
    first = held + append_ids(tok, convo, tools[:1], add_generation_prompt=False)
    with pytest.raises(ChatAppendError, match="appending tool changes the conversation's earlier tokens"):
        append_ids(tok, convo + tools[:1], tools[1:], ids=first)  # one at a time: the first block was closed
    assert [[m["role"] for m in g] for g in append_groups(list(PROBE_CONVERSATION))] == \
        [["system", "user"], ["assistant"], ["tool", "tool"], ["assistant"], ["user"], ["assistant"]]


@pytest.mark.parametrize("template,match", [(DROPS_THINK, "is not append-stable|changes the conversation"),
                                            (NO_TOOL_ROLE, "cannot render the probe conversation")])
def test_unstable_templates_are_refused_in_one_line(tok, template, match):
    tok.chat_template = template
    with pytest.raises(ChatAppendError, match=match) as e:
        check_append_stable(tok)
    assert "\n" not in str(e.value) and tok.name_or_path in str(e.value)


def test_no_template_is_refused(tok):
    tok.chat_template = None
    with pytest.raises(ChatAppendError, match="has no chat template"):
        check_append_stable(tok)
