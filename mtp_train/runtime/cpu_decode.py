"""The CPU decode kernels' Python side: few-row forwards (decode steps, verify of k + 1 tokens, head draft steps)
through the `mtp_cpu` kernels. `runtime/decode_runner.py` applies them to a model from outside its definition.

A decode step on a CPU is memory-bound: each weight meets one to a few rows. torch's small-row matmuls stream the
weights far below the memory limit, and a decoder layer makes ~50 small ops between them (docs/benchmarks.md).
Here each Llama-family decoder layer gets a `DecoderLayerKernel`: its weights packed once in the decode dtype (q/k/v
fused, gate/up interleaved) and seven kernel calls per layer — RMSNorm, the fused QKV projection, RoPE + cache write +
paged attention in place, the output projection with the residual add, RMSNorm, gate/up with SiLU-and-multiply, the
down projection with the residual add; a model's whole list of layers runs those calls from C++ in one kernel call per
forward (`DecodeStack`). Every other linear (lm_head, a head's input projection) reads a `SmallRowLinear`: its weight in
the decode dtype, multiplied by the same kernel.

The kernels compute each output row independently, in the same order whatever the row count, so verifying k + 1
tokens gives bit-identical rows to k + 1 decode steps. Prefill (many rows) keeps the model's own path, except on a CPU
with native bf16 matmul and bf16 decode weights, where its linears run as bf16 GEMMs
(`DecoderLayerKernel.bf16_prefill`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.runtime.attention import BatchInfo, TorchAttention
from mtp_train.runtime.kernels import cpu_kernels
from mtp_train.runtime.model import DecoderLayer, apply_rotary

_TORCH_ATTENTION = TorchAttention()  # prefills, and tree masks the paged kernel cannot take (`_attend_torch`)
KERNEL_MAX_ROWS = 16  # the kernels read the weights once per 8 rows; above 16 rows torch's GEMMs win (measured)
EXACT_VERIFY_ROWS = 32  # bf16 decode weights on a native-bf16 CPU: the kernels serve up to this many rows, so that a
# verify or a draft tree computes its rows as decode steps do (see decode_runner.apply_decode_weights)
MAX_QUERY_PER_SEQUENCE = 16  # cached forwards whose sequences each bring at most this many tokens (decode, verify,
# draft steps) attend over the pages in place, whatever the batch size; longer ones (a cached prefill) keep the model's
# own attention


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8, symmetric, one fp32 scale per output row: [N, K] -> (int8 [N, K], scale [N]) with
    weight ≈ int8 * scale[:, None] (round to nearest; a row's largest magnitude maps to 127)."""
    weight = weight.detach().float()
    scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    quantized = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return quantized.contiguous(), scale.contiguous()


def decode_weight(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear's weight as the decode kernels read it: (weight in `dtype`, None), or for `torch.int8` the
    row-quantized weight and its per-row scales (`quantize_rows`)."""
    if dtype == torch.int8:
        return quantize_rows(weight)
    return weight.detach().to(dtype).contiguous(), None


class SmallRowLinear:
    """One linear's weight (and bias) in the decode dtype, for inputs of at most `max_rows` rows: through the
    kernel when it is loaded and the activations are fp32 (fp32 accumulation), else `F.linear` with the activations
    cast to the weight's dtype and the result cast back. Decode dtype `torch.int8`: weight-only int8 with a scale per
    output row (`quantize_rows`), the activations fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, max_rows: int):
        self.weight, self.scale = decode_weight(weight, dtype)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.max_rows = max_rows
        self.ops = cpu_kernels() if self.weight.device.type == "cpu" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.ops is not None and x.dtype == torch.float32:
            out = self.ops.linear(x.reshape(-1, shape[-1]).contiguous(), self.weight, self.bias, None, self.scale)
            return out.view(*shape[:-1], out.shape[-1])
        if self.scale is not None:  # int8 without the kernels: the dequantized weight, in fp32
            weight = self.weight.float() * self.scale[:, None]
            return F.linear(x.float(), weight, self.bias).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(self.weight.dtype)
        return F.linear(x.to(self.weight.dtype), self.weight, bias).to(x.dtype)


