"""Embedded engine, in-process parts (no sockets): request validation, sampling, the batched
left-padded KV cache (join/leave keeps every row exact), settings, bucket packing/checksums."""

from __future__ import annotations

import pytest
import torch

from _fixtures_engine import engine_model, greedy_taker, hf_model, reference_logprobs  # noqa: F401  (fixtures)
from embedded_engine.protocol import ProtocolError, SamplingParams, parse_generate
from embedded_engine.sampling import build_row_params, sample
from embedded_engine.settings import EngineSettings, parse_settings
from sglang_protocol.buckets import flatten_bucket, tensor_checksum, unflatten_bucket

V = 50


@pytest.mark.parametrize("body,field", [
    ({"text": "a", "input_ids": [1]}, "text/input_ids"),
    ({}, "text/input_ids"),
    ({"input_ids": [1, V]}, "input_ids"),
    ({"input_ids": [1, -1]}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[1], [2]]}, "input_ids"),
    ({"input_ids": [1], "bogus": 1}, "bogus"),
    ({"input_ids": [1], "sampling_params": {"tempreature": 1}}, "sampling_params.tempreature"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "logprob_start_len": True}, "logprob_start_len"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [V]}}, "sampling_params.stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}, "sampling_params.repetition_penalty"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [1], "rid": 5}, "rid"),
    ([1, 2], "body"),
])
def test_bad_requests_name_the_field(body, field):
    with pytest.raises(ProtocolError) as e:
        parse_generate(body, V)
    assert e.value.field == field and str(e.value).startswith(field)


def test_good_request_defaults_and_neutral_fields():
    gi = parse_generate({"text": "hi", "sampling_params": {"temperature": 0, "stop": "x", "n": 1,
                                                          "repetition_penalty": 1.0}, "logprob_start_len": -1}, V)
    assert gi.text == "hi" and gi.input_ids is None and gi.rid and not gi.return_logprob
    assert gi.params.stop == ("x",) and gi.params.greedy and gi.params.max_new_tokens == 128


def _rows(params, gens=None):
    return build_row_params(params, gens or [None] * len(params), V, torch.device("cpu"))


def test_sampling_logprobs_are_before_filtering_and_filters_hold():
    torch.manual_seed(0)
    logits = torch.randn(4, V)  # [4, V]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=3),
              SamplingParams(temperature=1.3, top_p=0.2), SamplingParams(temperature=1.0, min_p=0.5)]
    rows = _rows(params)
    g = torch.Generator().manual_seed(1)
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0])
    full = torch.log_softmax(logits / temps[:, None], -1)  # [4, V]
    top3 = set(logits[1].topk(3).indices.tolist())
    probs2 = torch.softmax(logits[2] / 1.3, -1)
    order = probs2.argsort(descending=True)
    nucleus = set(order[: int((probs2[order].cumsum(0) - probs2[order] <= 0.2).sum())].tolist())
    probs3 = torch.softmax(logits[3], -1)
    minp = set((probs3 >= 0.5 * probs3.max()).nonzero().flatten().tolist())
    seen = set()
    for _ in range(200):
        tok, lp = sample(logits, rows, g)
        assert tok[0] == logits[0].argmax()
        assert tok[1].item() in top3 and tok[2].item() in nucleus and tok[3].item() in minp
        torch.testing.assert_close(lp, full.gather(1, tok[:, None]).squeeze(1), rtol=0, atol=1e-6)
        seen.add(tok[1].item())
    assert seen == top3  # top-k samples, it does not collapse to greedy


def test_seeded_row_does_not_depend_on_batch_mates():
    torch.manual_seed(0)
    steps = [torch.randn(3, V) for _ in range(20)]  # [3, V] per step
    seeded = SamplingParams(temperature=1.0, sampling_seed=42)
    alone = _rows([seeded], [torch.Generator().manual_seed(42)])
    mixed = _rows([SamplingParams(temperature=0.9), seeded, SamplingParams(temperature=0.0)],
                  [None, torch.Generator().manual_seed(42), None])
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(99)
    a = [sample(lg[1:2], alone, g1)[0].item() for lg in steps]
    b = [sample(lg, mixed, g2)[0][1].item() for lg in steps]
    assert a == b and len(set(a)) > 1


