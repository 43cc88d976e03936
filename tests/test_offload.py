"""``--offload-train``: the optimizer state (and with ``--offload-train-params`` the parameters)
waits in host memory while the engines generate.

On the CPU: the flags' refusals and defaults; training through a parameter offload (the storages
resized to nothing and back) is bitwise unchanged, for per-parameter storages and for the torch
backend's flat buffer. On a GPU (``pytest -m gpu tests/test_offload.py``):
training with an offload and an onload between every step gives bitwise the same parameters as
training without, for a plain torch AdamW (the torch backend's) and for a mixed-precision
optimizer whose fp32 master copies are separate parameters (megatron-core's layout); the GPU
memory the state took is given back to the driver after an offload (another process can use it).
"""

from __future__ import annotations

import copy

import pytest
import torch

from scripts.arguments import parse_args
from train_backend.actor_group import TrainerGroupSettings
from train_backend.arguments import group_settings_from_args, settings_from_args


def test_offload_flag_default_and_refusal(toy_model_dir, capsys):
    base = ["--hf-checkpoint", str(toy_model_dir), "--prompt-data", str(toy_model_dir / "data" / "train.jsonl")]
    args = parse_args(base)
    assert args.offload_train is None  # default: decided by --colocate and the device
    train = settings_from_args(args)
    assert not TrainerGroupSettings().offloads(train)  # CPU, not colocated
    with pytest.raises(SystemExit):  # the launcher's parser reports the settings' error
        parse_args([*base, "--offload-train"])
    assert "--offload-train with --train-device cpu" in capsys.readouterr().err
    assert group_settings_from_args(parse_args([*base, "--no-offload-train"])).offload_train is False
    cuda = settings_from_args(parse_args([*base, "--train-device", "cuda"]))
    assert TrainerGroupSettings(colocate=True).offloads(cuda)
    assert not TrainerGroupSettings(colocate=True, offload_train=False).offloads(cuda)
    assert not TrainerGroupSettings().offloads(cuda)



def test_offload_params_flag_needs_offload_and_excludes_a_mapped_push(toy_model_dir, capsys):
    from scripts.arguments import parse
    from weight_sync.interfaces import resolve_load_format

    base = ["--hf-checkpoint", str(toy_model_dir), "--prompt-data", str(toy_model_dir / "data" / "train.jsonl")]
    with pytest.raises(SystemExit):
        parse_args([*base, "--offload-train-params"])  # CPU: no --offload-train to go with it
    assert "--offload-train-params moves the parameters" in capsys.readouterr().err
    cuda = settings_from_args(parse_args([*base, "--train-device", "cuda"]))
    assert TrainerGroupSettings(colocate=True, offload_train_params=True).offloads(cuda)
    with pytest.raises(ValueError, match="--offload-train-params moves"):
        TrainerGroupSettings(colocate=True, offload_train=False, offload_train_params=True).validate(cuda)
    # the launcher's choice: auto is mapped when colocated, flattened buckets when the parameters move
    assert resolve_load_format("auto", "tensor") == "mapped"
    assert resolve_load_format("auto", "tensor", params_move=True) == "flattened_bucket"
    assert resolve_load_format("mapped", "tensor", params_move=True) == "mapped"  # explicit: the launcher refuses
    run = parse([*base, "--train-device", "cuda", "--colocate", "--offload-train-params"])[1]
    assert run.sync.load_format == "flattened_bucket" and not run.train.flat_params and run.group.offload_train_params
    with pytest.raises(SystemExit):
        parse([*base, "--train-device", "cuda", "--colocate", "--offload-train-params",
               "--update-weight-load-format", "mapped"])
    assert "--update-weight-load-format mapped has the engines keep" in capsys.readouterr().err


@pytest.mark.parametrize("flat", [False, True])
def test_parameter_offload_frees_each_storage_and_trains_the_same(flat):
    """CPU: the 'host' copy is a second CPU tensor, but the storages are really resized to nothing
    and back, so every view (the flat buffer's included) must find its values again."""
    from train_backend.offload import TrainOffload
    from train_backend.torch_backend import flatten_parameters

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    model = copy.deepcopy(ref)
    if flat:
        flatten_parameters(model)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
    off = TrainOffload(opt, list(model.parameters()), params=True)
    assert len(off._storages) == (1 if flat else 4)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad(set_to_none=True)
        moved = off.offload()
        assert moved >= param_bytes * (3 if step else 1)  # the parameters, and Adam's moments once they exist
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # freed, views kept
        assert off.onload() == moved
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))

