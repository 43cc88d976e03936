"""BufferCore without Ray: FIFO, capacity, staleness, filter plugin, leases, put ids, bad input."""

from __future__ import annotations

import math
import sys
import types

import pytest

from _fixtures_buffer import ids, make_group
from buffer.core import BufferCore
from buffer.interfaces import BufferSettings


def core(**kw) -> BufferCore:
    return BufferCore(BufferSettings(**kw))


def test_fifo_and_partial_availability():
    c = core(n_samples_per_prompt=4)
    assert c.put([make_group(i) for i in range(3)]) == 3
    c.put([make_group(3)])
    assert c.size() == 4
    assert c.try_get(5) is None and c.size() == 4  # not enough: nothing taken
    assert ids(c.try_get(3)) == [0, 1, 2]
    assert ids(c.try_get(1)) == [3]
    m = c.as_metrics()
    assert (m["puts"], m["put_groups"], m["gets"], m["got_groups"], m["size"]) == (2, 4, 2, 4, 0)


def test_capacity_room_and_impossible_requests():
    c = core(capacity=3)
    c.put([make_group(i) for i in range(2)])
    assert c.has_room(1) and not c.has_room(2)
    with pytest.raises(ValueError, match="--buffer-capacity"):
        c.validate_put([make_group(i) for i in range(4)])
    with pytest.raises(ValueError, match="--buffer-capacity"):
        c.check_get(4)
    with pytest.raises(ValueError, match="num_groups"):
        c.check_get(0)


def test_put_id_makes_retries_idempotent():
    c = core()
    assert c.duplicate("a") is None
    c.put([make_group(0), make_group(1)], put_id="a")
    assert c.duplicate("a") == 2  # the retry is answered, not stored
    assert c.size() == 2 and c.as_metrics()["duplicate_puts"] == 1


def _bad(kind: str):
    g = make_group(7)
    s = g[1]
    if kind == "group_size":
        return g[:3], "n_samples_per_prompt"
    if kind == "tokens_short":
        s.tokens = s.tokens[:2]
        return g, "response_length"
    if kind == "log_probs":
        s.rollout_log_probs = s.rollout_log_probs[:-1]
        return g, "rollout_log_probs"
    if kind == "loss_mask":
        s.loss_mask = s.loss_mask + [1]
        return g, "loss_mask"
    if kind == "nan_reward":
        s.reward = math.nan
        return g, "reward"
    if kind == "inf_reward":
        s.reward = {"acc": math.inf}
        return g, "reward"
    if kind == "missing_reward":
        s.reward = None
        return g, "reward"
    if kind == "missing_tokens":
        s.tokens = []
        return g, "tokens"
    if kind == "missing_versions":
        s.weight_versions = []
        return g, "weight_versions"
    if kind == "missing_loss_mask":
        s.loss_mask = None
        return g, "loss_mask"
    raise AssertionError(kind)


