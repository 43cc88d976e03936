"""SGLang's batch form of ``/generate`` in the embedded engine's parser (no model, no sockets):
rid expansion, shared and per-element fields, errors that name the element."""

from __future__ import annotations

import pytest

from embedded_engine.protocol import ProtocolError, is_batch, parse_generate, parse_generate_request

V = 50


def test_string_rid_expands_like_sglang_and_fields_are_shared():
    elems, batch = parse_generate_request({"input_ids": [[1, 2], [3], [4, 5, 6]], "rid": "grp",
                                           "sampling_params": {"max_new_tokens": 7, "temperature": 0},
                                           "return_logprob": True}, V)
    assert batch and [e.rid for e in elems] == ["grp_0", "grp_1", "grp_2"]
    assert [e.input_ids for e in elems] == [[1, 2], [3], [4, 5, 6]]
    assert all(e.params.max_new_tokens == 7 and e.params.greedy and e.return_logprob for e in elems)
    assert elems[0].params is elems[2].params  # one shared dict is validated once


def test_list_forms_and_absent_rid():
    elems, batch = parse_generate_request({"text": ["a", "b"], "rid": ["x", "y"],
                                           "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
                                           "return_logprob": [False, True]}, V)
    assert batch and [e.rid for e in elems] == ["x", "y"] and [e.text for e in elems] == ["a", "b"]
    assert [e.params.max_new_tokens for e in elems] == [1, 2] and [e.return_logprob for e in elems] == [False, True]
    elems, _ = parse_generate_request({"input_ids": [[1], [2]]}, V)
    assert len({e.rid for e in elems}) == 2  # generated, distinct
    # a batch of one is still a batch (its answer is a list); a flat list is one prompt
    assert parse_generate_request({"input_ids": [[1]]}, V)[1] is True
    assert parse_generate_request({"input_ids": [1, 2], "rid": "r"}, V)[0][0].rid == "r"
    assert is_batch({"text": ["a"]}) and not is_batch({"input_ids": [1]}) and not is_batch([1])


@pytest.mark.parametrize("body,field", [
    ({"input_ids": [[1], [V]]}, "input_ids[1]"),
    ({"input_ids": [[1], []]}, "input_ids[1]"),
    ({"input_ids": [[1], "x"]}, "input_ids[1]"),
    ({"text": ["a", 3]}, "text[1]"),
    ({"text": []}, "text"),
    ({"input_ids": [[1], [2]], "text": ["a", "b"]}, "text/input_ids"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid[1]"),
    ({"input_ids": [[1], [2]], "rid": ["a", ""]}, "rid[1]"),
    ({"input_ids": [[1], [2]], "rid": 5}, "rid"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {"top_p": 0}]}, "sampling_params[1].top_p"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [[1], [2]], "return_logprob": [True, "yes"]}, "return_logprob[1]"),
    ({"input_ids": [[1], [2]], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [[1], [2]], "stream": True}, "stream"),
    ({"input_ids": [[1], [2]], "bogus": 1}, "bogus"),
])
def test_bad_batches_name_the_element(body, field):
    with pytest.raises(ProtocolError) as e:
        parse_generate_request(body, V)
    assert e.value.field == field and str(e.value).startswith(field + ": ")


def test_single_parser_points_batches_elsewhere():
    with pytest.raises(ProtocolError, match="parse_generate_request"):
        parse_generate({"input_ids": [[1], [2]]}, V)
