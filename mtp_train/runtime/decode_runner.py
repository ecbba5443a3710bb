"""The decode path: how a frozen target or draft head computes its few-row forwards (decode steps, verify of k + 1
tokens, draft steps) in the decode dtype through the CPU decode kernels, applied from outside the models.

The models (`runtime/model.py`, `heads/`) hold weights and a forward only. `apply_decode_path` transforms a loaded
model as weight-only quantization is applied elsewhere (gpt-fast, torchao): it replaces modules by instances of the
classes below, which hold the same parameters under the same names (the state dict and exports are unchanged) plus
their decode copies, and no class is rewritten:

- each Llama-family `DecoderLayer` (fp32 weights, kernels loaded) by a `KernelDecoderLayer`, and each list of them by a
  `KernelDecoderLayers` that runs the whole list in one kernel call (`cpu_decode.DecodeStack`) when it can;
- every other `nn.Linear` by a `DecodeLinear` (few rows: its `SmallRowLinear` copy in the decode dtype; many rows on
  the CPU: the fp32 weight prepacked for oneDNN), every other `RMSNorm` by a `DecodeRMSNorm` (the kernel's norm).

A draft head's output projection (the lm_head rows of its draft vocabulary, not a module) and its one-call forwards
(the MTP input projection, the whole draft step with its logits, the greedy chain) belong to a `HeadRunner`, what the
speculative proposers draft through (`head_runner` builds it; a bare head gets a plain one).

`apply_decode_weights` and `head_runner` choose the decode dtype and row limit from a resolved `Precision`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.errors import UserError
from mtp_train.runtime import cpu_decode
from mtp_train.runtime.attention import AttentionBackend, BatchInfo
from mtp_train.runtime.cpu_decode import (
    EXACT_VERIFY_ROWS,
    KERNEL_MAX_ROWS,
    DecodeHeadForward,
    DecodeMTPInput,
    DecoderLayerKernel,
    DecodeStack,
    ManyRowLinear,
    SmallRowLinear,
)
from mtp_train.runtime.kernels import cpu_kernels, unavailable_reason
from mtp_train.runtime.kv_cache import KVCache, PageAllocator
from mtp_train.runtime.model import DecoderLayer, DecoderLayers, RMSNorm, RotaryEmbedding
from mtp_train.runtime.precision import DECODE_ONLY_DTYPES, Precision


def _without_autograd(x: torch.Tensor) -> bool:
    return not (torch.is_grad_enabled() and x.requires_grad)


class DecodeLinear(nn.Linear):
    """An `nn.Linear`'s parameters (the same tensors, the same names) whose calls with at most `small.max_rows` rows
    (outside autograd) read `small`, the weight in the decode dtype; bigger inputs read `many` (the fp32 weight
    prepacked, on the CPU) when set, else the weight itself."""

    def __init__(self, linear: nn.Linear, small: SmallRowLinear, many: ManyRowLinear | None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.small, self.many = small, many

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if not _without_autograd(x):
            return F.linear(x, self.weight, self.bias)
        if rows > self.small.max_rows:
            if self.many is not None and x.dtype == torch.float32:
                return self.many(x.reshape(rows, x.shape[-1])).view(*x.shape[:-1], self.out_features)
            return F.linear(x, self.weight, self.bias)
        return self.small(x)


class DecodeRMSNorm(RMSNorm):
    """An `RMSNorm`'s weight whose fp32 calls of at most `max_rows` rows (outside autograd) run the kernel's
    `rms_norm` (one call instead of eight small ops, rows computed independently as in the decoder layers' kernels):
    the norms outside the decoder layers, which run once per decode or draft step."""

    def __init__(self, norm: RMSNorm, ops, max_rows: int):
        nn.Module.__init__(self)
        self.weight, self.eps = norm.weight, norm.eps
        self.ops, self.max_rows = ops, max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= self.max_rows
                and self.weight.dtype == torch.float32 and _without_autograd(x)):
            return self.ops.rms_norm(x.contiguous(), self.weight.detach(), self.eps)
        return super().forward(x)


class KernelDecoderLayer(DecoderLayer):
    """A `DecoderLayer`'s modules (shared, same names) whose cached forwards of a few rows per sequence run its
    `DecoderLayerKernel`; every other forward is the layer's own."""

    def __init__(self, layer: DecoderLayer, kernel: DecoderLayerKernel):
        nn.Module.__init__(self)
        self.input_layernorm = layer.input_layernorm
        self.self_attn, self.post_attention_layernorm, self.mlp = layer.self_attn, layer.post_attention_layernorm, \
            layer.mlp
        self.kernel = kernel

    def forward(self, x, cos, sin, batch: BatchInfo, layer_cache, backend: AttentionBackend) -> torch.Tensor:
        if layer_cache is not None and self.kernel.serves(batch):
            return self.kernel(x, cos, sin, batch, layer_cache)
        return super().forward(x, cos, sin, batch, layer_cache, backend)


class KernelDecoderLayers(DecoderLayers):
    """A list of `KernelDecoderLayer`s whose forwards every layer's kernel would take run in one kernel call
    (`DecodeStack`: the same seven kernel calls per layer, made from C++, bit-identical rows); the others layer by
    layer. `stack` is None under tensor parallelism or when the layers' attention shapes differ."""

    def __init__(self, layers: DecoderLayers, stack: DecodeStack | None):
        super().__init__(layers)
        self.stack = stack

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: BatchInfo, kv_cache: KVCache | None,
                backend: AttentionBackend, aux_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if self.stack is not None and kv_cache is not None and self.stack.serves(x, batch):
            cos, sin = rotary.cpu_tables(x.dtype, max(batch.kv_lens))  # the kernel reads the batch's rows
            return self.stack(x, cos, sin, batch, kv_cache, tuple(j for j in aux_layers if j < len(self)))
        return super().forward(x, rotary, batch, kv_cache, backend, aux_layers)


def _replace_modules(model: nn.Module, replacement) -> None:
    """Every submodule `m` of `model` for which `replacement(m)` is not None is replaced by it, in place (the module
    tree's names are unchanged)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)


def apply_decode_path(model: nn.Module, dtype: torch.dtype, max_rows: int) -> nn.Module:
    """Give `model` (a frozen target or head) its decode path, for inputs of at most `max_rows` rows in `dtype`:
    supported `DecoderLayer`s their kernels (when the kernels are loaded, the weights fp32 and on the CPU), every
    other `RMSNorm` the kernel's norm and every other `nn.Linear` a `SmallRowLinear` copy of its weight in `dtype`
    (see the module docstring). Parameter names and the state dict are unchanged; tied weights share one copy."""
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    ops = cpu_kernels() if on_cpu else None
    if ops is None and dtype == next(model.parameters()).dtype:
        return model  # no kernels and no second weight copy: the model's own path is the decode path
    if ops is not None:
        _replace_modules(model, lambda m: KernelDecoderLayer(m, DecoderLayerKernel(m, dtype, max_rows, ops))
                         if type(m) is DecoderLayer and m.self_attn.q_proj.weight.dtype == torch.float32
                         and DecoderLayerKernel.supports(m) else None)
        _replace_modules(model, lambda m: KernelDecoderLayers(m, DecodeStack.build(
            [layer.kernel if isinstance(layer, KernelDecoderLayer) else None for layer in m]))
            if type(m) is DecoderLayers and any(isinstance(layer, KernelDecoderLayer) for layer in m) else None)
    covered = {id(sub) for m in model.modules() if isinstance(m, KernelDecoderLayer) for sub in m.modules()}
    if ops is not None:
        _replace_modules(model, lambda m: DecodeRMSNorm(m, ops, max_rows)
                         if type(m) is RMSNorm and id(m) not in covered else None)
    copies: dict[int, SmallRowLinear] = {}

    def decode_linear(module: nn.Module) -> DecodeLinear | None:
        if type(module) is not nn.Linear or id(module) in covered:
            return None
        key = id(module.weight)
        if key not in copies:
            copies[key] = SmallRowLinear(module.weight, module.bias, dtype, max_rows)
        many = ManyRowLinear([module], dtype) if on_cpu and module.weight.dtype == torch.float32 else None
        return DecodeLinear(module, copies[key], many)

    _replace_modules(model, decode_linear)
    return model


def _decode_settings(precision: Precision) -> tuple[torch.dtype, int]:
    """(decode dtype, row limit) of `precision`'s decode path. Without a separate decode dtype the kernels still
    serve up to `KERNEL_MAX_ROWS` rows on the CPU (fused layers, weights in the compute dtype)."""
    if not precision.split:
        return precision.torch_dtype, KERNEL_MAX_ROWS
    rows = precision.decode_max_rows
    native_bf16_gemms = precision.decode_dtype == "bfloat16" and cpu_decode._native_bf16()
    if precision.decode_dtype in DECODE_ONLY_DTYPES or native_bf16_gemms:
        # Above `rows` this CPU runs bf16 GEMMs (`ManyRowLinear`) or fp32 ones (int8 decode weights), whose rounding
        # differs from the kernels': a verify or a draft tree of more rows than a decode step would see other logits
        # than the decode steps it replaces, and greedy speculative output would part from plain greedy at near-ties.
        # The kernels keep serving up to EXACT_VERIFY_ROWS rows (a verify of k + 1 tokens for up to 8 sequences, a
        # tree of up to 31 nodes); docs/benchmarks.md has the measurements.
        rows = max(rows, EXACT_VERIFY_ROWS)
    return precision.decode_torch_dtype, rows


def apply_decode_weights(model: nn.Module, precision: Precision) -> nn.Module:
    """`apply_decode_path` with the decode dtype and row limit of `precision`: forwards of at most
    `precision.decode_max_rows` rows read weights in `precision.decode_dtype`."""
    return apply_decode_path(model, *_decode_settings(precision))


class HeadRunner:
    """A draft head as the speculative proposers run it: its cached forwards, its logits and, on the CPU decode path,
    the one-call forms of both. `HeadRunner(head, dtype, max_rows)` gives the head its decode path
    (`apply_decode_path`) and builds the output projection's decode copy and the one-call forwards; `head_runner`
    picks dtype and rows from a `Precision`; `HeadRunner(head)` runs the head's own forward and logits."""

    def __init__(self, head: nn.Module, dtype: torch.dtype | None = None, max_rows: int = 0,
                 decode_weights: str | None = None):
        self.head = head
        self.decode_weights = decode_weights  # the name of the weights its draft steps read (reports)
        self.projection: SmallRowLinear | None = None  # the output projection's decode copy (few-row logits)
        self.projection_key: tuple = ()
        self.mtp_input: DecodeMTPInput | None = None
        self.fused: DecodeHeadForward | None = None
        if dtype is None:
            return
        apply_decode_path(head, dtype, max_rows)
        on_cpu = all(p.device.type == "cpu" for p in head.parameters())
        ops = cpu_kernels() if on_cpu else None
        if ops is None and dtype == next(head.parameters()).dtype:
            return  # no kernels and no second weight copy: the head's own logits (as `apply_decode_path`)
        self.projection = SmallRowLinear(head.draft_weight, None, dtype, max_rows)
        self.projection_key = head.draft_weight_key()
        input_projection = getattr(getattr(head, "eh_proj", None), "small", None)
        if ops is None or not getattr(head, "is_mtp", False) or input_projection is None:
            return
        self.mtp_input = DecodeMTPInput(ops, input_projection)
        self.fused = DecodeHeadForward.build(head, getattr(head.layers, "stack", None), input_projection,
                                             self.projection, self.projection_key)

    # what the proposers and reports read of the head
    @property
    def config(self):
        return self.head.config

    @property
    def kind(self) -> str:
        return self.head.kind

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.aux_layers

    @property
    def draft_ids(self) -> torch.Tensor | None:
        return self.head.draft_ids

    def new_kv_cache(self, allocator: PageAllocator) -> KVCache:
        return self.head.new_kv_cache(allocator)

    def __call__(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: BatchInfo, kv_cache: KVCache
                 ) -> torch.Tensor:
        """The head's cached forward: token ids [T], states [T, d] -> its output [T, d] (`DraftHead.forward`), the
        MTP input rows in one kernel call where that serves them."""
        if self.mtp_input is None:
            return self.head(token_ids, hidden, batch, kv_cache)
        with torch.inference_mode():
            x = self.mtp_input(self.head, token_ids, hidden)
            if x is None:
                x = self.head.input_rows(token_ids, hidden)
            return self.head.run_layers(x, batch, kv_cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[n, d] head outputs -> [n, N] fp32 logits over the draft vocabulary (`DraftHead.logits`), through the
        output projection's decode copy for at most its row limit while the lm_head and draft vocabulary are those
        it was made from."""
        projection = self.projection
        if (projection is not None and out.shape[0] <= projection.max_rows and _without_autograd(out)
                and self.projection_key == self.head.draft_weight_key()):
            return projection(self.head.readout(out)).float()
        return self.head.logits(out)

    def forward_with_logits(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: BatchInfo, kv_cache: KVCache,
                            logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A cached forward (a draft step or a catch-up) and the logits of the rows `logits_rows` [R]: (the output
        [T, d], logits [R, N] fp32, their argmax [R]); one kernel call where the fused forward serves it,
        bit-identical to the two calls it replaces."""
        if self.fused is not None:
            result = _inference(self.fused, self.head, token_ids, hidden, batch, kv_cache, logits_rows)
            if result is not None:
                return result
        out = self(token_ids, hidden, batch, kv_cache)
        logits = self.logits(out[logits_rows])
        return out, logits, logits.argmax(-1)

    @property
    def chains_in_one_call(self) -> bool:
        """Whether `greedy_chain` can run (the fused forward is built); it may still decline a forward."""
        return self.fused is not None

    def greedy_chain(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: BatchInfo, kv_cache: KVCache,
                     num_drafts: int, target_ids: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A catch-up forward over rows token_ids [T], hidden [T, d] (`batch` covering num_drafts - 1 positions more,
        `reserve_ahead`) and the greedy draft chain after it, in one kernel call: (each sequence's output at its last
        row [B, d], that row's logits [B, N], the drafts [B, num_drafts] as target ids through `target_ids` [N] with a
        reduced draft vocabulary), the step-by-step chain's bit for bit. None where it does not serve this forward."""
        if self.fused is None:
            return None
        return _inference(self.fused.chain, self.head, token_ids, hidden, batch, kv_cache, num_drafts, target_ids)


def _inference(fn, *args):
    """`fn(*args)` under inference mode, entering it only where it is not on (the speculative loop already is, and
    each entry costs a few µs on a short draft step)."""
    if torch.is_inference_mode_enabled():
        return fn(*args)
    with torch.inference_mode():
        return fn(*args)


HEAD_DECODE_DTYPES = ("auto", "target", "int8")


def head_runner(head: nn.Module, precision: Precision, head_decode_dtype: str = "auto") -> HeadRunner:
    """A draft head's decode path and the runner its draft steps go through.

    `target`: the target's decode weights (`apply_decode_weights`). `int8`: weight-only int8 with one scale per
    output row (`cpu_decode.quantize_rows`) through the CPU decode kernels: a head step streams its layer, input
    projection and output projection in half the bytes of bf16; the target's verify stays exact, so the output
    distribution is unchanged (greedy output identical) and only the acceptance can move (docs/benchmarks.md). Refused
    where the kernels do not serve the head (no kernels, CUDA, a bf16/fp16 model). `auto`: int8 where the kernels
    serve the head, else `target`."""
    if head_decode_dtype not in HEAD_DECODE_DTYPES:
        raise UserError(f"precision.head_decode: {head_decode_dtype!r}; expected one of "
                        f"{', '.join(HEAD_DECODE_DTYPES)}")
    weight = next(head.parameters())
    kernels_serve = weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_kernels() is not None
    if head_decode_dtype == "int8" and not kernels_serve:
        why = (f"the CPU decode kernels are unavailable ({unavailable_reason()})" if cpu_kernels() is None
               else f"the head's weights are {weight.dtype} on {weight.device.type} (the kernels serve fp32 models on "
               "the CPU)")
        raise UserError(f"precision.head_decode: int8 runs through the CPU decode kernels, and {why}; use target")
    if head_decode_dtype == "target" or not kernels_serve:
        dtype, rows = _decode_settings(precision)
        name = precision.decode_dtype if precision.split else precision.dtype
    else:
        dtype, rows, name = torch.int8, max(precision.decode_max_rows, KERNEL_MAX_ROWS), "int8"
    return HeadRunner(head, dtype, rows, decode_weights=name)
