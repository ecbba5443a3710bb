"""A compact decoder-only transformer for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3).

Parameter names mirror transformers' (`model.layers.{i}.self_attn.q_proj.weight`, ...), so HF safetensors load
directly and heads built from `DecoderLayer` export under the names serving engines expect. Numerics follow
transformers: RMSNorm in fp32, rotary tables in fp32 cast to the activation dtype, SDPA attention.

Every forward takes the flat concatenation of the batch's new tokens (`[num_tokens]`) and a `BatchInfo`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.runtime.attention import AttentionBackend, BatchInfo, TorchAttention
from mtp_train.runtime.config import ModelConfig
from mtp_train.runtime.kv_cache import KVCache, PageAllocator

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary positions; inverse frequencies come from transformers' rope init functions,
    so every rope-scaling variant (llama3, linear, yarn, longrope) matches it exactly."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = config.hf_config
        if config.rope_type == "default":
            params = getattr(hf, "rope_parameters", None) or {}
            base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            dim = config.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[config.rope_type](hf, "cpu")
        # A plain attribute, not a buffer: `module.to(bfloat16)` must not round the frequencies.
        self.inv_freq = inv_freq.float()
        self._cache: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # CPU cos/sin tables by dtype

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_tokens, head_dim] computed for `positions` (the definition `forward` caches)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [num_tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_tokens, head_dim] at `positions`. On the CPU, rows of a table of positions 0..L-1 (L a power
        of two, grown on demand) kept per dtype: a decode step reads two rows instead of running the eight small ops
        of `tables` (each row is computed by the same elementwise ops either way). Elsewhere computed each time (the
        table's size check would wait for the device)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        if positions.device.type != "cpu" or positions.numel() == 0:
            return self.tables(positions, dtype)
        cos, sin = self.cpu_tables(dtype, int(positions.max()) + 1)
        return cos[positions], sin[positions]

    def cpu_tables(self, dtype: torch.dtype, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU tables [L, head_dim] of positions 0..L-1 (L ≥ `needed`, a power of two ≥ 256) in `dtype`, grown
        on demand and kept: what `forward` reads rows of, and what the CPU decode kernels take whole."""
        cached = self._cache.get(dtype)
        if cached is None or cached[0].shape[0] < needed:
            cached = self._cache[dtype] = self.tables(torch.arange(max(256, 1 << (needed - 1).bit_length())), dtype)
        return cached


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = config.sliding_window
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, batch: BatchInfo, layer_cache, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.attend(q, k, v, layer_cache, batch, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=config.mlp_bias)
        self.up_proj = nn.Linear(hidden, inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=config.mlp_bias)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block. `use_input_norm=False` drops input_layernorm (the EAGLE-1 head's first layer)."""

    def __init__(self, config: ModelConfig, use_input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if use_input_norm else None
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, batch: BatchInfo, layer_cache, backend: AttentionBackend) -> torch.Tensor:
        attn_in = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(attn_in, cos, sin, batch, layer_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLayers(nn.ModuleList):
    """A model's decoder layers (`layers.{i}.*`), run in order by calling the list."""

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: BatchInfo, kv_cache: KVCache | None,
                backend: AttentionBackend, aux_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x [T, hidden] through the layers at the rotary positions of `batch` -> (the last layer's output, {layer id:
        output} for the ids in `aux_layers`)."""
        cos, sin = rotary(batch.positions, x.dtype)
        aux_hidden: dict[int, torch.Tensor] = {}
        for layer_id, layer in enumerate(self):
            layer_cache = kv_cache.layers[layer_id] if kv_cache is not None else None
            x = layer(x, cos, sin, batch, layer_cache, backend)
            if layer_id in aux_layers:
                aux_hidden[layer_id] = x
        return x, aux_hidden


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [num_selected, vocab] fp32, rows chosen by `logits_indices` (all rows if None)
    hidden: torch.Tensor | None  # [num_tokens, hidden]: last layer output after the final norm (what lm_head reads)
    aux_hidden: dict[int, torch.Tensor]  # layer id -> [num_tokens, hidden]: output of decoder layer j (0-based)


class TransformerBody(nn.Module):
    """`model.*` in HF naming: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = DecoderLayers(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    body_class = TransformerBody  # `model.*`; another family's module (runtime/deepseek.py) sets its own

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None):
        super().__init__()
        self.config = config
        self.model = self.body_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        with torch.device("cpu"):  # real tables even when the weights are built on the meta device
            self.rotary = RotaryEmbedding(config)
        self.backend = backend or TorchAttention()
        self.source_dir: str | None = None  # set by the loader; names the checkpoint for fingerprints
        self._fingerprint: str | None = None
        self.kv_cache_dtype: torch.dtype | None = None  # the paged K/V cache's dtype (None: the model's); the loader
        # sets it from `Precision.kv_cache_dtype`

    @property
    def fingerprint(self) -> str | None:
        """The target fingerprint (config + weights hash) of the directory this model was loaded from."""
        if self._fingerprint is None and self.source_dir is not None:
            from mtp_train.fingerprint import target_fingerprint

            self._fingerprint = target_fingerprint(self.source_dir)
        return self._fingerprint

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def prefill_flops(self, lengths: list[int], logits_rows: int = 0) -> float:
        """Multiply-add FLOPs (2 per MAC) of one prefill over sequences of `lengths` (causal attention over each
        sequence), plus `logits_rows` rows of the lm_head: the figure a fraction of the matmul peak is computed from."""
        c = self.config
        layer_params = sum(p.numel() for p in self.model.layers[0].parameters() if p.dim() == 2)
        tokens = sum(lengths)
        attention_pairs = sum(n * (n + 1) // 2 for n in lengths)  # (query, key) pairs under the causal mask
        attention = 4 * c.num_attention_heads * c.head_dim * attention_pairs  # QK^T and PV
        return float(c.num_hidden_layers * (2 * layer_params * tokens + attention)
                     + 2 * c.hidden_size * c.vocab_size * logits_rows)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The dtype `new_kv_cache` holds keys and values in: `kv_cache_dtype` (set by the loader from
        `Precision.kv_cache_dtype`), else the model's dtype."""
        return self.kv_cache_dtype or self.dtype

    def new_kv_cache(self, allocator: PageAllocator) -> KVCache:
        """The paged K/V cache, in `kv_cache_torch_dtype`."""
        c = self.config
        return KVCache(allocator, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.kv_cache_torch_dtype,
                       self.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] post-norm states -> [n, vocab] fp32 logits."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        batch: BatchInfo,
        kv_cache: KVCache | None = None,
        logits_indices: torch.Tensor | None = None,
        compute_logits: bool = True,
        return_hidden: bool = False,
        aux_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        x, aux_hidden = self.model.layers(x, self.rotary, batch, kv_cache, self.backend, aux_layers)
        hidden = self.model.norm(x)
        logits = None
        if compute_logits:
            selected = hidden if logits_indices is None else hidden[logits_indices]
            logits = self.compute_logits(selected)
        return ForwardOutput(logits=logits, hidden=hidden if return_hidden else None, aux_hidden=aux_hidden)
