"""The Megatron-core train backend: TP x PP x DP through megatron-core's parallel state, its DDP
wrapper and (distributed) optimizer; bf16 on GPU; runs on CPU with gloo through
:mod:`~train_backend.megatron.cpu_compat`.

One :meth:`MegatronBackend.train_step` = one rollout batch, exactly like the torch backend: both
run :func:`train_backend.step.run_train_step`. What is this backend's own: each replica's share of
an optimizer step is right-padded into equal-shape micro-batches and run through megatron's
pipeline schedule, and megatron's optimizer steps.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from buffer.sample import Sample
from train_backend.batching import PackedMicroBatch, balance, pack
from train_backend.hooks import TrainHooks
from train_backend.settings import TrainSettings
from train_backend.losses import LossConfig
from train_backend.megatron import checkpoint, cpu_compat, forward, loss_head, model as mmodel, parallel, saving
from train_backend.megatron.arguments import MegatronSettings
from train_backend.schedule import learning_rate
from train_backend.step import MicroBatchLoss, run_train_step

F = TypeVar("F", bound=Callable[..., Any])


def _on_device(fn: F) -> F:
    """Run the method inside the CPU compatibility layer when the backend is on the CPU."""

    @functools.wraps(fn)
    def wrapper(self: "MegatronBackend", *args: Any, **kwargs: Any) -> Any:
        with cpu_compat.maybe_cpu_mode(self.device):
            return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _finalize_grads(model: list[torch.nn.Module], num_tokens: Any = None, **kwargs: Any) -> None:
    # The losses are already normalised; never let megatron divide by its token count.
    finalize_model_grads(model, None, **kwargs)


def _fuse_adam(optimizer: Any) -> None:
    """Switch the torch Adam(W) inside megatron's optimizer wrapper(s) to torch's fused kernel
    (one multi-tensor kernel per step instead of ~10 foreach passes over the fp32 state). Without
    TE/apex megatron-core uses ``torch.optim.AdamW`` with its default (foreach) implementation."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    for opt in inner:
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"--fused-adam: megatron built a {type(opt).__name__}, not torch's Adam/AdamW")
        for group in opt.param_groups:
            group["foreach"] = False
            group["fused"] = True


def _recompute_overrides(s: TrainSettings) -> dict[str, Any]:
    """Megatron's --recompute-* flags, as its TransformerConfig takes them."""
    if s.recompute_granularity is None:
        return {}
    out: dict[str, Any] = {"recompute_granularity": s.recompute_granularity}
    if s.recompute_granularity == "full":
        out.update(recompute_method=s.recompute_method, recompute_num_layers=s.recompute_num_layers)
    return out