BAD = ["group_size", "tokens_short", "log_probs", "loss_mask", "nan_reward", "inf_reward", "missing_reward",
       "missing_tokens", "missing_versions", "missing_loss_mask"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_input_is_rejected_atomically_and_counted(kind):
    c = core(n_samples_per_prompt=4)
    c.put([make_group(0)])
    bad, field = _bad(kind)
    with pytest.raises(ValueError) as err:
        c.validate_put([make_group(1), bad, make_group(2)], put_id="p1")
    msg = str(err.value)
    assert "group 1" in msg and "group_index=7" in msg and field in msg and "put_id='p1'" in msg
    m = c.as_metrics()
    assert m["rejected_puts"] == 1 and m["rejected_groups"] == 3 and sum(m["rejected_by_field"].values()) == 1
    assert c.size() == 1  # nothing of the rejected put was stored; the buffer keeps serving
    c.put([make_group(3)])
    assert ids(c.try_get(2)) == [0, 3]


def test_non_list_inputs_rejected():
    c = core()
    for bad in ([], "x", [[]], [["not a sample"]]):
        with pytest.raises(ValueError):
            c.validate_put(bad)
    assert c.as_metrics()["rejected_puts"] == 4


@pytest.mark.parametrize("policy", ["drop", "return"])
def test_staleness_bound(policy):
    c = core(max_weight_staleness=1, stale_policy=policy)
    c.put([make_group(0, version=0), make_group(1, version=1), make_group(2, version=2)])
    c.set_version(2)  # group 0 is 2 behind: out
    assert c.size() == 2
    c.put([make_group(3, version=0)])  # stale on arrival
    assert c.size() == 2
    m = c.as_metrics()
    if policy == "drop":
        assert m["drops"] == {"stale": 2} and m["returned_groups"] == 0
        assert c.take_returned(10) == []
    else:
        assert m["returned_stale"] == 2 and m["returned_groups"] == 2
        assert ids(c.take_returned(1)) == [0] and ids(c.take_returned(5)) == [3]
        assert c.as_metrics()["taken_returned"] == 2
    got = c.try_get(2)
    assert ids(got) == [1, 2]
    assert c.as_metrics()["staleness"] == {"0": 1, "1": 1}


def test_strictly_on_policy_and_oldest_version_counts():
    c = core(max_weight_staleness=0)
    mixed = make_group(1, version=3)
    mixed[2].weight_versions = [2, 3]  # a partial rollout resumed under newer weights
    c.set_version(3)
    c.put([make_group(0, version=3), mixed])
    assert c.size() == 1 and c.as_metrics()["drops"] == {"stale": 1}
    c.set_version(4)
    assert c.size() == 0 and c.try_get(1) is None


def test_unbounded_staleness_keeps_everything():
    c = core()
    c.put([make_group(0, version=0)])
    c.set_version(100)
    assert ids(c.try_get(1)) == [0]
    assert c.as_metrics()["staleness_max"] == 100
    with pytest.raises(ValueError):
        c.set_version(-1)


def _install_filter(monkeypatch, body):
    mod = types.ModuleType("buffer_test_filters")
    mod.pop = body
    monkeypatch.setitem(sys.modules, "buffer_test_filters", mod)
    return "buffer_test_filters.pop"


def test_filter_plugin_picks_groups(monkeypatch):
    calls = []

    def pop_even(args, rollout_id, buffer, num_samples):
        calls.append((args, rollout_id, len(buffer), num_samples))
        picked = [g for g in buffer if g[0].group_index % 2 == 0][:num_samples]
        for g in picked:
            buffer.remove(g)
        return picked

    from buffer.interfaces import load_filter

    path = _install_filter(monkeypatch, pop_even)
    s = BufferSettings(filter_path=path)
    c = BufferCore(s, load_filter(s), plugin_args="ARGS")
    c.put([make_group(0), make_group(1)])
    assert c.try_get(2) is None  # only one even group yet: the get waits for more data
    c.put([make_group(2), make_group(3), make_group(4)])
    assert ids(c.try_get(2, step=7)) == [0, 2]
    assert ids(c.try_get(1)) == [4]
    assert calls[-2][:2] == ("ARGS", 7) and calls[-1] == ("ARGS", 1, 3, 1)
    assert c.size() == 2  # 1 and 3 stay


def test_filter_plugin_misbehaving(monkeypatch):
    from buffer.interfaces import load_filter

    path = _install_filter(monkeypatch, lambda args, rid, buffer, n: [make_group(99)])
    s = BufferSettings(filter_path=path)
    c = BufferCore(s, load_filter(s))
    c.put([make_group(0)])
    with pytest.raises(RuntimeError, match="--buffer-filter-path"):
        c.try_get(1)
    assert c.size() == 1
    with pytest.raises(ValueError, match="--buffer-filter-path"):
        load_filter(BufferSettings(filter_path="buffer_test_filters.nope"))


def test_commit_and_rewind_restore_order():
    c = core()
    c.put([make_group(i) for i in range(6)])
    assert ids(c.try_get(2, step=1)) == [0, 1]
    assert ids(c.try_get(2, step=2)) == [2, 3]
    c.commit(1)
    assert ids(c.try_get(1, step=3)) == [4]
    c.put([make_group(6)])
    assert c.rewind(1) == 3  # steps 2 and 3 go back, in put order, at the front
    assert ids(c.try_get(5, step=2)) == [2, 3, 4, 5, 6]
    c.commit(2)
    assert c.as_metrics()["leased_groups"] == 0
    assert c.rewind(2) == 0


def test_rewind_commits_earlier_steps():
    c = core()
    c.put([make_group(i) for i in range(3)])
    c.try_get(1, step=1)
    c.try_get(1, step=2)
    assert c.rewind(1) == 1  # the checkpoint of step 1 exists: step 1's group is final
    assert ids(c.try_get(2)) == [1, 2]
    assert c.rewind(0) == 0


def test_bad_settings_name_flags():
    for kw, flag in [({"capacity": 0}, "capacity"), ({"put_timeout_s": 0}, "put_timeout_s"),
                     ({"max_weight_staleness": -1}, "max_weight_staleness"),
                     ({"stale_policy": "keep"}, "stale_policy"), ({"fsync": True}, "fsync"),
                     ({"n_samples_per_prompt": 0}, "n_samples_per_prompt")]:
        with pytest.raises(ValueError, match=flag):
            BufferSettings(**kw).validate()


def test_rewind_goes_back_to_the_checkpoints_version_before_judging_staleness():
    """Issue 16 item 1: after a crash the buffer's version is ahead of the checkpoint; rewound
    groups must be judged against the checkpoint's version, or they are dropped as stale."""
    c = core(max_weight_staleness=0)
    c.set_version(3)
    c.put([make_group(i, version=3) for i in range(2)], put_id="rollout-3")
    assert ids(c.try_get(2, step=3)) == [0, 1]
    c.set_version(5)  # steps 3 and 4 pushed, never checkpointed
    assert c.rewind(2, weight_version=3) == 2
    assert c.version == 3 and c.as_metrics()["drops"] == {}
    assert ids(c.try_get(2, step=3)) == [0, 1]


def test_rewind_forgets_the_puts_the_checkpoint_does_not_cover():
    c = core()
    c.put([make_group(0)], put_id="rollout-0")
    c.put([make_group(1)], put_id="rollout-1")
    c.put([make_group(2, version=1)], put_id="rollout-2")
    assert ids(c.try_get(2, step=0)) == [0, 1]  # trained by step 0, never checkpointed
    assert c.rewind(-1, weight_version=0, forget_put_ids=["rollout-2", "rollout-9"]) == 2
    assert c.known_put_ids() == ["rollout-0", "rollout-1"]
    assert c.as_metrics()["drops"] == {"rewound": 1}
    assert c.duplicate("rollout-2") is None and c.duplicate("rollout-1") == 1  # only the covered one is known
    assert c.put([make_group(2)], put_id="rollout-2") == 1  # regenerated: stored
    assert ids(c.try_get(3, step=0)) == [0, 1, 2]
    assert c.rewind(-1, forget_put_ids=["rollout-2"]) == 2  # the regenerated put is forgotten again


def test_a_repeated_get_for_a_step_returns_that_steps_batch():
    """A get whose reply was lost (buffer restart) is retried: the same batch, not a second one."""
    c = core()
    c.put([make_group(i) for i in range(4)])
    first = c.try_get(2, step=7)
    assert c.try_get(2, step=7) == first and c.size() == 2
    assert c.as_metrics()["repeated_gets"] == 1
    with pytest.raises(ValueError, match="already took 2 groups"):
        c.try_get(3, step=7)
    c.rewind(6)
    assert ids(c.try_get(2, step=7)) == [0, 1]


def test_commit_cover_known_covers_exactly_the_known_puts():
    """``commit(step, cover_known=True)`` (the driver without --save, one call) covers what
    ``commit(step, covered_put_ids=known_put_ids())`` covers: the takes of stored puts, not of a
    put that never came."""
    for one_call in (False, True):
        c = core(max_weight_staleness=0, stale_policy="return")
        c.put([make_group(0, version=0), make_group(1, version=0)])
        c.set_version(1)  # both stale: returned
        assert len(c.take_returned(1, request_id="rollout-1")) == 1
        assert len(c.take_returned(1, request_id="rollout-2")) == 1
        c.put([make_group(2, version=1)], put_id="rollout-1")  # rollout-2's put never came
        if one_call:
            c.commit(0, cover_known=True)
        else:
            c.commit(0, covered_put_ids=c.known_put_ids())
        assert c.as_metrics()["taken_uncovered_groups"] == 1, one_call


def test_returns_groups_says_whether_take_returned_can_ever_hand_out_one():
    """The rollout manager stops calling take_returned once a buffer answers False: False must
    hold for good, True wherever a group could come back."""
    assert not core().returns_groups()  # no bound: nothing is ever stale
    assert not core(max_weight_staleness=1, stale_policy="drop").returns_groups()
    c = core(max_weight_staleness=0, stale_policy="return")
    assert c.returns_groups()
    c.put([make_group(0, version=0)])
    c.set_version(1)
    assert len(c.take_returned(1, request_id="rollout-1")) == 1
    c.settings = BufferSettings(max_weight_staleness=0, stale_policy="drop")  # e.g. a journal of another run
    assert c.returns_groups()  # taken, not covered: a rewind gives it back
    c.put([make_group(1, version=1)], put_id="rollout-1")
    c.commit(0, cover_known=True)
    assert c.returns_groups()  # a retried take of rollout-1 would get its group again
