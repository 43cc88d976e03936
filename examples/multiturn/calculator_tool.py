"""A worked multi-turn / tool-use example: a calculator tool, as a custom generate function.

User code, loaded by path as your own plugins are (this directory on ``PYTHONPATH``)::

    PYTHONPATH=examples/multiturn python -m rollout_manager ... --custom-generate-function-path calculator_tool.generate

The model may write ``<calc>EXPR</calc>`` (digits, ``+ - *`` and parentheses). Generation stops at
``</calc>``; the tool evaluates EXPR and its answer ``<result>VALUE</result>`` is appended as
environment tokens, then the model continues. Up to ``MAX_TOOL_CALLS`` calls, within
``--rollout-max-response-len`` tokens in total.

What it shows (the contract of any custom generate, slime's signature):
- token in, token out: the model's tokens and log-probs come from the engine as they are; only
  the tool's text is tokenized (it is not model output);
- ``loss_mask`` is 1 on model tokens and 0 on tool tokens (the loss never trains on what the
  environment wrote); tool tokens get log-prob 0.0 so ``rollout_log_probs`` stays aligned;
- the router, the concurrency limit and the settings come from ``current_context()`` of the
  public plugin API (``rollout_manager/plugin_api.py``).
"""

from __future__ import annotations

import ast
import functools
import operator
from typing import Any

from buffer.sample import Sample, Status, parse_weight_version
from rollout_manager.plugin_api import current_context, note_engine_call

MAX_TOOL_CALLS = 4
CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def calculator(expr: str) -> str:
    """Evaluate integer arithmetic safely (no names, no calls); an error message on bad input."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("unsupported")
    try:
        return str(ev(ast.parse(expr.strip(), mode="eval")))
    except (SyntaxError, ValueError, RecursionError):
        return "error"


def _append(sample: Sample, ids: list[int], logps: list[float], text: str, trainable: bool) -> None:
    sample.tokens += ids
    sample.response += text
    sample.response_length += len(ids)
    sample.loss_mask = (sample.loss_mask or []) + [1 if trainable else 0] * len(ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + logps


async def generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    """Generate with tool calls; model tokens trainable, tool tokens masked out of the loss."""
    ctx = current_context()
    tok = _tokenizer(args.hf_checkpoint)
    budget = sampling_params["max_new_tokens"]
    params = {**sampling_params, "stop": list(sampling_params.get("stop") or []) + [CALL_CLOSE]}
    for turn in range(MAX_TOOL_CALLS + 1):
        remaining = budget - sample.response_length
        if remaining <= 0:
            sample.status = Status.TRUNCATED
            return sample
        async with ctx.semaphore:  # engine errors propagate: the manager marks the sample failed
            out = await ctx.client.generate(input_ids=sample.tokens,
                                            sampling_params={**params, "max_new_tokens": remaining},
                                            return_logprob=True, timeout=ctx.settings.sampling.request_timeout)
        note_engine_call(sample.tokens, out)  # what the engine saw and produced, for --tito-check
        meta = out["meta_info"]
        ids = list(out["output_ids"])
        logps = [float(x[0]) for x in meta["output_token_logprobs"]]
        text = tok.decode(ids)  # to find the tool call; the tokens themselves are kept as they came
        version = parse_weight_version(meta.get("weight_version"))
        if not sample.weight_versions or sample.weight_versions[-1] != version:
            sample.weight_versions.append(version)
        _append(sample, ids, logps, text, trainable=True)
        finish = (meta.get("finish_reason") or {}).get("type")
        if finish == "abort":
            raise RuntimeError("request aborted (this example does not resume partial rollouts)")
        call = text.rfind(CALL_OPEN)
        if finish == "length" or call < 0 or not text.rstrip().endswith(CALL_CLOSE) or turn == MAX_TOOL_CALLS:
            sample.status = Status.TRUNCATED if finish == "length" else Status.COMPLETED
            return sample
        result = f"<result>{calculator(text[call + len(CALL_OPEN):text.rfind(CALL_CLOSE)])}</result>"
        tool_ids = tok(result, add_special_tokens=False)["input_ids"][:budget - sample.response_length]
        _append(sample, tool_ids, [0.0] * len(tool_ids), result, trainable=False)
    raise AssertionError("unreachable: the last turn returns")