class ManyRowLinear:
    """One linear, or several concatenated along the outputs (q/k/v, gate/up), for forwards of more than
    `KERNEL_MAX_ROWS` rows of a frozen fp32 model on the CPU (decode and verify batches of many sequences): the fp32
    weight prepacked once for oneDNN's GEMM (`mkldnn._linear_pointwise`), on first use, so a batch-1 user never pays
    its memory (one more fp32 copy of the weights it covers): oneDNN's prepacked GEMM beats MKL's sgemm on the
    module's weight at these row counts (docs/benchmarks.md, "Figures behind the code's choices"). Without oneDNN,
    `F.linear` on the concatenated weight.

    With `dtype` bf16 (the decode dtype) on a CPU with native bf16 matmul (avx512_bf16, amx_bf16), the GEMMs run on a
    bf16 copy with bf16 activations (fp32 accumulation, the result widened back to fp32): twice the fp32 rate there,
    and a batched decode step at 32-64 rows is compute-bound; logits within bf16 rounding of fp32 (the numerics of a
    bf16 model)."""

    def __init__(self, linears: list[nn.Linear], dtype: torch.dtype = torch.float32):
        self.linears = linears
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.onednn = _ONEDNN  # prepacked for oneDNN (`_pack` may find its bf16 path unsupported: then F.linear)
        self.dtype = torch.bfloat16 if dtype == torch.bfloat16 and _native_bf16() else torch.float32

    def _pack(self) -> None:
        weight = torch.cat([linear.weight.detach() for linear in self.linears]).to(self.dtype).contiguous()
        biases = [linear.bias for linear in self.linears]
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach().float() if b is not None else torch.zeros(l.out_features)
                                   for b, l in zip(biases, self.linears)]).to(self.dtype)
        if self.onednn:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
                return
            except RuntimeError:  # oneDNN's bf16 GEMM needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: torch's own then
                self.onednn = False
        self.packed = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            self._pack()
        x = x.contiguous().to(self.dtype)
        if self.onednn:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            out = F.linear(x, self.packed, self.bias)
        return out.float()


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 GEMMs beat fp32 ones."""
    from mtp_train.runtime.hardware import cpu_facts

    return cpu_facts().native_bf16


class DecodeMTPInput:
    """An MTP head's input projection, eh_proj(cat(enorm(embed(t)), hnorm(h))), for at most `max_rows` rows of fp32
    states in one kernel call (`mtp_input`) instead of five ops: the rows of the kernel's RMSNorm and of the input
    projection's decode copy `small`, bit for bit. A head's draft step is short and follows a target forward that has
    pushed the interpreter's own data out of the caches, so each op it makes costs several times its warm price."""

    def __init__(self, ops, small: SmallRowLinear):
        self.ops, self.small, self.max_rows = ops, small, small.max_rows

    def __call__(self, head, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """[T] token ids, [T, d] states -> the input rows [T, d], or None where this does not serve them (not fp32,
        more than `max_rows` rows, a model off the CPU)."""
        embed, small = head.embed_weight, self.small
        if (hidden.dtype != torch.float32 or embed.dtype != torch.float32 or hidden.dim() != 2
                or hidden.shape[0] > self.max_rows or head.enorm.weight.dtype != torch.float32
                or not embed.is_contiguous() or small.ops is None):
            return None
        return self.ops.mtp_input(token_ids, hidden.contiguous(), embed, head.enorm.weight.detach(), head.enorm.eps,
                                  head.hnorm.weight.detach(), head.hnorm.eps, small.weight, small.bias, small.scale)


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[inter, K] gate and up weights -> [inter, 2 K], interleaved in chunks of 8 columns (gate[n, 0:8], up[n, 0:8],
    gate[n, 8:16], ...): one sequential stream per output for `linear_silu_mul`."""
    inter, k = gate.shape
    return torch.stack((gate.reshape(inter, k // 8, 8), up.reshape(inter, k // 8, 8)), dim=2).reshape(inter, 2 * k)


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()


class DecoderLayerKernel:
    """A decoder layer's few-row cached forward as seven kernel calls (see the module docstring)."""

    def __init__(self, layer: DecoderLayer, dtype: torch.dtype, max_rows: int, ops):
        attn, mlp = layer.self_attn, layer.mlp

        def weight(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:  # (weight, int8 row scales)
            return decode_weight(linear.weight, dtype)

        self.ops, self.max_rows = ops, max_rows
        # Tensor parallel (runtime/tensor_parallel.py): o_proj and down_proj hold this rank's input columns; their
        # partial outputs are summed over the group before the residual add.
        self.all_reduce = getattr(layer, "tensor_parallel_all_reduce", None)
        # Batches of more than `max_rows` rows: the layer's weights prepacked on first use (fp32; bf16 copies when the
        # decode dtype is bf16 on a CPU with native bf16, see ManyRowLinear).
        self.qkv_many = ManyRowLinear([attn.q_proj, attn.k_proj, attn.v_proj], dtype)
        self.o_many = ManyRowLinear([attn.o_proj], dtype)
        self.gate_up_many = ManyRowLinear([mlp.gate_proj, mlp.up_proj], dtype)
        self.down_many = ManyRowLinear([mlp.down_proj], dtype)
        self.num_heads, self.num_kv_heads, self.scale = attn.num_heads, attn.num_kv_heads, attn.scale
        self.window = attn.sliding_window or 0
        qkv = [weight(attn.q_proj), weight(attn.k_proj), weight(attn.v_proj)]
        self.qkv = torch.cat([w for w, _ in qkv]).contiguous()
        self.qkv_scale = None if qkv[0][1] is None else torch.cat([s for _, s in qkv])
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        self.qkv_bias = None if biases[0] is None else torch.cat([_float(b) for b in biases])
        (self.o, self.o_scale), self.o_bias = weight(attn.o_proj), _float(attn.o_proj.bias)
        (gate, gate_scale), (up, up_scale) = weight(mlp.gate_proj), weight(mlp.up_proj)
        self.gate_up = pack_gate_up(gate, up).contiguous()
        self.gate_up_scale = None if gate_scale is None else torch.stack((gate_scale, up_scale), dim=1).contiguous()
        self.gate_up_bias = None if mlp.gate_proj.bias is None else \
            torch.stack((_float(mlp.gate_proj.bias), _float(mlp.up_proj.bias)), dim=1).contiguous()  # [inter, 2]
        (self.down, self.down_scale), self.down_bias = weight(mlp.down_proj), _float(mlp.down_proj.bias)
        norm = layer.input_layernorm
        self.input_norm = None if norm is None else (_float(norm.weight), norm.eps)
        norm = layer.post_attention_layernorm
        self.post_norm = (_float(norm.weight), norm.eps)
        self.q_norm = None if attn.q_norm is None else _float(attn.q_norm.weight)
        self.k_norm = None if attn.k_norm is None else _float(attn.k_norm.weight)
        self.qk_eps = attn.q_norm.eps if attn.q_norm is not None else 1e-6

    @staticmethod
    def supports(layer: DecoderLayer) -> bool:
        """The layers the kernels cover: a SiLU MLP (every Llama-family model), hidden size a multiple of 8."""
        mlp, attn = layer.mlp, layer.self_attn
        return mlp.act is F.silu and mlp.gate_proj.in_features % 8 == 0 and attn.head_dim % 2 == 0

    @staticmethod
    def few_per_sequence(batch: BatchInfo) -> bool:
        """A cached forward whose sequences each bring a few tokens (decode, verify, draft steps, a draft tree): the
        paged kernel attends over the pages in place."""
        return batch.max_q_len <= MAX_QUERY_PER_SEQUENCE or batch.tree_masks is not None

    def serves(self, batch: BatchInfo) -> bool:
        """Whether this path computes `batch`: a cached forward whose sequences each bring a few tokens, or, on a CPU
        with native bf16 matmul and bf16 decode weights, any cached forward (a prompt's prefill: its linears as bf16
        GEMMs, see `_many_rows`)."""
        return batch.uses_cache and (self.few_per_sequence(batch) or self.bf16_prefill)

    @property
    def bf16_prefill(self) -> bool:
        """Prefills run their linears as bf16 GEMMs (`ManyRowLinear` on bf16 copies): on a native-bf16 CPU with bf16
        decode weights, twice the fp32 GEMM rate (docs/benchmarks.md)."""
        return self.qkv_many.dtype == torch.bfloat16

    def __call__(self, x: torch.Tensor, cos, sin, batch: BatchInfo, layer_cache) -> torch.Tensor:
        if not self.few_per_sequence(batch):  # a prefill (bf16_prefill): attention in torch over the cache
            return self._many_rows(x, cos, sin, batch, layer_cache, self._attend_torch)
        if x.shape[0] > self.max_rows:
            return self._many_rows(x, cos, sin, batch, layer_cache, self._attend)
        ops = self.ops
        x = x.contiguous()  # [T, hidden] fp32
        h = ops.rms_norm(x, *self.input_norm) if self.input_norm is not None else x
        qkv = ops.linear(h, self.qkv, self.qkv_bias, None, self.qkv_scale)  # [T, (heads + 2 kv_heads) * head_dim]
        attn = self._attend(qkv, cos, sin, batch, layer_cache)
        x = self._project_add(attn, self.o, self.o_bias, self.o_scale, x)  # + residual
        h = ops.rms_norm(x, *self.post_norm)
        mlp_hidden = ops.linear_silu_mul(h, self.gate_up, self.gate_up_bias, self.gate_up_scale)  # [T, intermediate]
        return self._project_add(mlp_hidden, self.down, self.down_bias, self.down_scale, x)  # + residual

    def stack_params(self) -> tuple[list[torch.Tensor | None], list[float]]:
        """This layer's tensors and epsilons in the order the kernel's `decode_layers` reads them (see there)."""
        input_norm, input_eps = self.input_norm if self.input_norm is not None else (None, 0.0)
        post_norm, post_eps = self.post_norm
        tensors = [input_norm, self.qkv, self.qkv_bias, self.o, self.o_bias, post_norm, self.gate_up, self.gate_up_bias,
                   self.down, self.down_bias, self.q_norm, self.k_norm,
                   self.qkv_scale, self.o_scale, self.gate_up_scale, self.down_scale]
        return tensors, [input_eps, post_eps, self.qk_eps]

    def _project_add(self, x: torch.Tensor, weight: torch.Tensor, bias, scale, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T + b, the residual fused into the kernel (`scale`: int8 weights' row scales, else None);
        under tensor parallelism the partial products are summed over the group first (the bias is held by one rank
        only)."""
        if self.all_reduce is None:
            return self.ops.linear(x, weight, bias, residual, scale)
        return residual + self.all_reduce(self.ops.linear(x, weight, bias, None, scale))

    def _attend(self, qkv: torch.Tensor, cos, sin, batch: BatchInfo, layer_cache) -> torch.Tensor:
        """RoPE (and q/k norms), the new K/V written to their slots, attention over each sequence's pages in place
        (nothing gathered): [T, (heads + 2 kv_heads) * head_dim] -> [T, heads * head_dim]."""
        tree_start = tree_keys = None
        if batch.tree_masks is not None:
            tables = tree_key_tables(batch)
            if tables is None:
                return self._attend_torch(qkv, cos, sin, batch, layer_cache)
            tree_start, tree_keys = tables
        k_cache, v_cache = layer_cache
        return self.ops.paged_attention(qkv, cos, sin, k_cache, v_cache, batch.slot_mapping, batch.positions,
                                        batch.qo_indptr, batch.kv_page_indptr, batch.kv_page_indices, self.num_heads,
                                        self.num_kv_heads, self.scale, self.window, self.q_norm, self.k_norm,
                                        self.qk_eps, tree_start, tree_keys)

    def _attend_torch(self, qkv: torch.Tensor, cos, sin, batch: BatchInfo, layer_cache) -> torch.Tensor:
        """The attention in torch (`TorchAttention`: the new K/V scattered into their slots, then causal attention,
        or the batch's tree mask, over each sequence's keys), the linears around it staying the kernels'. For a
        prefill, and for a draft tree's forward whose mask `tree_key_tables` cannot express (a node whose visible tree
        keys are not its path from the region's first key; its rows then differ from decode steps by rounding).
        [T, (heads + 2 kv_heads) * head_dim] -> [T, heads * head_dim]."""
        T, D = qkv.shape[0], cos.shape[-1]
        H, G = self.num_heads, self.num_kv_heads
        q, k, v = qkv.view(T, H + 2 * G, D).split([H, G, G], dim=1)

        def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # per head, the kernel's norm
            return self.ops.rms_norm(x.reshape(-1, D).contiguous(), weight, self.qk_eps).view(x.shape)

        if self.q_norm is not None:
            q, k = norm(q, self.q_norm), norm(k, self.k_norm)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = _TORCH_ATTENTION.attend(q, k, v.contiguous(), layer_cache, batch, self.scale, self.window or None)
        return out.reshape(T, H * D)

    def _many_rows(self, x: torch.Tensor, cos, sin, batch: BatchInfo, layer_cache, attend) -> torch.Tensor:
        """A decode or verify batch of many sequences, or a prefill: the linears are GEMMs on the layer's weights,
        prepacked (at this many rows compute, not the weight stream, is the limit, and the GEMMs beat the few-row
        kernel; bf16 copies on a native-bf16 CPU with bf16 decode weights), the attention `attend` (the in-place
        paged kernel above for few tokens per sequence, torch's for a prefill)."""
        ops = self.ops
        x = x.contiguous()  # [T, hidden] fp32
        h = ops.rms_norm(x, *self.input_norm) if self.input_norm is not None else x
        qkv = self.qkv_many(h)  # [T, (heads + 2 kv_heads) * head_dim]
        attn = attend(qkv, cos, sin, batch, layer_cache)  # [T, heads * head_dim]
        reduce = self.all_reduce or (lambda partial: partial)
        x = x + reduce(self.o_many(attn))
        h = ops.rms_norm(x, *self.post_norm)
        gate, up = self.gate_up_many(h).chunk(2, dim=-1)  # [T, intermediate] each
        return x + reduce(self.down_many(F.silu(gate).mul_(up)))


class DecodeStack:
    """A model's whole list of decoder layers, every one with a `DecoderLayerKernel`, run by one kernel call
    (`decode_layers`) for the forwards every layer's kernel path would take (a few rows, a few per sequence, the tree
    mask expressible): the same seven kernel calls per layer, made from C++, so its rows are bit-identical to the
    per-layer path, without ~7 op dispatches and the Python around them per layer (docs/benchmarks.md). Not built under
    tensor parallelism (the layers' partial sums are all-reduced from Python) or when the layers' head layout
    differs."""

    def __init__(self, kernels: list[DecoderLayerKernel]):
        first = kernels[0]
        self.ops, self.max_rows = first.ops, first.max_rows
        self.num_heads, self.num_kv_heads, self.scale = first.num_heads, first.num_kv_heads, first.scale
        self.params: list[torch.Tensor | None] = []
        self.eps: list[float] = []
        for kernel in kernels:
            tensors, eps = kernel.stack_params()
            self.params.extend(tensors)
            self.eps.extend(eps)
        self.windows = [kernel.window for kernel in kernels]

    @staticmethod
    def build(kernels: list[DecoderLayerKernel | None]) -> "DecodeStack | None":
        """The stack of a model's layer kernels (in order), or None when a layer has no kernel, any is
        tensor-parallel, or their attention shapes differ."""
        if not kernels or any(k is None or k.all_reduce is not None for k in kernels):
            return None
        shapes = {(k.num_heads, k.num_kv_heads, k.scale, k.max_rows) for k in kernels}
        return DecodeStack(kernels) if len(shapes) == 1 else None

    def serves(self, x: torch.Tensor, batch: BatchInfo) -> bool:
        """The forwards every layer's kernel computes in place: cached, at most `max_rows` rows, a few per sequence,
        and a tree mask (if any) the paged kernel takes."""
        return (batch.uses_cache and x.shape[0] <= self.max_rows and DecoderLayerKernel.few_per_sequence(batch)
                and (batch.tree_masks is None or tree_key_tables(batch) is not None))

    def __call__(self, x: torch.Tensor, cos, sin, batch: BatchInfo, kv_cache,
                 keep: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """[T, hidden] fp32 -> (the last layer's output [T, hidden], {layer id: its output} for the layers in
        `keep`). cos/sin: the rotary tables of positions 0..L-1 (`RotaryEmbedding.cpu_tables`; the kernel takes the
        batch's rows)."""
        tree_start, tree_keys = tree_key_tables(batch) if batch.tree_masks is not None else (None, None)
        keep = sorted(keep)
        outputs = self.ops.decode_layers(
            x, self.params, self.eps, [k for k, _ in kv_cache.layers], [v for _, v in kv_cache.layers], cos, sin,
            batch.slot_mapping, batch.positions, batch.qo_indptr, batch.kv_page_indptr, batch.kv_page_indices,
            self.num_heads, self.num_kv_heads, self.scale, self.windows, tree_start, tree_keys, keep)
        return outputs[0], dict(zip(keep, outputs[1:]))


class DecodeHeadForward:
    """An MTP head's whole few-row cached forward and its logits as one kernel call (`mtp_head_forward`): the input
    rows (`DecodeMTPInput`), the layers (`DecodeStack`), the final norm and the output projection's decode copy of the
    rows asked for, with their argmax, bit for bit what those paths compute call by call. A head's draft step or
    catch-up right after a target forward otherwise spends about as long in the Python around its ~10 kernel calls as
    in the kernels (see docs/benchmarks.md)."""

    def __init__(self, head, stack: DecodeStack, input_projection: SmallRowLinear, projection: SmallRowLinear,
                 projection_key: tuple):
        small = input_projection
        self.ops, self.max_rows = stack.ops, min(stack.max_rows, small.max_rows, projection.max_rows)
        self.stack, self.projection_key = stack, projection_key
        self.params: list[torch.Tensor | None] = [
            head.embed_weight, _float(head.enorm.weight), _float(head.hnorm.weight), small.weight, small.bias,
            small.scale, _float(head.norm.weight), projection.weight, projection.scale, *stack.params]
        self.eps = [head.enorm.eps, head.hnorm.eps, head.norm.eps, *stack.eps]

    @staticmethod
    def build(head, stack: DecodeStack | None, input_projection: SmallRowLinear | None,
              projection: SmallRowLinear | None, projection_key: tuple) -> "DecodeHeadForward | None":
        """The fused forward of an MTP `head` whose layers run as `stack`, its input projection's decode copy
        `input_projection` and its output projection's `projection` (made from the draft weight of `projection_key`),
        or None when a piece does not run on the kernels (no stack, weights not fp32, a projection off the kernels)."""
        if (stack is None or projection is None or projection.ops is None or input_projection is None
                or input_projection.ops is None or projection.bias is not None
                or head.embed_weight.dtype != torch.float32 or not head.embed_weight.is_contiguous()
                or head.enorm.weight.dtype != torch.float32):
            return None
        return DecodeHeadForward(head, stack, input_projection, projection, projection_key)

    def serves(self, head, hidden: torch.Tensor, batch: BatchInfo) -> bool:
        """Whether the one-call path takes this forward: fp32 states of at most `max_rows` rows, few per sequence, no
        tree mask, and the lm_head and draft vocabulary unchanged since it was built."""
        return (hidden.dtype == torch.float32 and hidden.dim() == 2 and hidden.shape[0] <= self.max_rows
                and batch.tree_masks is None and DecoderLayerKernel.few_per_sequence(batch)
                and head.draft_weight_key() == self.projection_key)

    def _arguments(self, head, token_ids: torch.Tensor, hidden: torch.Tensor, batch: BatchInfo, kv_cache,
                   positions_ahead: int = 0) -> list:
        stack = self.stack
        cos, sin = head.rotary.cpu_tables(torch.float32, max(batch.kv_lens) + positions_ahead)
        return [token_ids, hidden.contiguous(), self.params, self.eps, [k for k, _ in kv_cache.layers],
                [v for _, v in kv_cache.layers], cos, sin, batch.slot_mapping, batch.positions, batch.qo_indptr,
                batch.kv_page_indptr, batch.kv_page_indices, stack.num_heads, stack.num_kv_heads, stack.scale,
                stack.windows]

    def __call__(self, head, token_ids: torch.Tensor, hidden: torch.Tensor, batch: BatchInfo, kv_cache,
                 logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """[T] token ids, [T, d] fp32 states -> (the head's output [T, d], logits [R, N] of the rows `logits_rows`
        [R], their argmax [R]); None where this does not serve the forward (`serves`)."""
        if not self.serves(head, hidden, batch):
            return None
        return tuple(self.ops.mtp_head_forward(*self._arguments(head, token_ids, hidden, batch, kv_cache), logits_rows))

    def chain(self, head, token_ids: torch.Tensor, hidden: torch.Tensor, batch: BatchInfo, kv_cache,
              num_drafts: int, target_ids: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The greedy draft chain in one call (`mtp_head_chain`): this forward (a catch-up), then `num_drafts - 1`
        draft steps at the positions after each sequence's last row, whose pages `batch` must list
        (`BatchInfo.for_sequences(..., reserve_ahead=num_drafts - 1)`). Returns (each sequence's output at its last
        row [B, d], that row's logits [B, N], the drafts [B, num_drafts] as target ids, through `target_ids` [N] with a
        reduced draft vocabulary); None where this does not serve the forward."""
        if not self.serves(head, hidden, batch):
            return None
        return tuple(self.ops.mtp_head_chain(
            *self._arguments(head, token_ids, hidden, batch, kv_cache, num_drafts - 1), num_drafts, target_ids))


def tree_key_tables(batch: BatchInfo) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A tree batch's mask as the paged kernel takes it: per sequence the first position of its tree region
    (`tree_start` [B] int64), and per token the cache index of the key at each position from there to its own
    (`tree_keys` [T, width] int64: its ancestors and itself, in position order, -1 past it). None when a node's
    visible tree keys do not form its path from the region's first key (the torch attention then applies the mask).
    Computed once per batch, kept in the batch's per-backend plans (every layer shares it)."""
    if "cpu_tree_keys" in batch._plans:
        return batch._plans["cpu_tree_keys"]
    starts, rows = [], []
    positions = batch.positions.tolist()
    qo = batch.qo_indptr.tolist()
    for b, mask in enumerate(batch.tree_masks):
        width = int(mask.shape[1])
        start = batch.kv_lens[b] - width  # the region's first cache index: its first key's position
        starts.append(start)
        for r, allowed in enumerate(mask.tolist()):
            path = [start + j for j, seen in enumerate(allowed) if seen]
            if positions[qo[b] + r] != start + len(path) - 1:
                batch._plans["cpu_tree_keys"] = None
                return None
            rows.append(path)
    width = max(len(path) for path in rows)
    keys = torch.full((len(rows), width), -1, dtype=torch.long)
    for t, path in enumerate(rows):
        keys[t, :len(path)] = torch.tensor(path, dtype=torch.long)
    tables = (torch.tensor(starts, dtype=torch.long), keys)
    batch._plans["cpu_tree_keys"] = tables
    return tables
