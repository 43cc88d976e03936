"""The model side of the engine: a transformers causal LM run on a left-padded batch.

``prefill`` runs new prompts together (one forward, logits of the last position only) and
returns a ``Batch``; ``merge`` joins it to the running batch; ``decode`` feeds every row's last
token in one forward. Positions are explicit per row and the attention mask is built here as a
4-D boolean mask (transformers passes 4-D masks through untouched), so padding never changes a
row's numbers: a row's log-probs equal a forward over that row alone (to float round-off).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .kv_cache import BatchKVCache
from .native_forward import DerivedTensor, NativeForward, PackSpec
from .settings import EngineSettings

log = logging.getLogger(__name__)
_SDPA_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class Batch:
    """The running batch: cache, per-row validity, next position and last token."""

    cache: BatchKVCache
    valid: torch.Tensor  # [B, T] bool: column holds a real token of that row
    next_pos: torch.Tensor  # [B] long: position id of the next token
    last_tok: torch.Tensor  # [B] long: the token to feed at the next decode step

    @property
    def size(self) -> int:
        return self.valid.shape[0]

    @property
    def length(self) -> int:
        return self.valid.shape[1]


class ModelRunner:
    """Loads the HF model and tokenizer, and runs prefill/decode forwards."""

    # prefill split costs (see length_groups): a forward's fixed cost in FLOPs (Python, dispatch,
    # the join's copy), and a floor on its tokens (a forward of a few tokens runs its matmuls far
    # below their per-token speed at 64 rows)
    PREFILL_FORWARD_FLOP = 1.4e9
    PREFILL_MIN_TOKENS = 32

    def __init__(self, settings: EngineSettings):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.device = torch.device(settings.device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" means the process's current GPU (its CUDA_VISIBLE_DEVICES): give it the index
            # that set_device, NCCL and CUDA IPC need
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.config = AutoConfig.from_pretrained(settings.model_path)
        self.dtype = getattr(torch, settings.torch_dtype_name(self.config.to_dict()))
        if settings.load_format == "dummy":  # SGLang's: shapes from the config, values random
            with torch.device(self.device):
                self.model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype,
                                                              attn_implementation="sdpa").eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                settings.model_path, dtype=self.dtype, attn_implementation="sdpa").to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path or settings.model_path)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        max_pos = getattr(self.config, "max_position_embeddings", None)
        self.context_length = settings.context_length or max_pos or 4096
        if max_pos and self.context_length > max_pos:
            log.warning("--context-length %d exceeds max_position_embeddings %d", self.context_length, max_pos)
        self.num_layers = int(self.config.get_text_config().num_hidden_layers)
        self.eos_ids = self._eos_ids(settings.model_path)
        # transformers 5.24 renamed `past_key_values` to `cache` (older 5.x only know the former)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # the engine's own forward for llama-family models (native_forward.py), else transformers';
        # chosen once here. The oneDNN packing lives inside the native forward when it is used.
        self.native: NativeForward | None = None
        self.packed: PackedLinears | None = None
        why = ("--native-forward off" if settings.native_forward == "off"
               else NativeForward.unsupported(self.model, self.context_length))
        if why is None:
            pack = PackedLinears.spec() if PackedLinears.usable(self.device, self.dtype) else None
            self.native = NativeForward(self.model, pack, context_length=self.context_length + 16)
            with torch.inference_mode():
                self.native.prepare()  # fuse/pack now, so that the first request does not pay for it
            log.info("forward: native (%s; fused q/k/v and gate/up: %s; oneDNN-packed weights: %s)",
                     type(self.model).__name__, self.native.fused, pack is not None)
        else:
            self.packed = PackedLinears.for_model(self.model, self.device, self.dtype)
            log.info("forward: transformers' modules (native forward not used: %s)", why)
        # a forward's fixed cost in prompt tokens (2 FLOPs per parameter and token); None (no split)
        # on an accelerator, where a forward costs its kernel launches more than its tokens
        n_params = sum(p.numel() for p in self.model.parameters())
        self.split_cost_tokens: int | None = (
            max(1, int(self.PREFILL_FORWARD_FLOP / (2 * n_params))) if self.device.type == "cpu" else None)

    def _eos_ids(self, model_path: str) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.config, getattr(self.model, "generation_config", None)):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(int(x) for x in e)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """HF parameter names -> parameters (tied weights appear under every name)."""
        return dict(self.model.named_parameters(remove_duplicate=False))

    # --- forwards ---------------------------------------------------------------------------
    def _kernels(self) -> contextlib.AbstractContextManager:
        """The engine's own kernels for the forward in this block (the model is plain HF outside)."""
        return self.packed.active() if self.packed is not None else contextlib.nullcontext()

    def _attention(self) -> contextlib.AbstractContextManager:
        """SDPA kernels for the engine's forwards. On CUDA, not cuDNN's: it builds a graph per new
        shape, and the KV length is new at every decode step, so every attention call would pay
        for a graph build on the CPU (flash/memory-efficient kernels need none)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel(_SDPA_NO_CUDNN)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, Batch]:
        """Run the prompts, left-padded. Returns (last logits [n, V], batch), rows in prompt order.

        Prompts of mixed lengths run as several forwards of similar lengths when the padding
        that saves outweighs a forward's fixed cost (``length_groups``); transformers' generate
        pads them all to the longest."""
        groups = self.length_groups([len(p) for p in prompts])
        if len(groups) == 1:
            return self._prefill_padded(prompts)
        parts = [(torch.tensor(g, device=self.device), *self._prefill_padded([prompts[i] for i in g]))
                 for g in groups]
        n, L = len(prompts), max(map(len, prompts))
        logits = parts[0][1].new_empty((n, parts[0][1].shape[-1]))  # [n, V]
        valid = torch.zeros((n, L), dtype=torch.bool, device=self.device)  # [n, L]
        next_pos = torch.empty(n, dtype=torch.long, device=self.device)  # [n]
        last_tok = torch.empty(n, dtype=torch.long, device=self.device)  # [n]
        for rows, lg, b in parts:
            logits[rows] = lg
            valid[rows, L - b.length:] = b.valid
            next_pos[rows] = b.next_pos
            last_tok[rows] = b.last_tok
        cache = BatchKVCache.stack([(rows, b.cache) for rows, _, b in parts], n)
        return logits, Batch(cache, valid, next_pos, last_tok)

    @torch.inference_mode()
    def prompt_log_probs(self, ids: list[int]) -> list[float]:
        """``log p(ids[t] | ids[:t])`` for ``t = 1..len(ids)-1`` from one forward over ``ids``, from
        the raw logits (temperature 1), as SGLang computes ``input_token_logprobs``. A teacher
        scores a student's samples with these (``max_new_tokens: 0``); no cache is kept."""
        L, dev = len(ids), self.device
        x = torch.tensor([ids], dtype=torch.long, device=dev)  # [1, L]
        pos = torch.arange(L, device=dev)[None]  # [1, L]
        mask = torch.ones((L, L), dtype=torch.bool, device=dev).tril()[None, None]  # [1, 1, L, L]
        cache = BatchKVCache(self.num_layers)
        cache.begin(L, self.context_length)
        with self._attention():
            if self.native is not None:
                logits = self.native.forward(x, pos, mask, cache, last_only=False)[0]  # [L, V]
            else:
                with self._kernels():
                    logits = self.model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=True,
                                        **{self._cache_kw: cache}).logits[0]  # [L, V]
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)  # [L-1, V]
        return logp.gather(-1, x[0, 1:, None])[:, 0].tolist()

    def length_groups(self, lens: list[int]) -> list[list[int]]:
        """Split prompt indices into prefill forwards: contiguous runs of the lengths sorted,
        minimising the sum over forwards of max(padded tokens, PREFILL_MIN_TOKENS) +
        ``split_cost_tokens`` (exact, O(u^2) over the u distinct lengths). One group on an
        accelerator."""
        if self.split_cost_tokens is None or len(set(lens)) < 2:
            return [list(range(len(lens)))]
        order = sorted(range(len(lens)), key=lens.__getitem__)
        uniq = sorted(set(lens))
        count = [0] * (len(uniq) + 1)  # count[j]: prompts no longer than uniq[j - 1]
        for i, u in enumerate(uniq):
            count[i + 1] = count[i] + lens.count(u)
        best = [0.0] + [float("inf")] * len(uniq)  # best[j]: cost of the j shortest distinct lengths
        cut = [0] * (len(uniq) + 1)
        for j in range(1, len(uniq) + 1):
            for i in range(j):  # the last forward holds the lengths uniq[i..j-1]
                c = best[i] + max((count[j] - count[i]) * uniq[j - 1], self.PREFILL_MIN_TOKENS) + self.split_cost_tokens
                if c < best[j]:
                    best[j], cut[j] = c, i
        bounds, j = [], len(uniq)
        while j:
            bounds.append((count[cut[j]], count[j]))
            j = cut[j]
        return [order[a:b] for a, b in reversed(bounds)]

    def _prefill_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, Batch]:
        """Run the prompts (left-padded) in one forward. Returns (last logits [n, V], batch)."""
        n, L = len(prompts), max(map(len, prompts))
        dev = self.device
        lens = torch.tensor([len(p) for p in prompts], device=dev)  # [n]
        ids = torch.zeros((n, L), dtype=torch.long, device=dev)  # [n, L]
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
        col = torch.arange(L, device=dev)  # [L]
        pad = (L - lens)[:, None]  # [n, 1]
        valid = col[None, :] >= pad  # [n, L]
        pos = (col[None, :] - pad).clamp_min(0)  # [n, L]
        causal = torch.ones((L, L), dtype=torch.bool, device=dev).tril()  # [L, L]
        # pad queries attend to themselves only, so no softmax row is empty (that would give NaN)
        mask = (causal[None] & valid[:, None, :]) | torch.eye(L, dtype=torch.bool, device=dev)[None]  # [n, L, L]
        cache = BatchKVCache(self.num_layers)
        cache.begin(L, self.context_length)
        with self._attention():
            if self.native is not None:
                logits = self.native.forward(ids, pos, mask[:, None], cache, last_only=True)[:, -1]  # [n, V]
            else:
                with self._kernels():
                    out = self.model(input_ids=ids, attention_mask=mask[:, None], position_ids=pos, use_cache=True,
                                     logits_to_keep=1, **{self._cache_kw: cache})
                logits = out.logits[:, -1]  # [n, V]
        cache.commit()
        return logits, Batch(cache, valid, lens.clone(), ids[:, -1].clone())

    @torch.inference_mode()
    def decode(self, batch: Batch) -> torch.Tensor:
        """Feed ``batch.last_tok`` for every row; returns logits ``[B, V]`` (batch updated in place)."""
        B = batch.size
        batch.valid = torch.cat([batch.valid, torch.ones((B, 1), dtype=torch.bool, device=self.device)], 1)  # [B, T+1]
        batch.cache.begin(1, self.context_length + 16)
        ids, mask, pos = batch.last_tok[:, None], batch.valid[:, None, None, :], batch.next_pos[:, None]
        with self._attention():
            if self.native is not None:
                logits = self.native.forward(ids, pos, mask, batch.cache, last_only=True)[:, -1]  # [B, V]
            else:
                with self._kernels():
                    out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                     **{self._cache_kw: batch.cache})
                logits = out.logits[:, -1]  # [B, V]
        batch.cache.commit()
        batch.next_pos += 1
        return logits

    # --- batch membership -------------------------------------------------------------------
    @staticmethod
    def select(batch: Batch, rows: torch.Tensor) -> Batch:
        """Keep ``rows`` (``[n]`` long), dropping leading columns none of them uses."""
        valid = batch.valid[rows]  # [n, T]
        trim = _first_used_column(valid)
        return Batch(batch.cache.select(rows, trim), valid[:, trim:], batch.next_pos[rows], batch.last_tok[rows])

    @staticmethod
    def merge(running: Batch | None, rows: torch.Tensor | None, new: Batch) -> Batch:
        """Rows ``rows`` of the running batch followed by the new batch."""
        if running is None or rows is None or rows.numel() == 0:
            return new
        va = running.valid[rows]  # [na, Ta]
        trim = _first_used_column(va)
        va = va[:, trim:]
        T = max(va.shape[1], new.length)
        valid = torch.cat([_left_pad(va, T), _left_pad(new.valid, T)], 0)  # [na + nb, T]
        cache = BatchKVCache.merge(running.cache, rows, trim, new.cache)
        return Batch(cache, valid, torch.cat([running.next_pos[rows], new.next_pos]),
                     torch.cat([running.last_tok[rows], new.last_tok]))


