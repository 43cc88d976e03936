"""A multi-turn tool-use generate in the style of slime's search-r1 / retool examples."""

import asyncio

from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

TOOL_TEXT = "<r>ok</r>"
SEEN = {"evaluation": [], "max_inflight": 0}
_inflight = 0


async def generate(args, sample: Sample, sampling_params, evaluation=False) -> Sample:
    global _inflight
    assert isinstance(sample, Sample)
    assert args.rollout_global_dataset and args.sglang_dp_size == 1 and not args.partial_rollout
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    # slime's samples carry the templated prompt: tokenizing it gives the prompt's tokens
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    assert prompt_ids == sample.tokens[: len(prompt_ids)], "sample.prompt is not the text of its tokens"
    sample.tokens = list(prompt_ids)
    sample.loss_mask, sample.rollout_log_probs, sample.response, sample.response_length = [], None, "", 0
    max_context = args.rollout_max_context_len if not evaluation else args.eval_max_context_len
    SEEN["evaluation"].append(evaluation)
    _inflight += 1
    SEEN["max_inflight"] = max(SEEN["max_inflight"], _inflight)
    try:
        for turn in range(2):
            budget = min(sampling_params["max_new_tokens"], max_context - len(sample.tokens))
            payload = {"input_ids": sample.tokens, "sampling_params": {**sampling_params, "max_new_tokens": budget},
                       "return_logprob": True}
            output = await post(url, payload)
            await asyncio.sleep(0.02)  # a tool call's latency: overlapping calls would show here
            if output["meta_info"]["finish_reason"]["type"] == "abort":
                sample.status = Sample.Status.ABORTED
                return sample
            logprobs = output["meta_info"]["output_token_logprobs"]
            sample.append_response_tokens(args, tokens=[t[1] for t in logprobs], log_probs=[t[0] for t in logprobs],
                                          trainable=True, meta_info=output["meta_info"], text=output["text"])
            if turn == 0:
                obs = state.tokenizer(TOOL_TEXT, add_special_tokens=False)["input_ids"]
                sample.append_response_tokens(args, tokens=obs, trainable=False, text=TOOL_TEXT)
    finally:
        _inflight -= 1
    sample.tool_calls = 1  # plugins may set attributes of their own
    match output["meta_info"]["finish_reason"]["type"]:
        case "length":
            sample.status = Sample.Status.TRUNCATED
        case "stop":
            sample.status = Sample.Status.COMPLETED
    return sample


async def reward_func(args, sample, **kwargs):
    """A dict reward, as retool's math_dapo score is: the number under --reward-key, the rest rides along."""
    if not isinstance(sample, Sample):
        raise TypeError("Sample must be an instance of Sample class.")
    score = 1.0 if sample.index % 2 == 0 else 0.0
    return {"score": score, "pred": TOOL_TEXT if TOOL_TEXT in sample.response else "", "acc": score > 0}