class MegatronBackend:
    """See :class:`~train_backend.interfaces.TrainBackend`. Every rank of the job constructs one
    and calls each method in the same order (they are collective)."""

    def __init__(self, settings: TrainSettings, megatron: MegatronSettings | None = None) -> None:
        from transformers import AutoConfig

        self.settings = settings
        self.hooks = TrainHooks.load(settings)  # slime's trainer-side plugins (errors name the flag)
        self.mcfg = (megatron or MegatronSettings()).for_device(torch.device(settings.device).type)
        self.loss_cfg = LossConfig.from_settings(settings)
        self.device = torch.device(settings.device)
        if settings.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--train-dtype={settings.dtype!r}: the Megatron backend supports float32 and bfloat16")
        self.dtype = getattr(torch, settings.dtype)
        self.hf_config = AutoConfig.from_pretrained(settings.hf_checkpoint)
        with cpu_compat.maybe_cpu_mode(self.device):
            self._init_distributed()
            tp, pp = self.mcfg.tensor_model_parallel_size, self.mcfg.pipeline_model_parallel_size
            parallel.init_parallel_state(tp, pp, settings.seed, self.device)
            self.dims = mmodel.dims_from_hf(self.hf_config, self.mcfg.make_vocab_size_divisible_by, tp)
            if self.dims.num_layers % pp:
                raise ValueError(f"--pipeline-model-parallel-size={pp} does not divide the "
                                 f"{self.dims.num_layers} layers")
            self.config = mmodel.transformer_config(
                self.dims, params_dtype=self.dtype, tp_size=tp, pp_size=pp,
                sequence_parallel=self.mcfg.sequence_parallel, on_cpu=self.device.type == "cpu",
                recompute=self.mcfg.recompute_activations, bias_swiglu_fusion=self.mcfg.bias_swiglu_fusion,
                **_recompute_overrides(settings))
            reader = checkpoint.HFCheckpointReader(settings.hf_checkpoint)
            self.max_seq_len = self.dims.max_position_embeddings
            module = self._build(reader)
            ddp_cfg = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=self.mcfg.use_distributed_optimizer)
            self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_cfg, module=module)
            self.ref_model = None
            if settings.use_kl_loss:  # --ref-load: the reference's own HF checkpoint
                ref_reader = checkpoint.HFCheckpointReader(settings.ref_load) if settings.ref_load else reader
                self.ref_model = self._build(ref_reader).eval().requires_grad_(False)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer=settings.optimizer, lr=settings.lr, min_lr=settings.min_lr,
                                weight_decay=settings.weight_decay, adam_beta1=settings.adam_beta1,
                                adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
                                clip_grad=settings.clip_grad, bf16=self.dtype == torch.bfloat16,
                                params_dtype=self.dtype,
                                use_distributed_optimizer=self.mcfg.use_distributed_optimizer),
                [self.model])
            if self.dtype == torch.bfloat16:  # the masters from the checkpoint, not its bf16 rounding
                checkpoint.load_hf_master_weights(self.optimizer, self.model, reader, self.dims)
            if self.mcfg.fused_adam:
                _fuse_adam(self.optimizer)
            self.config.no_sync_func = self.model.no_sync
            self.config.finalize_model_grads_func = _finalize_grads
            self.hooks.call_init()
        self.optimizer_steps = 0
        self.rank = dist.get_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()

    # --- setup --------------------------------------------------------------------------------
    def _init_distributed(self) -> None:
        if dist.is_initialized():
            return
        if "RANK" in os.environ:
            parallel.init_distributed(self.device)
            return
        # A single process without a launcher: a one-rank group over a file store (no sockets).
        store = dist.FileStore(tempfile.mktemp(prefix="reservoir_megatron_"), 1)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)

    def _build(self, reader: checkpoint.HFCheckpointReader) -> torch.nn.Module:
        """This stage's model with the HF weights, on the device.

        bf16 parameters are created as such (``params_dtype``); no Float16Module wrapper, whose
        only effect here would be an fp32 copy of the full ``[b, T, V]`` logits: the loss casts
        just the response positions."""
        use_te = {"auto": None, "local": False, "transformer_engine": True}[self.mcfg.transformer_impl]
        if use_te and not mmodel.HAVE_TE:
            raise ValueError("--transformer-impl=transformer_engine but TransformerEngine is not installed")
        if self.config.sequence_parallel and not (mmodel.HAVE_TE if use_te is None else use_te):
            # megatron-core's local (torch) norms refuse sequence parallelism
            raise ValueError("--sequence-parallel needs TransformerEngine layers (--transformer-impl)")
        if self.hooks.model_provider is not None:  # slime's --custom-model-provider-path
            model = self.hooks.build_model(parallel_state.is_pipeline_first_stage(),
                                           parallel_state.is_pipeline_last_stage()).to(self.device)
        else:
            model = mmodel.build_gpt_model(self.dims, self.config, self.hf_config, use_te=use_te,
                                           sdpa_backend=self.mcfg.sdpa_backend).to(self.device)
        if self.dtype == torch.bfloat16:
            model.bfloat16()  # megatron-core's torch norms ignore params_dtype
        checkpoint.load_hf_weights(model, reader, self.dims)
        if self.mcfg.torch_compile:
            mmodel.compile_norms(model)
        return model

    # --- batching -----------------------------------------------------------------------------
    def _micro_batches(self, samples: list[Sample], advantages: list[float] | None) -> list[forward.MicroBatch]:
        """Right-padded equal-shape micro-batches of ``samples``, with the flat ``[N]`` loss inputs
        of :func:`train_backend.batching.pack` and each response token's logit position."""
        if not samples:
            raise ValueError("no samples")
        multiple = 8 * (self.mcfg.tensor_model_parallel_size if self.config.sequence_parallel else 1)
        mbs = forward.make_micro_batches([s.tokens for s in samples], self.settings.max_tokens_per_micro_batch,
                                         self.device, pad_to_multiple=multiple)
        t = mbs[0].tokens.shape[1]
        for mb in mbs:
            real = [(r, row) for r, row in enumerate(mb.rows) if row >= 0]
            packed = pack([samples[row] for _, row in real],
                          None if advantages is None else [advantages[row] for _, row in real])
            # logit at (r, p) predicts token p+1: response token i of a sample of length n with
            # response r_len sits at p = n - r_len - 1 + i.
            pos = [torch.arange(r * t + len(samples[row].tokens) - samples[row].response_length - 1,
                                r * t + len(samples[row].tokens) - 1) for r, row in real]
            mb.extra["packed"] = packed.to(self.device)
            mb.extra["logit_pos"] = torch.cat(pos).to(self.device)  # [N]
        return mbs

    def _filler(self, sample: Sample) -> list[forward.MicroBatch]:
        """One micro-batch whose loss mask is all zero: lets a replica with no samples take part."""
        mbs = self._micro_batches([sample], [0.0])
        mbs[0].extra["packed"].loss_mask.zero_()
        mbs[0].extra["packed"].rollout_mask.zero_()
        mbs[0].extra["packed"].num_tokens = 0
        return mbs

    def _logp(self, mb: forward.MicroBatch, logits: torch.Tensor, with_entropy: bool, entropy_grad: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-token log-probs ``[N]`` (and entropies) from the stage output ``[b, T, Vp/tp]``.
        The entropy keeps its graph only with ``entropy_grad`` (it costs another ``[N, V]`` pass)."""
        packed = mb.extra["packed"]
        temp = self.settings.rollout_temperature
        if self.mcfg.loss_head != "unfused":
            return loss_head.log_probs_and_entropy(
                logits.reshape(-1, logits.shape[-1]), mb.extra["logit_pos"], packed.targets,  # [b*T, Vp/tp]
                self.dims.vocab_size, temp, with_entropy=with_entropy, entropy_grad=entropy_grad,
                impl=self.mcfg.loss_head)
        flat = logits.reshape(-1, logits.shape[-1])[mb.extra["logit_pos"]]  # [N, Vp/tp]
        x = forward.masked_vocab_logits(flat, self.dims.vocab_size, temp)  # [N, Vp/tp] fp32, fresh
        ent = None
        if with_entropy and entropy_grad:
            ent = forward.flat_entropy(flat, self.dims.vocab_size, temp)  # [N], its own graph
        elif with_entropy:
            with torch.no_grad():  # a metric only: read x before the cross entropy shifts it in place
                ent = forward.entropy_of_masked(x)  # [N]
        logp = -tensor_parallel.vocab_parallel_cross_entropy(x, packed.targets)  # [N]
        return logp, ent

    def forward_log_probs(self, model: torch.nn.Module, mbs: list[forward.MicroBatch]) -> list[torch.Tensor | None]:
        """Per micro-batch log-probs ``[N]`` on the last stage (None elsewhere)."""
        def loss_fn(mb: forward.MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            logp, _ = self._logp(mb, logits, False)
            return logits.new_zeros(()), {"logp": logp.detach()}

        with torch.no_grad():
            out = forward.run_pipeline([model], mbs, loss_fn, forward_only=True)
        if not parallel_state.is_pipeline_last_stage():
            return [None] * len(mbs)
        return [o["logp"] for o in out]

    # --- training: what run_train_step (train_backend/step.py) calls ----------------------------
    scheduler = None  # the learning rate is set per optimizer step from --lr-* (optimizer_step)
    critic = None  # --advantage-estimator ppo is refused for this backend (TrainSettings)

    @_on_device
    def train_step(self, groups: list[list[Sample]] | None, step: int) -> dict[str, float]:
        """Train on one rollout batch; returns ``train/...`` metrics (identical on every rank)."""
        return run_train_step(self, groups, step)

    @property
    def reports_stats(self) -> bool:
        # the loss runs on the last stage; its tensor-parallel ranks all hold the same values
        return parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0

    def micro_batches(self, samples: list[Sample], advantages: list, filler: Sample) -> list[forward.MicroBatch]:
        if not samples:
            return self._filler(filler)
        return self._micro_batches(samples, advantages)

    def packed(self, mb: forward.MicroBatch) -> PackedMicroBatch:
        return mb.extra["packed"]

    def forward_backward(self, mbs: list[forward.MicroBatch], loss: MicroBatchLoss) -> None:
        index = {id(mb): j for j, mb in enumerate(mbs)}

        def loss_fn(mb: forward.MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            value = loss(index[id(mb)], lambda entropy_grad: self._logp(mb, logits, True, entropy_grad),
                         lambda: self._full_logits(mb, logits))
            return value, {}  # run_train_step keeps the stats

        forward.run_pipeline([self.model], mbs, loss_fn, forward_only=False)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> tuple[float, float]:
        lr = learning_rate(self.settings, self.optimizer_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        ok, grad_norm, _ = self.optimizer.step()
        norm = float(grad_norm) if ok and grad_norm is not None else float("nan")  # not ok: inf/NaN grads
        if torch.isfinite(torch.tensor(norm)):
            self.optimizer_steps += 1
        return norm, lr

    def _full_logits(self, mb: forward.MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        """What ``--loss-type custom_loss`` gets: the full vocabulary's logits ``[N, V]`` (gathered
        over tensor-parallel ranks, the padded vocabulary rows cut) of the positions predicting
        response tokens, from the stage output ``[b, T, Vp/tp]``."""
        flat = logits.reshape(-1, logits.shape[-1])[mb.extra["logit_pos"]]  # [N, Vp/tp]
        return tensor_parallel.gather_from_tensor_model_parallel_region(flat)[:, :self.dims.vocab_size]  # [N, V]

    def plugin_log_probs(self, prefix: str, samples: list[Sample]) -> list[list[float]] | None:
        """The log-probs slime's rollout-data hooks read: the policy's (``""``) or the reference's
        (``"ref_"``; None without one), each after slime's before-log-prob hook. Collective."""
        model = self.model if prefix == "" else self.ref_model
        if model is None:
            return None
        self.hooks.call_before_log_prob([model], prefix)
        return self._sample_log_probs(model, samples)

    # --- inference ----------------------------------------------------------------------------
    @_on_device
    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-response-token log-probs of the current policy (logits / ``--rollout-temperature``).
        Collective: every rank passes the same samples and gets all of them; each data-parallel
        replica computes a share."""
        return self._sample_log_probs(self.model, samples)

    def _sample_log_probs(self, model: torch.nn.Module, samples: list[Sample]) -> list[list[float]]:
        out: dict[int, list[float]] = {i: [] for i in range(len(samples))}
        todo = [i for i, x in enumerate(samples) if 0 < x.response_length < len(x.tokens)]
        mine: dict[int, list[float]] = {}
        if todo:
            share = [todo[j] for j in balance([len(samples[i].tokens) for i in todo], self.dp_size)[self.dp_rank]]
            if share:
                mbs = self._micro_batches([samples[i] for i in share], None)
            else:
                mbs = self._filler(samples[todo[0]])
            results = self.forward_log_probs(model, mbs)
            if parallel_state.is_pipeline_last_stage() and share:
                for mb, lp in zip(mbs, results):
                    assert lp is not None
                    real = [row for row in mb.rows if row >= 0]
                    for row, t in zip(real, mb.extra["packed"].split(lp)):
                        mine[share[row]] = t.float().tolist()
        if dist.get_world_size() > 1:
            gathered: list[dict[int, list[float]]] = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        for part in gathered:
            out.update(part)
        return [out[i] for i in range(len(samples))]

    # --- weights and checkpoints ----------------------------------------------------------------
    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under HF names on global rank 0 (nothing elsewhere); TP shards are
        gathered and PP stages send theirs to rank 0. Collective: every rank must exhaust it."""
        return checkpoint.iter_hf_weights(self.model, self.dims)

    @_on_device
    def save(self, path: str) -> None:
        """Model, optimizer (incl. fp32 master weights; sharded state under the distributed
        optimizer), step counter and RNG states, one file set per rank (same layout to load)."""
        saving.save(self, path)

    @_on_device
    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote (``RuntimeError`` on a layout mismatch)."""
        saving.load(self, path)

    @_on_device
    def export_hf(self, path: str) -> None:
        """Write an HF checkpoint (config, safetensors, tokenizer) of the current weights from rank 0."""
        saving.export_hf(self, path)