class PackedLinears:
    """oneDNN-prepacked weights for the model's larger ``nn.Linear`` layers (CPU, float32).

    On CPU, transformers' linear layers call MKL's sgemm on the ``[out, in]`` weight as stored;
    oneDNN's matmul on a weight reordered once into its blocked layout does the same product
    20-60% faster for 8..512 rows (1 thread; bench/NOTES.md "engine"), and the linears are
    ~85% of a decode step. Results differ from MKL's only by float32 round-off (~1e-6 relative).
    Where it does not pay, the layer keeps ``F.linear``: small layers (a toy model's 64x256
    matmuls: oneDNN's per-call overhead exceeds the product) and inputs of fewer than
    ``MIN_ROWS`` rows (a memory-bound GEMV: no faster, measured a little slower end to end).
    The packed copies cost as much memory as the packed layers' weights.

    Each patched layer uses its packed weight only inside ``active()`` (the engine's forwards);
    anything else calling the model gets transformers' own path. A packed weight is keyed on the
    parameter's storage address and version counter: every weight update the engine makes
    (``copy_``/``_foreach_copy_`` into the parameter, or a new ``.data``) changes the key, and the
    layer repacks at its next forward. Only the layers that changed are repacked.
    """

    MIN_WEIGHT_ELEMENTS = 1 << 18  # in * out: 512 x 512 and up
    MIN_ROWS = 4  # tokens in the forward
    # batch-size hint for oneDNN's weight layout: a decode batch; measured within noise of the
    # best hint for M = 1..512
    BATCH_HINT = 64

    def __init__(self, layers: list[torch.nn.Linear]):
        self._layers = layers
        hint = self.BATCH_HINT
        # id(layer) -> its packed weight, rebuilt when the weight is written or replaced
        self._packed = {id(layer): DerivedTensor(lambda layer=layer: [layer.weight],
                                                 lambda ts: torch.ops.mkldnn._reorder_linear_weight(ts[0], hint))
                        for layer in layers}
        self._on = False
        for layer in layers:
            layer.forward = self._forward_of(layer)  # instance attribute: nn.Module.__call__ uses it

    @classmethod
    def usable(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether oneDNN's packed matmul applies here (CPU, float32, and this torch build has it)."""
        if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return False
        if not (hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        try:  # a torch build whose oneDNN lacks the op fails here, once, not in a request
            probe = torch.nn.Linear(4, 3)
            packed = torch.ops.mkldnn._reorder_linear_weight(probe.weight.detach(), cls.BATCH_HINT)
            x = torch.randn(2, 4)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, probe.bias.detach(), "none", [], "")
            if not torch.allclose(got, probe(x), atol=1e-5):
                raise RuntimeError("packed linear disagrees with F.linear")
        except (RuntimeError, NotImplementedError) as e:
            log.warning("oneDNN packed linears unavailable (%s); using plain linears", e)
            return False
        return True

    @classmethod
    def spec(cls) -> PackSpec:
        """These thresholds, for the native forward's own packed weights."""
        return PackSpec(cls.MIN_WEIGHT_ELEMENTS, cls.MIN_ROWS, cls.BATCH_HINT)

    @classmethod
    def for_model(cls, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> "PackedLinears | None":
        """Patch ``model``'s linear layers when oneDNN's packed matmul applies (CPU, float32)."""
        layers = [m for m in model.modules()
                  if type(m) is torch.nn.Linear and m.weight.numel() >= cls.MIN_WEIGHT_ELEMENTS]
        if not layers or not cls.usable(device, dtype):
            return None
        self = cls(layers)
        with torch.inference_mode():
            for layer in layers:  # pack now, so that the first request does not pay for it
                self._weight(layer)
        return self

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def _weight(self, layer: torch.nn.Linear) -> torch.Tensor:
        return self._packed[id(layer)].get()

    def _forward_of(self, layer: torch.nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not self._on or x.dtype != torch.float32 or x.numel() < self.MIN_ROWS * x.shape[-1]:
                return F.linear(x, layer.weight, layer.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self._weight(layer), layer.bias, "none", [], "")
        return forward


def _first_used_column(valid: torch.Tensor) -> int:
    used = valid.any(0)  # [T]
    return int(used.to(torch.int8).argmax()) if bool(used.any()) else valid.shape[1]


def _left_pad(valid: torch.Tensor, T: int) -> torch.Tensor:
    n, t = valid.shape
    if t == T:
        return valid
    return torch.cat([torch.zeros((n, T - t), dtype=torch.bool, device=valid.device), valid], 1)  # [n, T]