def test_runner_join_and_leave_keep_rows_exact(engine_model):
    """Rows prefilled together, a row joining mid-flight and rows leaving: every returned
    log-prob equals a full forward over that row alone."""
    from embedded_engine.model_runner import ModelRunner

    r = ModelRunner(EngineSettings(model_path=str(engine_model)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(7, r.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 2)]
    seqs, lps = [list(p) for p in prompts], [[] for _ in prompts]
    take = greedy_taker(seqs, lps)

    logits, batch = r.prefill(prompts)
    rows = [0, 1, 2]
    take(logits, batch, rows)
    for step in range(8):
        if step == 2:  # a longer prompt joins the running batch
            seqs.append(torch.randint(7, r.vocab_size, (17,), generator=g).tolist())
            lps.append([])
            l2, nb = r.prefill([seqs[3]])
            take(l2, nb, [3])
            batch = r.merge(batch, torch.arange(batch.size), nb)
            rows = rows + [3]
        if step == 5:  # rows 0 and 3 leave
            batch = r.select(batch, torch.tensor([1, 2]))
            rows = [1, 2]
        take(r.decode(batch), batch, rows)
    model = hf_model(engine_model)
    for s, lp in zip(seqs, lps):
        ref = reference_logprobs(model, s[:len(s) - len(lp)], s[len(s) - len(lp):], 1.0)
        assert max(abs(a - b) for a, b in zip(ref, lp)) <= 1e-5


def test_settings_validation_and_cli_roundtrip(tmp_path, capsys, monkeypatch):
    """Built in code, a bad setting names the field; from the command line, the flag (one
    declaration each: flags.flag). to_cli and the parser agree, the keys come from the environment."""
    with pytest.raises(ValueError, match=r"^dtype='fp8': expected one of auto, float32, bfloat16, float16$"):
        EngineSettings(model_path=str(tmp_path), dtype="fp8")
    with pytest.raises(ValueError, match=r"^max_running_requests must be >= 1, got 0$"):
        EngineSettings(model_path=str(tmp_path), max_running_requests=0)
    for argv, error in ((["--max-running-requests", "0"], "--max-running-requests must be >= 1, got 0"),
                        (["--device", "tpu"], "--device='tpu': expected cpu or cuda[:i]"),
                        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'")):
        with pytest.raises(SystemExit):
            parse_settings(["--model-path", str(tmp_path), *argv])
        assert f"python -m embedded_engine: error: {error}" in capsys.readouterr().err
    s = EngineSettings(model_path=str(tmp_path), port=1234, random_seed=3, context_length=64,
                       custom_weight_loader="a.load b.load", weight_update_timeout_s=5.0)
    assert parse_settings(s.to_cli()) == s
    monkeypatch.setenv("RESERVOIR_ENGINE_ADMIN_API_KEY", "from-env")
    keyed = parse_settings(["--model-path", str(tmp_path), "--api-key", "k"])
    assert (keyed.api_key, keyed.admin_api_key) == ("k", "from-env") and "k" not in s.to_cli()
    assert parse_settings(["--model-path", str(tmp_path), "--custom-weight-loader", "a.load", "b.load"]
                          ).weight_loaders() == ["a.load", "b.load"]


def test_flattened_bucket_roundtrip_and_checksums():
    """A flattened bucket is the tensors' bytes (SGLang's FlattenedTensorBucket): any dtypes,
    each tensor aligned to its element size."""
    ts = [torch.randn(3, 4), torch.randn(2, 1, 2), torch.randn(5).bfloat16()]
    flat = flatten_bucket(ts)
    assert flat.dtype == torch.uint8 and flat.shape == (12 * 4 + 4 * 4 + 5 * 2,)
    dtypes, shapes = [t.dtype for t in ts], [t.shape for t in ts]
    back = unflatten_bucket(flat, dtypes, shapes)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ts, back))
    with pytest.raises(ValueError, match="not aligned"):  # 5 bf16 = 10 bytes, then a float32
        flatten_bucket([torch.zeros(5, dtype=torch.bfloat16), torch.zeros(2)])
    with pytest.raises(ValueError, match="bytes"):
        unflatten_bucket(flat, [torch.float32], [[3, 4]])
    assert tensor_checksum(ts[0]) == tensor_checksum(ts[0].clone())
    bumped = ts[0].clone()
    bumped[0, 0] = torch.nextafter(bumped[0, 0], torch.tensor(10.0))
    assert tensor_checksum(bumped) != tensor_checksum(ts[0])
    assert tensor_checksum(ts[0], torch.bfloat16) == tensor_checksum(ts[0].bfloat16())


def test_scheduler_runs_a_command_inline_only_when_paused_and_idle(engine_model):
    """``run_now_if_paused`` (a weight push's copy on a GPU engine) runs in the caller's thread
    only while generation is paused and nothing is queued; otherwise it keeps its place in line."""
    import threading

    from embedded_engine.model_runner import ModelRunner
    from embedded_engine.scheduler import Scheduler

    s = Scheduler(ModelRunner(EngineSettings(model_path=str(engine_model))), 4, 4096, 0, "0")
    here = threading.current_thread()
    try:
        assert s.run_now_if_paused(threading.current_thread).result(5) is not here  # not paused
        s.pause("in_place")
        inline = s.run_now_if_paused(threading.current_thread)
        assert inline.done() and inline.result() is here
        gate, order = threading.Event(), []
        s.run_command(lambda: (gate.wait(5), order.append(1)))
        queued = s.run_now_if_paused(lambda: order.append(2))  # behind the pending command
        assert not queued.done()
        gate.set()
        queued.result(5)
        assert order == [1, 2]
        with pytest.raises(ZeroDivisionError):
            s.run_now_if_paused(lambda: 1 / 0).result(0)
        s.resume()  # the scheduler thread still serves commands after inline ones
        assert s.run_command(lambda: 7).result(5) == 7
    finally:
        s.stop()


def test_cpu_receive_buffers_are_reused_only_once_their_copy_ran():
    from embedded_engine.weights import _ReceiveBuffers

    pool = _ReceiveBuffers(slots=2)
    a, free_a = pool.take(1000)
    b, free_b = pool.take(1000)
    c, _ = pool.take(1000)  # both slots busy: a fresh buffer, never a wait or a shared one
    ptrs = {a.data_ptr(), b.data_ptr(), c.data_ptr()}
    assert len(ptrs) == 3 and a.numel() == b.numel() == c.numel() == 1000
    free_a()
    again, free_again = pool.take(800)  # fits in a's slot: the same memory, cut to size
    assert again.data_ptr() == a.data_ptr() and again.numel() == 800
    free_again()
    free_b()
    bigger, _ = pool.take(5000)  # no free slot is big enough: a slot gets a bigger buffer
    assert bigger.numel() == 5000 and bigger.data_ptr() not in ptrs
