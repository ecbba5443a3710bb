"""The EAGLE-3 head (`head.kind: eagle3`), laid out and computed as vLLM 0.32's `Eagle3LlamaForCausalLM`
(vllm/model_executor/models/llama_eagle3.py) builds it from a speculators `eagle3` checkpoint:

    step 1:   h = fc(cat(A_low, A_mid, A_high))          A_j [T, d]: output of target decoder layer j (aux_layers),
                                                         before the final norm (vLLM: hidden_states + residual)
    step k>1: h = the head's own previous output (pre-norm, vLLM's `hidden_prenorm`)
    midlayer: a = self_attn(cat(input_layernorm(embed(t)), hidden_norm(h)))   q/k/v read 2d inputs
              x = h + a                                  the residual is h itself (norm_before_residual: false)
              out = x + mlp(post_attention_layernorm(x))
    readout:  norm(out) -> the draft vocabulary's lm_head rows (d2t/t2d)

`forward` returns `out` (what the next step reads, as vLLM feeds it back); `readout`/`logits` apply the final norm.
The output projection is the target's lm_head rows of the draft vocabulary, frozen like the other kinds' (export
writes them as the checkpoint's own `lm_head.weight`). `forward` tells the two inputs apart by width: [T, 3d] is the
target's aux states (fused by `fc`), [T, d] a state the head made. Everything else (borrowed embeddings/lm_head,
draft vocabulary, KV cache, decode projection) is `DraftHead`'s, which this class extends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.heads.config import HeadConfig, eagle3_block_config
from mtp_train.heads.draft_head import DraftHead
from mtp_train.runtime.attention import AttentionBackend, BatchInfo
from mtp_train.runtime.config import ModelConfig
from mtp_train.runtime.frozen_parts import FrozenParts
from mtp_train.runtime.kv_cache import KVCache
from mtp_train.runtime.model import MLP, Attention, CausalLM, RMSNorm


class Eagle3Layer(nn.Module):
    """vLLM's EAGLE-3 `midlayer` (layer 0 of `Eagle3LlamaForCausalLM` / `Eagle3Qwen3ForCausalLM`): attention over
    cat(input_layernorm(embed), hidden_norm(h)) (q/k/v projections of width 2d), h as the residual, then the usual
    post-attention norm and MLP. `config` is the block's (`eagle3_block_config`: Llama-style, or Qwen3-style for a
    Qwen3 target). Parameter names are the checkpoint's (`midlayer.` there, `layers.0.` here)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)  # on embed(t)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)  # on h
        self.self_attn = Attention(config)
        attn = self.self_attn
        for name, heads in (("q_proj", attn.num_heads), ("k_proj", attn.num_kv_heads), ("v_proj", attn.num_kv_heads)):
            setattr(attn, name, nn.Linear(2 * d, heads * attn.head_dim, bias=config.attention_bias))
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos, sin, batch: BatchInfo, layer_cache,
                backend: AttentionBackend) -> torch.Tensor:
        """embeds, hidden [T, d] -> the pre-norm output [T, d]."""
        attn_in = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)  # [T, 2d]
        x = hidden + self.self_attn(attn_in, cos, sin, batch, layer_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(DraftHead):
    """An EAGLE-3 draft head over a target. Parameters `fc.weight` [d, 3d] (no bias), `layers.0.*` (the midlayer),
    `norm.weight`; buffers `d2t`, `t2d` with a reduced draft vocabulary."""

    def __init__(
        self,
        config: ModelConfig,
        head_config: HeadConfig,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
        backend: AttentionBackend | None = None,
    ):
        nn.Module.__init__(self)
        if head_config.kind != "eagle3":
            raise ValueError(f"Eagle3Head builds eagle3 heads, got kind {head_config.kind!r}")
        outside = [j for j in head_config.aux_layers if j >= config.num_hidden_layers]
        if outside:
            raise ValueError(f"aux_layers {outside} out of range for a target of {config.num_hidden_layers} layers")
        self._init_shared(config, head_config, embed_tokens, lm_head, backend)
        d = config.hidden_size
        self.is_mtp = False
        self.fc = nn.Linear(len(head_config.aux_layers) * d, d, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(eagle3_block_config(config))])
        self.norm = RMSNorm(d, config.rms_norm_eps)

    @property
    def fused_width(self) -> int:
        """Width of the target states `fc` reads: len(aux_layers) * d."""
        return self.fc.in_features

    def init_from_target(self, target: CausalLM | FrozenParts) -> None:
        raise ValueError("an eagle3 head has no init from the target's layers (HeadConfig refuses init last_layer)")

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        """The final norm: what the lm_head rows read from the pre-norm output `out` [n, d]."""
        return self.norm(out)

    def _forward(self, token_ids, hidden, batch: BatchInfo, kv_cache: KVCache | None) -> torch.Tensor:
        """token_ids [T]; hidden [T, 3d] (the target's aux layer states, concatenated in aux_layers order) or [T, d]
        (the head's own previous output) -> the pre-norm output [T, d]."""
        dtype = self.dtype
        d = self.config.hidden_size
        embeds = F.embedding(token_ids, self.embed_weight).to(dtype)  # [T, d]
        hidden = hidden.to(dtype)
        if hidden.shape[-1] == self.fused_width:
            hidden = self.fc(hidden)  # [T, d]
        elif hidden.shape[-1] != d:
            raise ValueError(
                f"an eagle3 head reads [T, {self.fused_width}] target states or [T, {d}] own outputs, got "
                f"{tuple(hidden.shape)}"
            )
        cos, sin = self._rope(batch.positions, dtype)
        layer_cache = kv_cache.layers[0] if kv_cache is not None else None
        return self.layers[0](embeds, hidden, cos, sin, batch, layer_cache, self.backend)
