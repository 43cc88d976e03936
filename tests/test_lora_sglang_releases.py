"""The LoRA load from tensors speaks each supported SGLang release's form (0.5.15.post1 and 0.5.23).

``/load_lora_adapter_from_tensors`` changed between the release slime pins (0.5.15.post1, the GPU
machine's) and the one installed here (0.5.23): see ``sglang_protocol/lora_adapter.py``. The
sender's real ``AdapterPush`` sends to a recording client that reports a release through
``/server_info``; the bodies it sends are checked against

- a written-out record of each release's ``LoadLoRAAdapterFromTensorsReqInput`` and the route's
  auth level (always: CI has no 0.5.15 wheel), and
- the releases' own code: 0.5.23's struct (installed) in this process; 0.5.15.post1's struct and its
  ``MultiprocessingSerializer.deserialize`` in a subprocess from the unpacked wheel in
  ``SGLANG_0515_SITE`` (``pip download sglang==0.5.15.post1 --no-deps`` and unzip; skipped if absent).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sglang_protocol.client import EngineClient
from sglang_protocol.lora_adapter import POLICY_ADAPTER, peft_config
from weight_sync.engines import EngineState
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.lora import AdapterPush

SGLANG_0515_SITE = Path(os.environ.get("SGLANG_0515_SITE", "/tmp/sgl0515/site"))

# SGLang 0.5.15.post1, sglang/srt/managers/io_struct.py lines 1945-1953:
#   class LoadLoRAAdapterFromTensorsReqInput(BaseReq, kw_only=True):
#       lora_name: str; config_dict: Dict[str, Any]; serialized_tensors: str; pinned: bool = False
#       added_tokens_config: Optional[Dict[str, Any]] = None; lora_id: Optional[str] = None
#       load_format: Optional[str] = None
# and sglang/srt/entrypoints/http_server.py lines 1442-1444: the route has no @auth_level (NORMAL:
# with --api-key it takes the API key, not the admin key; sglang/srt/utils/auth.py lines 140-146).
# BaseReq (io_struct.py lines 74-78) adds rid and http_worker_ipc. Unknown fields are dropped.
SGLANG_0515 = {"required": {"lora_name": str, "config_dict": dict, "serialized_tensors": str},
               "optional": {"pinned": bool, "added_tokens_config": dict, "lora_id": str, "load_format": str,
                            "rid": str, "http_worker_ipc": str},
               "admin": False}
# SGLang 0.5.23, io_struct.py lines 2548-2562 (serialized_named_tensors: Annotated[List[bytes],
# Base64Bytes()], one entry per TP rank; expected_checksums: Optional[Dict[str, str]]) and
# http_server.py lines 1663-1664 (@auth_level(AuthLevel.ADMIN_OPTIONAL)).
SGLANG_0523 = {"required": {"lora_name": str, "config_dict": dict, "serialized_named_tensors": list},
               "optional": {"pinned": bool, "added_tokens_config": dict, "lora_id": str, "load_format": str,
                            "expected_checksums": dict, "rid": str, "http_worker_ipc": str},
               "admin": True}


class RecordingClient(EngineClient):
    """An engine that reports ``version`` in ``/server_info`` and records every other request."""

    def __init__(self, version: str | None):
        super().__init__("http://127.0.0.1:9")
        self.version, self.calls = version, []

    async def request(self, method, path, payload=None, timeout=None, admin=False):
        if path == "/server_info":
            return {"version": self.version} if self.version is not None else {}
        self.calls.append((path, payload, admin))
        return {"success": True}


def _adapter() -> tuple[dict, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight": torch.randn(shape, generator=g)
               for m in ("q_proj", "v_proj") for ab, shape in (("A", (4, 8)), ("B", (8, 4)))}
    return peft_config(4, 8.0, ["q_proj", "v_proj"]), tensors


def _push(version: str | None, gpus: int = 2, check_equal: bool = False) -> list[tuple[str, dict, bool]]:
    """The requests AdapterPush (tensor transport) sends an engine reporting ``version``."""
    config, tensors = _adapter()

    async def go():
        client = RecordingClient(version)
        try:
            push = AdapterPush(WeightSyncSettings(transport="tensor", check_equal=check_equal))
            try:
                # an SGLang engine: the check reads back through /get_weights_by_name, not adapters
                engine = EngineState("http://127.0.0.1:9", gpus, client, check_equal=check_equal, check="readback")
                await push.push([engine], config, tensors, 1)
            finally:
                push.close()
            return client.calls
        finally:
            await client.close()
    return asyncio.run(go())


def _load_body(calls) -> tuple[dict, bool]:
    (body, admin), = [(b, a) for p, b, a in calls if p == "/load_lora_adapter_from_tensors"]
    return body, admin


def _assert_matches(body: dict, admin: bool, record: dict) -> None:
    fields = {**record["required"], **record["optional"]}
    assert set(record["required"]) <= set(body), sorted(body)
    assert set(body) <= set(fields), f"fields the release does not take: {sorted(set(body) - set(fields))}"
    for k, v in body.items():
        assert isinstance(v, fields[k]), (k, type(v))
    assert admin is record["admin"]


@pytest.mark.parametrize("version, record", [("0.5.15.post1", SGLANG_0515), ("0.5.23", SGLANG_0523),
                                             ("reservoir-embedded-engine 0.1", SGLANG_0523)])
def test_the_tensor_load_follows_the_release_the_engine_reports(version, record):
    """Against the written-out record of each release's struct and auth level; 0.5.23's payload list
    has one entry per TP rank; the rest of the push (unload, version, pause) is the same for both."""
    calls = _push(version, gpus=2)
    body, admin = _load_body(calls)
    _assert_matches(body, admin, record)
    assert body["lora_name"] == POLICY_ADAPTER
    if "serialized_named_tensors" in body:
        assert len(body["serialized_named_tensors"]) == 2
    assert [p for p, _, _ in calls] == ["/pause_generation", "/unload_lora_adapter", "/load_lora_adapter_from_tensors",
                                        "/update_weight_version", "/continue_generation"]


def test_the_check_is_refused_before_pausing_where_sglang_cannot_verify_a_tensor_load():
    """0.5.15 drops ``expected_checksums``: --check-weight-update-equal would check nothing there."""
    with pytest.raises(ValueError, match="--check-weight-update-equal.*0.5.15 does not check"):
        _push("0.5.15.post1", check_equal=True)
    body, admin = _load_body(_push("0.5.16", check_equal=True))  # 0.5.16: one payload, and checksums
    assert set(body) == {"lora_name", "config_dict", "serialized_tensors", "expected_checksums"} and not admin
    body, _ = _load_body(_push("0.5.23", check_equal=True))
    _, tensors = _adapter()
    assert set(body["expected_checksums"]) == set(tensors)


def test_sglang_0523s_own_struct_takes_the_body():
    """The installed SGLang (0.5.23) parses the body as its HTTP route does (pydantic over msgspec)."""
    from pydantic import TypeAdapter

    from sglang_oracle import import_sglang

    sg = import_sglang()
    assert sg.version.startswith("0.5.23"), sg.version
    body, _ = _load_body(_push(sg.version, gpus=2, check_equal=True))
    req = TypeAdapter(sg.io_struct.LoadLoRAAdapterFromTensorsReqInput).validate_json(json.dumps(body))
    assert len(req.serialized_named_tensors) == 2 and req.expected_checksums == body["expected_checksums"]
    got = sg.common.MultiprocessingSerializer.deserialize(req.serialized_named_tensors[1])
    _, tensors = _adapter()
    assert set(got) == set(tensors) and all(torch.equal(got[n], tensors[n]) for n in tensors)


# Runs in a subprocess with 0.5.15.post1's package first on sys.path: for each body (a JSON list on
# stdin), its struct parses it as its /load_lora_adapter_from_tensors route does, and its TpModelWorker's
# deserialize (tp_worker.py lines 195-210: MultiprocessingSerializer.deserialize(recv_req.serialized_tensors))
# gives back the tensors; or the error it raises.
_ORACLE_0515 = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    from transformers.models.auto import configuration_auto as ca
    # 0.5.15's configs register names this transformers already has (qwen3_asr): let them
    register = ca._LazyConfigMapping.register
    ca._LazyConfigMapping.register = lambda self, key, value, exist_ok=False: register(self, key, value, True)
    from sglang_oracle import import_sglang
    sg = import_sglang()
    from pydantic import TypeAdapter
    struct = TypeAdapter(sg.io_struct.LoadLoRAAdapterFromTensorsReqInput)
    out = {"version": sg.version, "file": sg.io_struct.__file__, "bodies": []}
    for body in json.loads(sys.stdin.read()):
        try:
            req = struct.validate_json(json.dumps(body))
            tensors = sg.common.MultiprocessingSerializer.deserialize(req.serialized_tensors)
            out["bodies"].append({"lora_name": req.lora_name, "config_r": req.config_dict["r"],
                                  "tensors": {n: t.double().sum().item() for n, t in tensors.items()}})
        except Exception as e:
            out["bodies"].append({"error": f"{type(e).__name__}: {e}"})
    print(json.dumps(out))
""")


