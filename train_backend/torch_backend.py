"""The torch train backend: an HF causal LM, torch's AdamW, and FSDP2 (``fully_shard``) across
data-parallel ranks when ``torch.distributed`` is initialized with more than one rank.

One :meth:`TorchBackend.train_step` = one rollout batch: rank 0's groups are broadcast, advantages
are computed per group, the trainable samples are cut into optimizer steps
(``--global-batch-size``), each step's samples are shared across ranks by tokens, packed into
micro-batches under ``--max-tokens-per-micro-batch`` and trained with gradient accumulation.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from buffer.sample import Sample
from train_backend import lora as lora_adapter
from train_backend import torch_checkpoint
from train_backend.batching import PackedMicroBatch, pack, plan_micro_batches
from train_backend.critic import TorchCritic
from train_backend.hooks import TrainHooks
from train_backend.settings import TrainSettings
from train_backend.losses import LossConfig, log_probs_from_logits
from train_backend.schedule import lr_factor
from train_backend.step import MicroBatchLoss, run_train_step


class TorchBackend:
    """HF model + AdamW (+ FSDP2 under data parallelism). See :class:`~train_backend.interfaces.TrainBackend`."""

    def __init__(self, settings: TrainSettings, compile_layers: bool = False) -> None:
        """``compile_layers``: ``torch.compile`` each decoder layer in place (fused norms, RoPE,
        SwiGLU, residuals; the first steps compile). Parameter names are unchanged."""
        from transformers import AutoModelForCausalLM

        self.settings = settings
        self.hooks = TrainHooks.load(settings)  # slime's trainer-side plugins (errors name the flag)
        self.loss_cfg = LossConfig.from_settings(settings)
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = torch.device(settings.device)
        if self.device.type == "cuda" and self.device.index is None:
            # one GPU per rank: LOCAL_RANK as torchrun sets it, else the rank modulo the GPUs here
            local = int(os.environ.get("LOCAL_RANK", self.rank % max(torch.cuda.device_count(), 1)))
            self.device = torch.device("cuda", local)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(settings.seed)

        # Master weights (and so AdamW's state) are float32 whatever --train-dtype says: a bf16
        # weight cannot take an update of lr 1e-6 x its size. --train-dtype is the compute dtype.
        self.compute_dtype = getattr(torch, settings.dtype)
        model = AutoModelForCausalLM.from_pretrained(settings.hf_checkpoint, dtype=torch.float32)
        self.config = model.config
        self.max_seq_len: int | None = self.config.max_position_embeddings
        # Varlen attention kernels cost nothing for packing everything into one row; a dense mask
        # (sdpa/eager) costs row_length^2, so rows are then kept about as long as the longest sequence.
        self.one_row = self.config._attn_implementation in ("flash_attention_2", "flash_attention_3")
        # The reference policy = a frozen copy of the initial weights; it stays on the CPU between
        # uses so it costs no accelerator memory while the policy trains.
        self.ref_model = None
        if settings.use_kl_loss and settings.ref_load:  # --ref-load: another HF checkpoint
            self.ref_model = AutoModelForCausalLM.from_pretrained(settings.ref_load, dtype=self.compute_dtype)
            self.ref_model.eval().requires_grad_(False)
        elif settings.use_kl_loss:  # frozen: it can live in the compute dtype
            self.ref_model = copy.deepcopy(model).to(self.compute_dtype).eval().requires_grad_(False)
        if settings.recompute_granularity == "full":  # validated: full / uniform / 1 layer
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to(self.device)
        self.lora = settings.lora if settings.lora is not None and settings.lora.enabled else None
        if self.lora is not None:  # the base frozen (the reference above copied it first), the adapter trains
            model = lora_adapter.wrap(model, self.lora)
        if self.distributed:
            self._shard(model)
            if self.ref_model is not None:
                self.ref_model.to(self.device)
                self._shard(self.ref_model)
        if compile_layers:
            from torch import _dynamo

            layers = model.get_decoder().layers
            # one code object for every layer: room for a guard per layer (e.g. its index)
            name = "recompile_limit" if hasattr(_dynamo.config, "recompile_limit") else "cache_size_limit"
            setattr(_dynamo.config, name, max(getattr(_dynamo.config, name), 2 * len(layers) + 8))
            for layer in layers:
                layer.compile()
        if settings.flat_params and not self.distributed and self.lora is None:
            flatten_parameters(model)
        self.model = model
        self.model.train()
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapter only
        if settings.optimizer == "sgd":  # Megatron's sgd: momentum 0.9 (its --sgd-momentum default)
            self.optimizer = torch.optim.SGD(trainable, lr=settings.lr, momentum=0.9,
                                             weight_decay=settings.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(
                trainable, lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2),
                eps=settings.adam_eps, weight_decay=settings.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(settings))
        self.optimizer_steps = 0
        self.critic: TorchCritic | None = None
        if settings.advantage_estimator == "ppo":
            if self.distributed:  # TrainerGroupSettings refuses this at start-up; a direct caller gets it here
                raise ValueError("--advantage-estimator ppo: the critic trains on one rank (--actor-num-gpus-per-node "
                                 "1 --actor-num-nodes 1)")
            self.critic = TorchCritic(settings, self.device, self._pack, self._autocast)
        self.hooks.call_init()

    # --- setup --------------------------------------------------------------------------------
    def _shard(self, model: torch.nn.Module) -> None:
        """FSDP2: shard every decoder layer, then the root (embeddings, norm, head); parameters are
        gathered in the compute dtype and gradients reduced in float32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        for layer in model.get_decoder().layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)

    def _autocast(self):
        """Single process: autocast to the compute dtype (under FSDP2 its policy casts instead)."""
        if self.distributed or self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    # --- forward ------------------------------------------------------------------------------
    def _log_probs(self, model: torch.nn.Module, mb: PackedMicroBatch, with_entropy: bool,
                   entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
        """Policy log-probs (and entropy) of a packed micro-batch's response tokens: ``[N]``.
        The entropy keeps its graph only with ``entropy_grad`` (it costs a [N, V] softmax)."""
        logits = self._response_logits(model, mb)  # [N, V]
        temp = self.settings.rollout_temperature
        logp, entropy = log_probs_from_logits(logits, mb.targets, temp, with_entropy and entropy_grad)
        if with_entropy and not entropy_grad:
            with torch.no_grad():
                entropy = log_probs_from_logits(logits.detach(), mb.targets, temp, True)[1]
        return logp, entropy

    def _response_logits(self, model: torch.nn.Module, mb: PackedMicroBatch) -> Tensor:
        """The logits predicting each response token of the micro-batch: ``[N, V]``."""
        # logits only where a response token is predicted: most prompt vocab projections are skipped
        rows, width = mb.input_ids.shape
        with self._autocast():
            if rows == 1:
                out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, logits_to_keep=mb.logit_index,
                            use_cache=False)
                logits = out.logits[0]  # [N, V]
            else:  # keep the columns any row needs, then pick each token's (row, column)
                out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, logits_to_keep=mb.keep_columns,
                            use_cache=False)
                logits = out.logits[mb.logit_index // width, mb.keep_inverse]  # [N, V]
        return logits

    @contextlib.contextmanager
    def _ref_on_device(self) -> Iterator[torch.nn.Module]:
        """The reference model on the compute device for the duration (it waits on the CPU)."""
        assert self.ref_model is not None
        move = not self.distributed and self.device.type != "cpu"
        if move:
            self.ref_model.to(self.device)
        try:
            yield self.ref_model
        finally:
            if move:
                self.ref_model.to("cpu")

    @torch.no_grad()
    def forward_log_probs(self, model: torch.nn.Module, mbs: list[PackedMicroBatch]) -> list[Tensor | None]:
        """No-grad log-probs ``[N]`` of each micro-batch (the reference model moved to the device for it)."""
        with self._ref_on_device() if model is self.ref_model else contextlib.nullcontext():
            return [self._log_probs(model, mb, False)[0] for mb in mbs]

    # --- training: what run_train_step (train_backend/step.py) calls ----------------------------
    @property
    def dp_rank(self) -> int:
        return self.rank  # every rank is a data-parallel replica (FSDP2 shards parameters, not data)

    @property
    def dp_size(self) -> int:
        return self.world_size

    reports_stats = True  # every rank computes the loss of its own samples

    def train_step(self, groups: list[list[Sample]] | None, step: int) -> dict[str, float]:
        """Train on one rollout batch; returns ``train/...`` metrics (identical on every rank)."""
        return run_train_step(self, groups, step)

    def _pack(self, samples: list[Sample], advantages: list[float] | None = None) -> PackedMicroBatch:
        row_len = None if self.one_row else max(len(x.tokens) for x in samples)
        return pack(samples, advantages, row_len=row_len, pad_id=self.config.pad_token_id or 0).to(self.device)

    def micro_batches(self, samples: list[Sample], advantages: list, filler: Sample) -> list[PackedMicroBatch]:
        """``samples`` packed; every rank gets the same number of micro-batches (FSDP's
        collectives run per forward), padded with zero-weight ones of ``filler``."""
        plan = plan_micro_batches([len(x.tokens) for x in samples], self.settings.max_tokens_per_micro_batch)
        mbs = [self._pack([samples[j] for j in b], [advantages[j] for j in b]) for b in plan]
        n = len(mbs)
        if self.distributed:
            t = torch.tensor([n], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            n = int(t.item())
        while len(mbs) < n:  # a dummy with an all-zero loss mask: runs the collectives, adds nothing
            dummy = self._pack([filler], [0.0])
            dummy.loss_mask.zero_()
            dummy.rollout_mask.zero_()
            dummy.num_tokens = 0
            mbs.append(dummy)
        return mbs

    def packed(self, mb: PackedMicroBatch) -> PackedMicroBatch:
        return mb

    def forward_backward(self, mbs: list[PackedMicroBatch], loss: MicroBatchLoss) -> None:
        for j, mb in enumerate(mbs):
            value = loss(j, lambda entropy_grad, mb=mb: self._log_probs(self.model, mb, True, entropy_grad),
                         lambda mb=mb: self._response_logits(self.model, mb))  # raw: slime's helpers divide by T
            # FSDP averages gradients over ranks; the loss is already a sum over the whole step's
            # tokens, so scale back up to get the sum.
            (value * self.world_size).backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def plugin_log_probs(self, prefix: str, samples: list[Sample]) -> list[list[float]] | None:
        """The log-probs slime's rollout-data hooks read: the policy's (``""``) or the reference's
        (``"ref_"``; None without one), each after slime's before-log-prob hook. Collective."""
        model = self.model if prefix == "" else self.ref_model
        if model is None:
            return None
        self.hooks.call_before_log_prob([model], prefix)
        if prefix == "":
            return self.compute_log_probs(samples)
        with self._ref_on_device() as ref:
            return self._sample_log_probs(ref, samples)

    def optimizer_step(self) -> tuple[float, float]:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.settings.clip_grad if self.settings.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        norm_f, lr = float(norm), self.optimizer.param_groups[0]["lr"]
        if not torch.isfinite(torch.tensor(norm_f)):
            return norm_f, lr  # run_train_step raises; the weights stay
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return norm_f, lr

    # --- inference ----------------------------------------------------------------------------
    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-response-token log-probs of the current policy (logits / ``--rollout-temperature``).
        Collective under data parallelism: every rank passes the same samples and gets all."""
        return self._sample_log_probs(self.model, samples)

    @torch.no_grad()
    def _sample_log_probs(self, model: torch.nn.Module | None, samples: list[Sample]) -> list[list[float]]:
        out: list[list[float]] = [[] for _ in samples]
        todo = [i for i, x in enumerate(samples) if x.response_length > 0]
        plan = plan_micro_batches([len(samples[i].tokens) for i in todo], self.settings.max_tokens_per_micro_batch)
        for b in plan:
            mb = self._pack([samples[todo[j]] for j in b])
            logp, _ = self._log_probs(model or self.model, mb, False)
            for j, t in zip(b, mb.split(logp)):
                out[todo[j]] = t.tolist()
        return out

    # --- weights and checkpoints ----------------------------------------------------------------
    def named_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under HF names in the compute dtype, one parameter at a time (each a
        collective under FSDP2: every rank must exhaust the iterator). A parameter already in that
        dtype is yielded itself: storage that stays put between pushes, which a colocated push can
        hand over once (``--update-weight-load-format mapped``). With LoRA: the frozen base weights
        (the adapter travels on its own: :meth:`adapter`)."""
        params = lora_adapter.base_hf_weights(self.model) if self.lora is not None else self.model.named_parameters()
        for name, p in params:
            if hasattr(p, "full_tensor"):
                yield name, p.full_tensor().detach().to(self.compute_dtype)
            elif p.dtype == self.compute_dtype:
                yield name, p
            else:
                yield name, p.detach().to(self.compute_dtype)  # what the engines run (float32 masters stay here)

    def adapter(self) -> tuple[dict, dict[str, Tensor]] | None:
        """With LoRA: the adapter as peft saves it, ``(adapter_config, {peft name: float32 tensor})``;
        else None."""
        if self.lora is None:
            return None
        return (lora_adapter.adapter_config(self.model, self.settings.hf_checkpoint),
                lora_adapter.adapter_tensors(self.model))

    def save(self, path: str) -> None:
        """Model + optimizer (torch.distributed.checkpoint, sharded under FSDP2), scheduler, step
        counter and every rank's RNG state."""
        torch_checkpoint.save(self, path)

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote (same world size for the RNG states)."""
        torch_checkpoint.load(self, path)

    def export_hf(self, path: str) -> None:
        """An HF checkpoint of the current policy (+ the tokenizer of ``--hf-checkpoint``)."""
        torch_checkpoint.export_hf(self, path)

    def extra_state(self) -> dict[str, Any]:
        state = {"scheduler": self.scheduler.state_dict(), "optimizer_steps": self.optimizer_steps}
        if self.critic is not None:
            state["critic_scheduler"] = self.critic.scheduler.state_dict()
        return state

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])
        if self.critic is not None:
            self.critic.scheduler.load_state_dict(state["critic_scheduler"])


def flatten_parameters(model: torch.nn.Module) -> None:
    """Move ``model``'s parameters into one buffer per (device, dtype), each parameter a view of
    its buffer (values unchanged; the old storages are freed). A colocated ``mapped`` push then
    hands each engine one CUDA IPC handle per buffer instead of one per parameter. Parameters
    that share an object (tied embeddings) are moved once."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
    for p in model.parameters():  # unique Parameter objects
        groups.setdefault((p.device, p.dtype), []).append(p)
    with torch.no_grad():
        for (device, dtype), ps in groups.items():
            align = max(1, 256 // dtype.itemsize)  # each parameter starts 256-byte aligned, as allocations do
            starts = [0]
            for p in ps[:-1]:
                starts.append(starts[-1] + -(-p.numel() // align) * align)
            flat = torch.empty(starts[-1] + ps[-1].numel(), dtype=dtype, device=device)  # [numel]
            for p, start in zip(ps, starts):
                view = flat[start:start + p.numel()].view(p.shape)
                view.copy_(p)
                p.data = view
