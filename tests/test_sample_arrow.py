"""Sample contract and the lossless Arrow/Parquet round trip."""

import math

import pyarrow.parquet as pq
import pytest

from buffer.arrow import SCHEMA, groups_to_record_batch, read_parquet, record_batch_to_groups, write_parquet
from buffer.sample import Sample, Status, check_group, check_sample, group_oldest_version


def make_sample(i: int = 0, n_resp: int = 3, **kw) -> Sample:
    base = dict(group_index=7, index=i, prompt="1+1=", label="2", tokens=[5, 6, 7] + list(range(n_resp)),
                response="2" * n_resp, response_length=n_resp, loss_mask=[1] * n_resp,
                rollout_log_probs=[-0.5] * n_resp, reward=1.0, status=Status.COMPLETED, weight_versions=[3])
    base.update(kw)
    return Sample(**base)


def test_round_trip_is_lossless_for_every_field_kind(tmp_path):
    chat = [{"role": "system", "content": "Rechne: ünïcödé ✓ 数学"}, {"role": "user", "content": "2+2="}]
    groups = [
        [make_sample(0), make_sample(1, n_resp=0, loss_mask=[], rollout_log_probs=[], reward=0.0)],
        [make_sample(2, prompt=chat, label={"answer": 4, "alts": ["four", None]},
                     metadata={"source": "gsm", "nested": {"k": [1, 2.5, "x"]}},
                     reward={"acc": 1.0, "fmt": -0.25}, rollout_log_probs=None, weight_versions=[3, 4, 4],
                     status=Status.TRUNCATED),
         make_sample(3, tokens=list(range(5000)), n_resp=4000, response_length=4000, loss_mask=[0, 1] * 2000,
                     rollout_log_probs=[-1e-300, math.pi] * 2000, group_index=None, index=None)],
    ]
    back = record_batch_to_groups(groups_to_record_batch(groups))
    assert back == groups
    path = tmp_path / "g.parquet"
    assert write_parquet(groups, path) > 0
    assert read_parquet(path) == groups
    assert pq.read_schema(path).names == SCHEMA.names  # readable by plain pyarrow


def test_group_boundaries_survive_equal_group_index():
    groups = [[make_sample(0)], [make_sample(1)]]  # same group_index 7, distinct groups
    assert len(record_batch_to_groups(groups_to_record_batch(groups))) == 2


def test_missing_column_is_named():
    import pyarrow as pa
    with pytest.raises(ValueError, match="missing column"):
        record_batch_to_groups(pa.table({"tokens": [[1]]}))


@pytest.mark.parametrize("change,field", [
    (dict(loss_mask=[1, 1]), "loss_mask"),
    (dict(loss_mask=None), "loss_mask"),
    (dict(rollout_log_probs=[0.0]), "rollout_log_probs"),
    (dict(reward=float("nan")), "reward"),
    (dict(reward=float("inf")), "reward"),
    (dict(reward={"a": float("-inf")}), "reward"),
    (dict(reward=None), "reward"),
    (dict(tokens=[]), "tokens"),
    (dict(response_length=99), "response_length"),
    (dict(weight_versions=[]), "weight_versions"),
])
def test_check_sample_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        check_sample(make_sample(**change), "group 4, sample 0")


def test_failed_samples_need_no_reward_and_groups_are_sized():
    check_sample(make_sample(reward=None, status=Status.FAILED))
    with pytest.raises(ValueError, match="n_samples_per_prompt=4"):
        check_group([make_sample()] * 3, 4, "group 2")
    with pytest.raises(ValueError, match="group 2, sample 1: field 'loss_mask'"):
        check_group([make_sample(), make_sample(loss_mask=[])], 2, "group 2")


def test_derived_views():
    s = make_sample(weight_versions=[5, 3, 4])
    assert s.prompt_length == 3 and s.response_tokens == [0, 1, 2]
    assert s.oldest_weight_version == 3 and group_oldest_version([s, make_sample()]) == 3
    assert Sample.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="reward-key"):
        make_sample(reward={"a": 1.0}).scalar_reward()
    assert make_sample(reward={"a": 1.0}).scalar_reward("a") == 1.0
