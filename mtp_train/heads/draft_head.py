"""The draft head: a DeepSeek-style MTP head with restored norms, and its EAGLE-1 ablation (one flag apart).

    mtp:    x = eh_proj(cat(enorm(embed(t)), hnorm(h)))  -> layers -> norm -> frozen lm_head
    eagle1: x = fc(cat(embed(t), h)) (+bias unless head_config.fc_bias is False) -> layers (first without
            input_layernorm) -> frozen lm_head

The head reads the target's frozen `embed_tokens` and `lm_head` by reference: they are neither parameters nor
state-dict entries of the head, `.to()` on the head leaves them alone, and they are read through `.detach()` so no
gradient reaches them. Decoder layers are the runtime's `DecoderLayer` and run through the runtime's attention
backend, so training (packed sequences, no cache) and speculative drafting (paged KV cache) share one code path. On a
DeepSeek-V2/V3 target the mtp head is DeepSeek-V3's MTP module: its block is the target's `DeepseekDecoderLayer` (MLA
over a latent cache; `head_config.block_mlp` dense or MoE), and `init: from_checkpoint` loads the module the
checkpoint ships at `model.layers.{num_hidden_layers}` (runtime/deepseek.py).
With a reduced draft vocabulary (`head_config.draft_vocab_size` = N) the head holds two buffers, `d2t` [N] int64
and `t2d` [V] bool (`heads.vocab`), and its output projection is the lm_head's rows `draft_ids` (taken from the
target, never stored in the head file): `logits()` returns [n, N] logits over draft ids.
Row r of a forward reads `(hidden[r], token_ids[r])`; its rotary position is `batch.positions[r]`, by convention the
position of the hidden state it reads (row (H_i, t_{i+1}) -> position i, as vLLM's EAGLE/MTP proposers do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.heads.config import HeadConfig
from mtp_train.heads.vocab import check_draft_ids, d2t_from_ids, ids_from_d2t, t2d_from_ids
from mtp_train.runtime.attention import AttentionBackend, BatchInfo, TorchAttention
from mtp_train.runtime.config import ModelConfig
from mtp_train.runtime.deepseek import DeepseekDecoderLayer, LatentCache, mtp_checkpoint_names
from mtp_train.runtime.frozen_parts import FrozenParts, frozen_parts_of, read_tensors
from mtp_train.runtime.kv_cache import KVCache, PageAllocator
from mtp_train.runtime.model import CausalLM, DecoderLayer, DecoderLayers, RMSNorm, RotaryEmbedding


@dataclass
class _Borrowed:
    """Objects the head uses but does not own (so nn.Module does not register them as submodules)."""

    embed_tokens: nn.Embedding  # the target's, frozen
    lm_head: nn.Linear  # the target's, frozen
    rotary: RotaryEmbedding  # the head's own tables; kept fp32 (a module would be cast by `head.to(bfloat16)`)
    draft_weight: torch.Tensor | None = None  # lm_head rows of the draft vocabulary (cached; rebuilt when stale)
    draft_weight_key: tuple = ()


class DraftHead(nn.Module):
    """A draft head over a target. Parameters: mtp `enorm, hnorm, eh_proj, layers.{j}.*, norm`; eagle1 `fc (+bias),
    layers.{j}.*` (layer 0 without input_layernorm); buffers `d2t`, `t2d` with a reduced draft vocabulary."""

    def __init__(
        self,
        config: ModelConfig,
        head_config: HeadConfig,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
        backend: AttentionBackend | None = None,
    ):
        super().__init__()
        self._init_shared(config, head_config, embed_tokens, lm_head, backend)
        d = config.hidden_size
        self.is_mtp = head_config.kind == "mtp"
        if self.is_mtp:
            self.enorm = RMSNorm(d, config.rms_norm_eps)
            self.hnorm = RMSNorm(d, config.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * d, d, bias=False)
        else:
            self.fc = nn.Linear(2 * d, d, bias=head_config.fc_bias)  # no bias: vLLM's EAGLE-1 fc
        if config.deepseek is not None:  # the DeepSeek-V3 MTP module's block: MLA with a dense MLP or the MoE

            moe = head_config.block_mlp == "moe"
            self.layers = DecoderLayers(DeepseekDecoderLayer(config, moe) for _ in range(head_config.num_layers))
        else:
            self.layers = DecoderLayers(
                DecoderLayer(config, use_input_norm=self.is_mtp or j > 0) for j in range(head_config.num_layers)
            )
        self.norm = RMSNorm(d, config.rms_norm_eps) if self.is_mtp else None

    def _init_shared(self, config: ModelConfig, head_config: HeadConfig, embed_tokens: nn.Embedding,
                     lm_head: nn.Linear, backend: AttentionBackend | None) -> None:
        """What every head kind sets up (heads/eagle3.py too): the configs, the borrowed target parts and rotary
        tables, the attention backend and, with a reduced draft vocabulary, the d2t/t2d buffers."""
        if (head_config.hidden_size, head_config.vocab_size) != (config.hidden_size, config.vocab_size):
            raise ValueError(
                f"head config (hidden_size={head_config.hidden_size}, vocab_size={head_config.vocab_size}) does not "
                f"match the target (hidden_size={config.hidden_size}, vocab_size={config.vocab_size})"
            )
        self.config = config
        self.head_config = head_config
        with torch.device("cpu"):
            rotary = RotaryEmbedding(config)
        self._borrowed = _Borrowed(embed_tokens, lm_head, rotary)
        self.backend = backend or TorchAttention()
        if head_config.draft_vocab_size is not None:  # placeholder map (ids 0..N-1) until set_draft_vocab/load
            n, vocab = head_config.draft_vocab_size, config.vocab_size
            self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(vocab) < n)

    # ---- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_target(cls, target: CausalLM | FrozenParts, head_config: HeadConfig,
                    dtype: torch.dtype | None = None) -> "DraftHead":
        """A head over `target` (a loaded CausalLM, or only its frozen parts: `runtime.frozen_parts`), initialized per
        `head_config.init`, on the target's device in `dtype` (default: the target's). Called on `DraftHead` or a
        subclass (heads/eagle3.py), it builds that class."""
        parts = frozen_parts_of(target)
        head = cls(parts.config, head_config, parts.embed_tokens, parts.lm_head, parts.backend)
        head.to(device=parts.device, dtype=torch.float32)
        if head_config.init == "last_layer":
            head.init_from_target(parts)
        elif head_config.init == "from_checkpoint":
            head.init_from_checkpoint(parts.source_dir)
        else:
            head.init_random()
        return head.to(dtype=dtype or parts.dtype)

    @property
    def init_std(self) -> float:
        return float(getattr(self.config.hf_config, "initializer_range", 0.02) or 0.02)

    @torch.no_grad()
    def init_random(self) -> None:
        """Linear weights ~ normal(0, initializer_range), biases 0, every RMSNorm weight 1 (transformers' init)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, self.init_std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    @torch.no_grad()
    def init_from_target(self, target: CausalLM | FrozenParts) -> None:
        """Every head layer = a copy of the target's last decoder layer; `norm` = the target's final norm; enorm and
        hnorm = 1; the input projection = [small random | identity] (+ zero bias for eagle1).

        With the identity on the hidden half, the initial head is "the target's last layer applied once more to H_i",
        whose output lies in the target's hidden distribution (same final norm): the feature and KL losses start from
        the gap between H_i and H_{i+1}, not from noise. The token half starts small (normal, std=initializer_range),
        so the head learns how much of embed(t_{i+1}) to use, and no weight is exactly zero, so every parameter
        (enorm included) gets a gradient from the first step."""
        parts = frozen_parts_of(target)
        if parts.last_layer is None or parts.final_norm is None:
            raise ValueError("init last_layer needs the target's last decoder layer and final norm: load the frozen "
                             "parts with last_layer=True")
        self.init_random()
        last_layer = parts.last_layer
        for j, layer in enumerate(self.layers):
            own = layer.state_dict()
            layer.load_state_dict({k: last_layer[k].to(v.dtype) for k, v in own.items()}, strict=True)
        if self.norm is not None:
            self.norm.weight.copy_(parts.final_norm)
        proj = self.eh_proj if self.is_mtp else self.fc
        d = self.config.hidden_size
        proj.weight[:, d:].copy_(torch.eye(d))  # [d, 2d]: columns d.. read the hidden state

    @torch.no_grad()
    def init_from_checkpoint(self, model_dir: str | None) -> None:
        """Load the MTP module a DeepSeek-V3/R1 checkpoint ships (`model.layers.{num_hidden_layers}.*`,
        `num_nextn_predict_layers: 1`): enorm, hnorm, eh_proj, the block, shared_head.norm -> norm. Its own copies of
        embed_tokens and shared_head.head are not read (the head reads the target's frozen ones)."""

        if model_dir is None:
            raise ValueError("init from_checkpoint needs the target's checkpoint directory (source_dir)")
        own = {k: v for k, v in self.state_dict().items() if k not in ("d2t", "t2d")}  # the draft vocab is ours
        names = mtp_checkpoint_names(self.config, own)  # head name -> checkpoint name
        shapes = {names[key]: tuple(own[key].shape) for key in names}
        tensors = read_tensors(model_dir, shapes, torch.float32, self.device)
        for key, value in own.items():
            value.copy_(tensors[names[key]])

    @torch.no_grad()
    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """Use the target ids `draft_ids` (strictly increasing, `draft_vocab_size` of them) as the draft vocabulary."""
        n = self.head_config.draft_vocab_size
        if n is None:
            raise ValueError("this head has the full vocabulary (head_config.draft_vocab_size is None)")
        draft_ids = draft_ids.to(device=self.d2t.device, dtype=torch.long)
        if draft_ids.numel() != n:
            raise ValueError(f"expected {n} draft ids, got {draft_ids.numel()}")
        check_draft_ids(draft_ids, self.config.vocab_size)
        self.d2t.copy_(d2t_from_ids(draft_ids))
        self.t2d.copy_(t2d_from_ids(draft_ids, self.config.vocab_size))

    def new_kv_cache(self, allocator: PageAllocator) -> KVCache:
        """The head's own paged K/V storage over the target's allocator (one entry per head layer); a latent cache
        (runtime/deepseek.py) for a DeepSeek target's MLA block."""
        c = self.config
        if c.deepseek is not None:

            return LatentCache(allocator, len(self.layers), c.deepseek.latent_dim, self.dtype, self.device)
        return KVCache(allocator, len(self.layers), c.num_key_value_heads, c.head_dim, self.dtype, self.device)

    # ---- properties ---------------------------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return self.head_config.kind

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers (0-based outputs) whose states the head's first step reads instead of the final hidden
        state: empty for mtp/eagle1 (they read H), three for eagle3."""
        return self.head_config.aux_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].post_attention_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].post_attention_layernorm.weight.device

    @property
    def embed_weight(self) -> torch.Tensor:
        """The target's embedding matrix [vocab, d], detached."""
        return self._borrowed.embed_tokens.weight.detach()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The target's lm_head matrix [vocab, d], detached (losses recompute logits from it chunk by chunk)."""
        return self._borrowed.lm_head.weight.detach()

    @property
    def draft_vocab_size(self) -> int:
        """N: how many tokens the head's logits cover (the target's vocab_size when the vocabulary is full)."""
        return self.head_config.draft_vocab_size or self.config.vocab_size

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """[N] int64 target id of each draft id, or None with the full vocabulary (draft id = target id)."""
        if self.head_config.draft_vocab_size is None:
            return None
        return ids_from_d2t(self.d2t)

    @property
    def draft_weight(self) -> torch.Tensor:
        """The output projection [N, d]: the lm_head rows of the draft vocabulary (all of it when full), detached.
        Cached while neither the lm_head nor d2t changes."""
        weight = self.lm_head_weight
        if self.head_config.draft_vocab_size is None:
            return weight
        key = self.draft_weight_key()
        if self._borrowed.draft_weight_key != key:
            self._borrowed.draft_weight = weight.index_select(0, ids_from_d2t(self.d2t).to(weight.device))
            self._borrowed.draft_weight_key = key
        return self._borrowed.draft_weight

    def draft_weight_key(self) -> tuple:
        """What `draft_weight` depends on (the lm_head's storage, and d2t's with a reduced vocabulary): a copy of
        the projection made from it is current while this key is unchanged."""
        weight = self.lm_head_weight
        key = (weight.data_ptr(), weight.dtype, weight.device)
        if self.head_config.draft_vocab_size is None:
            return key
        return key + (self.d2t.data_ptr(), self.d2t._version)

    # ---- forward ------------------------------------------------------------------------------------------------

    @property
    def rotary(self) -> RotaryEmbedding:
        """The head's rotary tables (its own, kept fp32)."""
        return self._borrowed.rotary

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self._borrowed.rotary(positions, dtype)  # fp32 tables, moved to the positions' device on use

    def forward(
        self,
        token_ids: torch.Tensor,  # [T]: t_{i+1} for the row reading H_i
        hidden: torch.Tensor,  # [T, d]: H_i, or the head's own previous output
        batch: BatchInfo,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Returns the head's output state [T, d] (after its final norm for mtp; raw for eagle1): what the feature
        loss compares with H_{i+1} and what is fed back as `hidden` for the next step. With a `kv_cache` (the
        speculative draft path) it runs under inference mode, like the target's forward."""
        if kv_cache is not None:
            with torch.inference_mode():
                return self._forward(token_ids, hidden, batch, kv_cache)
        return self._forward(token_ids, hidden, batch, None)

    def _forward(self, token_ids, hidden, batch: BatchInfo, kv_cache: KVCache | None) -> torch.Tensor:
        return self.run_layers(self.input_rows(token_ids, hidden), batch, kv_cache)

    def input_rows(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T] token ids, [T, d] states -> the first layer's input [T, d]: mtp eh_proj(cat(enorm(embed(t)),
        hnorm(h))), eagle1 fc(cat(embed(t), h))."""
        embeds = F.embedding(token_ids, self.embed_weight).to(self.dtype)  # [T, d]
        hidden = hidden.to(self.dtype)  # [T, d]
        if self.is_mtp:
            return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        return self.fc(torch.cat((embeds, hidden), dim=-1))

    def run_layers(self, x: torch.Tensor, batch: BatchInfo, kv_cache: KVCache | None) -> torch.Tensor:
        """The first layer's input [T, d] through the layers and the final norm (mtp) -> the head's output [T, d]."""
        x, _ = self.layers(x, self._borrowed.rotary, batch, kv_cache, self.backend)
        return self.norm(x) if self.norm is not None else x

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        """The states the output projection reads from the head's output `out` [n, d]: `out` itself here (the mtp
        head's output is already after its final norm, eagle1 has none); an eagle3 head applies its final norm."""
        return out

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """[n, d] head output (what `forward` returns) -> [n, N] fp32 logits over the draft vocabulary (N = vocab with
        the full one) of its `readout` through the target's frozen lm_head rows; map draft ids to target ids with
        `draft_ids`."""
        out_hidden = self.readout(out_hidden)
        weight = self.draft_weight
        return F.linear(out_hidden.to(weight.dtype), weight).float()