class _MixedPrecision:
    """megatron-core's layout in small: bf16 model parameters, an inner torch AdamW stepping fp32
    master copies, copied back into the model after each step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_params = list(model.parameters())
        self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        self.optimizer = torch.optim.AdamW(self.master, lr=1e-2)

    def step(self) -> None:
        for m, p in zip(self.master, self.model_params):
            m.grad = p.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.model_params):
                p.copy_(m)


def _train(model, opt, g: torch.Generator, steps: int, offload=None) -> None:
    for _ in range(steps):
        if offload is not None:
            offload.onload()
        x = torch.randn(64, 1024, device="cuda", generator=g, dtype=next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        if offload is not None:
            offload.offload()


@pytest.mark.gpu
@pytest.mark.parametrize("params", [False, True])
@pytest.mark.parametrize("layout", ["torch", "mixed_precision"])
def test_offloaded_training_is_bitwise_the_same(layout, params):
    from train_backend.offload import TrainOffload

    torch.manual_seed(0)
    dtype = torch.float32 if layout == "torch" else torch.bfloat16
    ref = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    ref = ref.to("cuda", dtype)
    model = copy.deepcopy(ref)

    def make(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-2) if layout == "torch" else _MixedPrecision(m)

    ref_opt, opt = make(ref), make(model)
    _train(ref, ref_opt, torch.Generator(device="cuda").manual_seed(0), 5)
    off = TrainOffload(opt, list(model.parameters()), params=params)
    g = torch.Generator(device="cuda").manual_seed(0)  # the same inputs as the reference's, in order
    _train(model, opt, g, 1)  # Adam's state exists from the first step on
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    moved = off.offload()
    state_bytes = sum(2 * p.numel() * 4 for p in model.parameters())  # two fp32 moments
    if layout == "mixed_precision":
        state_bytes += sum(p.numel() * 4 for p in model.parameters())  # and the fp32 masters
    if params:
        state_bytes += sum(p.numel() * p.element_size() for p in model.parameters())  # and the parameters
    assert moved >= state_bytes
    assert torch.cuda.memory_reserved() <= before - 0.9 * state_bytes  # back to the driver, not just cached
    inner = off.optimizers[0]
    assert all(not t.is_cuda for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    off.onload()
    _train(model, opt, g, 4, offload=off)
    off.onload()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(ref_opt.state_dict()["state"].values() if layout == "torch" else
                    ref_opt.optimizer.state_dict()["state"].values(),
                    inner.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def _megatron_with_and_without_offload(ckpt: str, steps: int) -> dict:
    """One rank: megatron-core's mixed-precision optimizer (bf16 parameters, fp32 masters), trained
    twice on the same batches, the second time with an offload (the parameters' storages too) and
    an onload around every step;
    returns both runs' fp32 masters and Adam moments (the bf16 weights would hide small errors)."""
    from tests._fixtures_megatron import make_groups, train_settings
    from train_backend.megatron import create_megatron_backend, parallel
    from train_backend.megatron.arguments import MegatronSettings
    from train_backend.offload import TrainOffload, torch_optimizers

    runs, moved = [], []
    for offload in (False, True):
        backend = create_megatron_backend(train_settings(ckpt, dtype="bfloat16"), MegatronSettings())
        off = TrainOffload(backend.optimizer, list(backend.model.parameters()), params=True) if offload else None
        for step in range(steps):
            if off is not None:
                off.onload()
            backend.train_step(make_groups(step), step)
            if off is not None:
                moved.append(off.offload())
        if off is not None:
            off.onload()
        opts = torch_optimizers(backend.optimizer)
        runs.append({"masters": [p.detach().clone() for o in opts for g in o.param_groups for p in g["params"]],
                     "moments": [st[k].clone() for o in opts for st in o.state.values() for k in ("exp_avg", "exp_avg_sq")],
                     "weights": {k: v.detach().clone() for k, v in backend.named_hf_weights()}})
        del backend
        parallel.destroy_parallel_state()
    return {"ref": runs[0], "got": runs[1], "moved": moved,
            "master_bytes": sum(p.numel() * 4 for p in runs[0]["masters"])}


def test_megatron_optimizer_trains_the_same_through_the_offload_swap(toy_model_dir, tmp_path):
    """On the CPU the 'host' copy is a second CPU tensor, so this checks the swap itself against
    megatron-core's own optimizer: its fp32 masters (plain tensors it keeps in param groups and
    ``param.main_param``) and Adam's state move out and back, the bf16 parameters' storages are
    freed and refilled under megatron's buffers, and training is bitwise unchanged."""
    pytest.importorskip("megatron.core")
    from tests._fixtures_megatron import spawn

    out = spawn(_megatron_with_and_without_offload, 1, (str(toy_model_dir), 3), tmp_path / "ranks")[0]
    ref, got = out["ref"], out["got"]
    assert out["moved"][0] >= 3 * out["master_bytes"]  # masters + two Adam moments, at least
    assert ref["masters"][0].dtype == torch.float32 and len(got["masters"]) == len(ref["masters"])
    assert all(torch.equal(a, b) for a, b in zip(ref["masters"], got["masters"]))
    assert all(torch.equal(a, b) for a, b in zip(ref["moments"], got["moments"]))
    assert all(torch.equal(got["weights"][k], ref["weights"][k]) for k in ref["weights"])
