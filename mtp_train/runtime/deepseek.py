"""The DeepSeek-V2/V3 family (`model_type` deepseek_v2, deepseek_v3): Multi-head Latent Attention over a paged cache
of the compressed latent, and a Mixture-of-Experts MLP.

Parameter names are the checkpoints' own (what transformers' `save_pretrained` and DeepSeek's releases write):
`self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`, `self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj}`, `mlp.{gate_proj, up_proj, down_proj}` (dense layers, `first_k_dense_replace`), `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias` (V3), `mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_experts.*`. Numerics
follow transformers' DeepseekV2/V3 models (the parity reference, `tests/test_deepseek_runtime.py`).

MLA, per token t: `c_t = kv_a_layernorm(kv_a_proj_with_mqa(x_t)[:r])` (r = kv_lora_rank) and one rope key
`k_rope_t = rope(kv_a_proj_with_mqa(x_t)[r:])` shared by all heads. The cache holds exactly these
`r + qk_rope_head_dim` values per token per layer (`LatentCache`), not per-head K/V. Keys and values are
`kv_b_proj(c)` split per head into `k_nope [qk_nope_head_dim]` and `v [v_head_dim]`. Two exact ways to attend:

- **expanded** (prefill, training, forwards bringing more than `ABSORB_MAX_QUERY` tokens per sequence): up-project
  every attended latent through kv_b_proj, then ordinary attention with keys `cat(k_nope, k_rope)`;
- **absorbed** (decode, verify, draft steps): fold kv_b_proj's key half into the query
  (`q_lat = q_nope W_uk`, [heads, r]) and its value half into the output (`o = (P c) W_uv`), so each step reads the
  cached latents once as a single shared key/value head of width r + rope (MQA), never expanding them. Its cost per
  query-key pair is heads * (2r + rope) against the expanded form's per-key up-projection of r * heads *
  (qk_nope + v): at one query per sequence the absorbed form is ~100x fewer multiply-adds for V2-Lite's shapes, at a
  whole prompt the expanded one wins (vLLM and SGLang make the same split). Both agree to fp32 rounding (step
  times of the two forms: docs/benchmarks.md, "Figures behind the code's choices").

RoPE: DeepSeek stores the rope dimensions as interleaved pairs (V2 always, V3 with `rope_interleave`); the pairs are
de-interleaved before the rotate-half rotation (transformers' V3 formula; V2's complex-number rotation differs only by
a permutation applied to both q and k, so the scores are the same). YaRN's attention factor scales cos/sin (from
transformers' rope init), and `mscale_all_dim` scales the softmax (`DeepseekOptions.softmax_scale`).

MoE routing (fp32, as transformers): V2 softmax scores, top-k `greedy` or `group_limited_greedy` (the top
`topk_group` groups by their best expert), weights times `routed_scaling_factor`; V3 sigmoid scores, experts chosen
on scores + `e_score_correction_bias` within the top `topk_group` groups (a group scored by the sum of its top-2),
weights = the chosen sigmoid scores, renormalized when `norm_topk_prob`, times `routed_scaling_factor`. Shared experts
are added to every token.

The CPU decode kernels (`runtime/cpu_decode.py`) cover the Llama family's `DecoderLayer` only; `DeepseekDecoderLayer`
is a different class, so the decode path (`runtime/decode_runner.py`) leaves its attention and MoE to this module (its
linears still read the decode-dtype weight copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.runtime.attention import AttentionBackend, BatchInfo, TorchAttention
from mtp_train.runtime.config import DeepseekOptions, ModelConfig
from mtp_train.runtime.kv_cache import PageAllocator
from mtp_train.runtime.model import _ACTIVATIONS, CausalLM, DecoderLayers, RMSNorm, apply_rotary

ABSORB_MAX_QUERY = 16  # cached forwards whose sequences each bring at most this many tokens attend in absorbed form
_PLANNER = TorchAttention()  # slot and mask planning shared with the Llama path (cached on the BatchInfo)


class LatentCache:
    """One model's MLA cache over the pages of an allocator: per layer one `[num_pages, page_size, kv_lora_rank +
    qk_rope_head_dim]` tensor (the normalized latent, then the rotated rope key), shared page ids with every other
    model on the allocator (target and draft), like `KVCache`."""

    def __init__(self, allocator: PageAllocator, num_layers: int, latent_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.allocator = allocator
        self.latent_dim = latent_dim
        shape = (allocator.num_pages, allocator.page_size, latent_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


def _options(config: ModelConfig) -> DeepseekOptions:
    if config.deepseek is None:
        raise ValueError(f"model_type {config.model_type!r} is not a DeepSeek config")
    return config.deepseek


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x: [T, heads, rope_dim] -> rotated, in the de-interleaved (rotate-half) layout."""
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rotary(x, cos, sin)


def _sequence_mask(plan: dict, b: int, n_q: int, kv_len: int, device) -> torch.Tensor | None:
    """Sequence b's [n_q, kv_len] bool mask (True = attend) from the shared attention plan, or None (all keys)."""
    if plan["uniform"]:
        return plan["padded_mask"][b, 0, :, :kv_len]
    mask = plan["masks"][b]
    if isinstance(mask, str):  # "causal": the last n_q keys are the queries themselves
        return torch.ones(n_q, kv_len, dtype=torch.bool, device=device).tril(kv_len - n_q)
    return mask


class MLAttention(nn.Module):
    """Multi-head Latent Attention (see the module docstring). `layer_cache`: this layer's latent pages or None.
    It attends with its own torch code over the latent pages (the slot and mask plan is the torch backend's, so tree
    masks and ragged batches mean the same); the `backend` argument, a K/V attention backend, is not used."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        o = _options(config)
        d, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads
        self.q_lora_rank, self.kv_lora_rank = o.q_lora_rank, o.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = o.qk_nope_head_dim, o.qk_rope_head_dim
        self.v_head_dim = o.v_head_dim
        self.scale = o.softmax_scale
        self.interleaved = o.rope_interleave
        if o.q_lora_rank is None:
            self.q_proj = nn.Linear(d, heads * o.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, o.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(o.q_lora_rank, 1e-6)  # transformers builds it with its default eps
            self.q_b_proj = nn.Linear(o.q_lora_rank, heads * o.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, o.kv_lora_rank + o.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(o.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(o.kv_lora_rank, heads * (o.qk_nope_head_dim + o.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * o.v_head_dim, d, bias=False)

    def forward(self, x, cos, sin, batch: BatchInfo, layer_cache, backend: AttentionBackend | None = None):
        num_tokens = x.shape[0]
        r, dn, dr = self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, self.num_heads, dn + dr)
        q_nope, q_rope = q[..., :dn], _rope(q[..., dn:], cos, sin, self.interleaved)  # [T, H, dn], [T, H, dr]
        compressed = self.kv_a_proj_with_mqa(x)  # [T, r + dr]
        latent_kv = self.kv_a_layernorm(compressed[:, :r])
        k_rope = _rope(compressed[:, None, r:], cos, sin, self.interleaved)[:, 0]
        latent = torch.cat((latent_kv, k_rope), dim=-1)  # [T, r + dr]: what the cache holds
        flat = None
        if layer_cache is not None:
            flat = layer_cache.view(-1, layer_cache.shape[-1])  # [num_pages * page_size, r + dr]
            flat.index_copy_(0, batch.slot_mapping, latent.to(flat.dtype))
        if layer_cache is not None and batch.max_q_len <= ABSORB_MAX_QUERY:
            out = self._absorbed(q_nope, q_rope, flat, batch)
        else:
            out = self._expanded(q_nope, q_rope, latent, flat, batch)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight split per head: W_uk [H, dn, r] (key half), W_uv [H, dv, r] (value half)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _absorbed(self, q_nope, q_rope, flat, batch: BatchInfo) -> torch.Tensor:
        """Attention over the cached latents as one shared key/value head: [T, H, dv]."""
        w_uk, w_uv = self._kv_b()
        q_latent = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float())  # [T, H, r]
        q_cat = torch.cat((q_latent, q_rope.float()), dim=-1)  # [T, H, r + dr]
        r, heads = self.kv_lora_rank, self.num_heads
        plan = _PLANNER._plan(batch, None, q_cat.device)
        if plan["uniform"]:
            n_q, padded = batch.q_lens[0], plan["padded_slots"]  # [B, max_kv]
            keys = flat.index_select(0, padded.view(-1)).view(*padded.shape, -1).float()  # [B, max_kv, r + dr]
            q_b = q_cat.view(batch.batch_size, n_q * heads, -1)
            scores = torch.matmul(q_b, keys.transpose(1, 2)).mul_(self.scale)  # [B, n_q * H, max_kv]
            scores = scores.view(batch.batch_size, n_q, heads, -1)
            scores.masked_fill_(~plan["padded_mask"].view(batch.batch_size, n_q, 1, -1), float("-inf"))
            probs = scores.softmax(-1).view(batch.batch_size, n_q * heads, -1)
            out_latent = torch.matmul(probs, keys[..., :r]).view(-1, heads, r)  # [T, H, r]
        else:
            outputs = []
            for b, (start, end) in enumerate(plan["rows"]):
                slots = plan["kv_slots"][b]
                keys = (flat[slots] if isinstance(slots, slice) else flat.index_select(0, slots)).float()
                scores = torch.einsum("qhc,kc->qhk", q_cat[start:end], keys).mul_(self.scale)  # [n_q, H, kv]
                mask = _sequence_mask(plan, b, end - start, keys.shape[0], keys.device)
                if mask is not None:
                    scores.masked_fill_(~mask[:, None, :], float("-inf"))
                outputs.append(torch.einsum("qhk,kr->qhr", scores.softmax(-1), keys[:, :r]))
            out_latent = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        return torch.einsum("thr,hvr->thv", out_latent, w_uv.float()).to(q_nope.dtype)

    def _expanded(self, q_nope, q_rope, latent, flat, batch: BatchInfo) -> torch.Tensor:
        """Attention with the attended latents up-projected to per-head keys and values: [T, H, dv]."""
        r, heads, dn = self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim
        query = torch.cat((q_nope, q_rope), dim=-1)  # [T, H, dn + dr]
        plan = _PLANNER._plan(batch, None, query.device)
        outputs = []
        for b, (start, end) in enumerate(plan["rows"]):
            if flat is not None:
                slots = plan["kv_slots"][b]
                seq_latent = flat[slots] if isinstance(slots, slice) else flat.index_select(0, slots)
                seq_latent = seq_latent.to(latent.dtype)
            else:
                seq_latent = latent[start:end]
            kv_len = seq_latent.shape[0]
            mask = "causal" if not plan["uniform"] and isinstance(plan["masks"][b], str) else \
                _sequence_mask(plan, b, end - start, kv_len, query.device)
            kv = self.kv_b_proj(seq_latent[:, :r]).view(kv_len, heads, -1)  # [kv, H, dn + dv]
            k_rope = seq_latent[:, None, r:].expand(kv_len, heads, self.qk_rope_head_dim)
            key = torch.cat((kv[..., :dn], k_rope), dim=-1).transpose(0, 1)[None]  # [1, H, kv, dn + dr]
            value = kv[..., dn:].transpose(0, 1)[None]  # [1, H, kv, dv]
            q_b = query[start:end].transpose(0, 1)[None]  # [1, H, n_q, dn + dr]
            if isinstance(mask, str):
                out = F.scaled_dot_product_attention(q_b, key, value, is_causal=True, scale=self.scale)
            else:
                out = F.scaled_dot_product_attention(q_b, key, value, attn_mask=mask, scale=self.scale)
            outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


class DeepseekMLP(nn.Module):
    """A gated MLP without biases: dense layers, each routed expert, the shared experts."""

    def __init__(self, config: ModelConfig, intermediate_size: int):
        super().__init__()
        d = config.hidden_size
        self.gate_proj = nn.Linear(d, intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, d, bias=False)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TopkRouter(nn.Module):
    """`mlp.gate`: scores each token's experts and picks `num_experts_per_tok` of them (module docstring).

    Routing runs in fp32. `e_score_correction_bias` stays fp32 whatever dtype the module is cast to (a bf16 copy of
    the bias can change which experts win), and the loader keeps `weight` fp32 in a target too (`FP32_TENSORS`), as
    transformers keeps both (`_keep_in_fp32_modules_strict`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        o = _options(config)
        self.options = o
        self.weight = nn.Parameter(torch.zeros(o.n_routed_experts, config.hidden_size))
        if o.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(o.n_routed_experts))

    def _apply(self, fn, recurse=True):
        bias = self._buffers.get("e_score_correction_bias")
        result = super()._apply(fn, recurse)
        if bias is not None:
            moved = self._buffers["e_score_correction_bias"]
            self._buffers["e_score_correction_bias"] = bias.to(device=moved.device, dtype=torch.float32)
        return result

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        o = self.options
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        per_group = o.n_routed_experts // o.n_group
        if o.topk_method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            group_scores = choice.view(-1, o.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        else:
            scores = logits.softmax(dim=-1)
            choice = scores
            group_scores = scores.view(-1, o.n_group, per_group).max(dim=-1).values
        if o.topk_method != "greedy" and o.topk_group < o.n_group:
            groups = group_scores.topk(o.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            keep = keep[:, :, None].expand(-1, -1, per_group).reshape(-1, o.n_routed_experts)
            # V3 masks the dropped groups with -inf, V2 with 0 (the scores are positive softmax values)
            choice = choice.masked_fill(~keep, float("-inf") if o.topk_method == "noaux_tc" else 0.0)
        chosen = choice.topk(o.num_experts_per_tok, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, chosen)
        if o.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * o.routed_scaling_factor, chosen


class MoE(nn.Module):
    """Routed experts (each token through its top-k, weighted) plus the shared experts."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        o = _options(config)
        self.gate = TopkRouter(config)
        self.experts = nn.ModuleList(DeepseekMLP(config, o.moe_intermediate_size) for _ in range(o.n_routed_experts))
        self.shared_experts = (DeepseekMLP(config, o.moe_intermediate_size * o.n_shared_experts)
                               if o.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x)  # [T, k] each
        out = torch.zeros_like(x)  # [T, d]
        for expert_id in torch.unique(chosen).tolist():
            token_rows, slot = torch.where(chosen == expert_id)
            y = self.experts[expert_id](x[token_rows]) * weights[token_rows, slot, None]
            out = out.index_add(0, token_rows, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block: MLA, then a dense MLP or the MoE. Same call signature as `model.DecoderLayer`."""

    def __init__(self, config: ModelConfig, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if moe else DeepseekMLP(config, config.intermediate_size)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoE)

    def forward(self, x, cos, sin, batch: BatchInfo, layer_cache, backend: AttentionBackend | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, layer_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekBody(nn.Module):
    """`model.*`: embeddings, decoder layers (dense before `first_k_dense_replace`, MoE after), final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        first_moe = _options(config).first_k_dense_replace
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = DecoderLayers(DeepseekDecoderLayer(config, moe=i >= first_moe)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(CausalLM):
    """A DeepSeek-V2/V3 target: `CausalLM`'s forward, logits and fingerprint over a `DeepseekBody`; its cache is a
    `LatentCache`. The rotary tables cover `qk_rope_head_dim` (`ModelConfig.head_dim` for this family)."""

    body_class = DeepseekBody
    # checkpoint tensors the loader keeps in fp32 whatever the model's dtype (suffixes): the router's
    FP32_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The latent cache keeps the model's dtype (`kv_cache_dtype` is not applied to it)."""
        return self.dtype

    def new_kv_cache(self, allocator: PageAllocator) -> LatentCache:
        c = self.config
        return LatentCache(allocator, c.num_hidden_layers, _options(c).latent_dim, self.kv_cache_torch_dtype,
                           self.device)

    def prefill_flops(self, lengths: list[int], logits_rows: int = 0) -> float:
        """As `CausalLM.prefill_flops`, counting the weights a token meets (its top-k and the shared experts, not
        every routed expert) and attention in the expanded form (keys qk_head_dim wide, values v_head_dim)."""
        c, o = self.config, _options(self.config)
        tokens = sum(lengths)
        pairs = sum(n * (n + 1) // 2 for n in lengths)
        total = 0.0
        for layer in self.model.layers:
            params = sum(p.numel() for n, p in layer.named_parameters() if p.dim() == 2 and ".experts." not in n)
            if layer.is_moe:
                params += o.num_experts_per_tok * sum(p.numel() for p in layer.mlp.experts[0].parameters())
            total += 2 * params * tokens + 2 * c.num_attention_heads * (o.qk_head_dim + o.v_head_dim) * pairs
        return float(total + 2 * c.hidden_size * c.vocab_size * logits_rows)


def mtp_layer_prefix(config: ModelConfig, k: int = 0) -> str:
    """Where a DeepSeek checkpoint stores MTP module k: `model.layers.{num_hidden_layers + k}.`."""
    return f"model.layers.{config.num_hidden_layers + k}."


def is_mtp_key(config: ModelConfig, key: str) -> bool:
    """Whether checkpoint tensor `key` belongs to one of the MTP modules the config declares
    (`num_nextn_predict_layers`), which the target itself does not run."""
    o = _options(config)
    return any(key.startswith(mtp_layer_prefix(config, k)) for k in range(o.num_nextn_predict_layers))


def mtp_checkpoint_names(config: ModelConfig, head_keys) -> dict[str, str]:
    """A DeepSeek MTP head's parameter name -> the name of the same tensor in MTP module 0 of a DeepSeek-V3
    checkpoint (`model.layers.{num_hidden_layers}.`): enorm, hnorm, eh_proj keep their names, the block's
    `layers.0.X` is `X`, the final `norm` is `shared_head.norm`."""
    prefix = mtp_layer_prefix(config)
    names = {}
    for key in head_keys:
        if key.startswith("layers.0."):
            names[key] = prefix + key[len("layers.0."):]
        elif key.startswith("norm."):
            names[key] = prefix + "shared_head." + key
        elif key.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            names[key] = prefix + key
        else:
            raise ValueError(f"head tensor {key} has no place in a DeepSeek MTP module")
    return names
