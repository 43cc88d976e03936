"""Group requests end to end: 2 embedded engines behind the real sglang-router, greedy decoding, the
same prompts generated with ``--rollout-request-granularity group`` and ``sample``: the same tokens,
log-probs and rewards, with one request per group instead of one per sample. Needs loopback sockets:
run via scripts/run_tests.sh (``unshare -n``)."""

from __future__ import annotations

import asyncio

from _fixtures_rollout import running_manager, toy_argv

from buffer.sample import Status, check_group


def test_group_and_sample_requests_give_the_same_samples(toy_model_dir):
    async def go():
        argv = toy_argv(toy_model_dir, "--rollout-num-engines", "2", "--n-samples-per-prompt", "3",
                        "--rollout-batch-size", "4", "--rollout-max-response-len", "12", "--rollout-temperature", "0")
        async with running_manager(argv) as m:
            start = m.data_source.state_dict()
            out = {}
            for granularity in ("group", "sample"):
                m.settings.sampling.rollout_request_granularity = granularity
                m.data_source.load_state_dict(start)  # the same prompts both times
                out[granularity] = await m.generate(0)
            return out

    out = asyncio.run(go())
    (g_groups, g_metrics), (s_groups, s_metrics) = out["group"], out["sample"]
    assert g_metrics["rollout/requests"] == 4 and s_metrics["rollout/requests"] == 12
    key = lambda s: s.index  # noqa: E731
    g = sorted((s for grp in g_groups for s in grp), key=key)
    s = sorted((s for grp in s_groups for s in grp), key=key)
    assert [x.index for x in g] == [x.index for x in s] and len(g) == 12
    for grp in g_groups:
        check_group(grp, 3)
    for a, b in zip(g, s):
        assert a.status == b.status and a.status in (Status.COMPLETED, Status.TRUNCATED)
        assert a.tokens == b.tokens and a.response_length == b.response_length and a.response == b.response
        assert a.reward == b.reward and a.loss_mask == b.loss_mask and a.weight_versions == b.weight_versions == [0]
        assert max((abs(x - y) for x, y in zip(a.rollout_log_probs, b.rollout_log_probs)), default=0) < 1e-4