def test_sglang_0515s_own_struct_takes_the_body():
    """0.5.15.post1's own code takes what the sender sends a 0.5.15.post1 engine, and refuses 0.5.23's
    form (what the sender sent every engine before it asked for the release)."""
    if not (SGLANG_0515_SITE / "sglang" / "srt" / "managers" / "io_struct.py").is_file():
        pytest.skip(f"no unpacked sglang 0.5.15.post1 wheel at {SGLANG_0515_SITE} (the record above is checked)")
    config, tensors = _adapter()
    # the payloads name shared-memory storages that the sender's pickler keeps for their receiver
    bodies = [_load_body(_push("0.5.15.post1", gpus=2))[0], _load_body(_push("0.5.23", gpus=1))[0]]
    out = subprocess.run([sys.executable, "-c", _ORACLE_0515, str(SGLANG_0515_SITE), str(Path(__file__).parent)],
                         input=json.dumps(bodies), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["version"] == "0.5.15.post1" and got["file"].startswith(str(SGLANG_0515_SITE)), got
    ours, newer = got["bodies"]
    assert "error" not in ours, ours
    assert ours["lora_name"] == POLICY_ADAPTER and ours["config_r"] == config["r"]
    assert ours["tensors"] == pytest.approx({n: t.double().sum().item() for n, t in tensors.items()})
    assert "serialized_tensors" in newer.get("error", ""), newer


def test_cuda_devices_go_by_index_to_releases_that_read_no_uuid():
    """0.5.15.post1's route deserializes without SGLang's UUID patch (a UUID killed its scheduler on
    the GPU); 0.5.17+ and the embedded engine read UUIDs. The GPU tier pushes CUDA adapters to 0.5.15."""
    from sglang_protocol.lora_adapter import cuda_device_by_uuid

    assert [cuda_device_by_uuid(r) for r in ((0, 5, 15), (0, 5, 16), (0, 5, 17), (0, 5, 23), None)] == \
        [False, False, True, True, True]
