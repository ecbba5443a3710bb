"""`make serve-check`: serve our exported heads in a real engine (vLLM, CPU) and compare it with our own evaluation.

For each case of CASES (head kind, export format, how vLLM is told to use it), on the held-out prompts of the head's
run (10, as the demo's eval):
  1. export the head (`mtp_train.export.export_head`, float32) to exports/serve-check/<format>/export;
  2. our side: `mtp-train eval --head <export>` (the engine the project ships; greedy, fp32, k tokens, the same
     prompts and max new tokens), read from its report.json: acceptance per position;
  3. vLLM's side, one process at a time (`.venv-vllm/bin/python` running this file with --vllm-worker): the target
     alone (plain; run once and reused by every case with the same prompts), then the target with the export as its
     speculative draft; CPU, fp32, greedy, enforce_eager, one OpenMP thread; vLLM's spec-decode counters from
     `LLM.get_metrics()` (vllm:spec_decode_num_drafts, _num_accepted_tokens, _num_accepted_tokens_per_pos);
  4. checks (`compare`): vLLM's speculative output == its plain output on every prompt; vLLM's mean acceptance length
     (1 + accepted / drafts) and each position's acceptance (accepted at j / drafts) within TOLERANCE of ours (ours
     in the same terms: 1 + the sum of our per-position acceptance); and our acceptance at position 1 above
     MIN_ACCEPTANCE (a head that drafts nothing acceptable would make the comparison vacuous).
Prints a table, the time per stage and a last line `RESULT key=value ...`; exits 1 if any case fails.

The head of each case's kind (`find_heads`): the entry of that kind in HEAD=<dir>[,<dir>...] (run directories or their
head/; each entry's kind is read from its head_config.json), else the run `make demo` (or the kind's recipe) makes
(RECIPES: runs/smollm2-135m-mtp, runs/smollm2-135m-eagle3), else a short run of the kind's recipe
(`train_short_heads`: SHORT_DATA / SHORT_TRAIN overrides; the kinds share one prepared data set and one feature cache
that stores every aux layer the recipes read). A head with a reduced draft vocabulary is exported drafting over the
full vocabulary where the layout has none (vLLM's MiMoMTP; `export_head` does so by itself), and our side is
evaluated on that same export, so both engines run the same head; EAGLE-3 keeps it (d2t/t2d).

One more case is one line in CASES (a kind, a format, the vLLM speculative method, the target's hf_overrides) and,
for a new kind, one line in RECIPES.

OPTIONAL_CASES are checked only when CASES names them: `deepseek-mtp` serves a DeepSeek-V3 target (MLA + MoE, vLLM's
CPU_MLA backend) with our `deepseek-mtp` export as vLLM's DeepSeekMTP draft, k = 1. It brings its own target and head
(`deepseek_head`: a tiny random DeepSeek-V3 with SmolLM2's tokenizer, and an MTP head that agrees with it by
construction), and compares vLLM with our eval run as vLLM's MTP layer computes (the token embedding zeroed at
position 0; `masked_mtp_train`), printing our unmasked acceptance next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
TOLERANCE = 0.02  # |vLLM - ours| for the mean acceptance length and for each position's acceptance
MIN_ACCEPTANCE = 0.05  # our acceptance at position 1 must exceed this: else both engines agreeing says little
WORK = REPO / "exports" / "serve-check"  # exports, our eval reports, vLLM logs (git-ignored)
# One vLLM process at a time, one thread each: this machine is shared (2 cores).
VLLM_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
# The recipe of each head kind: its run directory (runs/<recipe stem>, what `make demo` or `mtp-train train --recipe`
# makes) is the head checked when HEAD names none of that kind; a short run of it is trained when that is missing too.
RECIPES = {"mtp": REPO / "recipes" / "smollm2-135m-mtp.yaml", "eagle3": REPO / "recipes" / "smollm2-135m-eagle3.yaml"}
# The short runs (a fresh clone): few samples, so that precompute (one thread) takes a few minutes; a held-out share
# that still leaves about 10 prompts; two epochs, so that the heads accept drafts (measured in docs/export.md).
SHORT_NAME = "serve-check"  # runs/serve-check-<kind>, data/prepared/serve-check, data/features/serve-check
SHORT_DATA = ["data.max_samples=200", "data.eval_fraction=0.05", f"data.output_dir=data/prepared/{SHORT_NAME}",
              f"precompute.output_dir=data/features/{SHORT_NAME}"]
SHORT_TRAIN = ["train.epochs=2"]

# The deepseek-mtp case serves a DeepSeek-V3 target, so it brings its own (`deepseek_head`): a tiny random one
# (transformers' DeepseekV3ForCausalLM, fp32; MLA with YaRN rope, layer 0 dense, layer 1 MoE with noaux_tc group-limited
# sigmoid routing and a shared expert) with SmolLM2's tokenizer (the vocabulary is the target's, 49152), in
# WORK/deepseek-mtp/target. vLLM 0.32's CPU MLA backend decodes only a 576-wide latent
# (v1/attention/backends/mla/cpu_mla.py `get_supported_head_sizes` -> [576]: kv_lora_rank 512 + qk_rope_head_dim 64,
# DeepSeek-V3's own), so those two are V3's; the rest is tiny.
TOKENIZER_SOURCE = REPO / "data" / "models" / "smollm2-135m-instruct"
TINY_DEEPSEEK_V3 = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=64, v_head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, initializer_range=0.2, num_nextn_predict_layers=0, routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
)
# initializer_range 0.2: transformers' 0.02 leaves the logits nearly flat (top-1 margins of ~1e-3 that fp32 summation
# order could flip between engines). num_nextn_predict_layers 0: the target ships no MTP layer.
#
# The head: a random target's text is a hash of its context that no head learns from a few hundred samples (a
# pipeline-trained head on this target's own greedy replies reached 1% top-1 after 180 steps), and a head that drafts
# nothing would make the acceptance comparison vacuous. So the head is made to agree with the target by construction:
# the target's layer 0 adds only LAYER0_SCALE of its attention and MLP outputs to the residual (its layer 1 does the
# work), and the head (`agreeing_head`: our head-building code, `init: last_layer`, `block_mlp: moe`) is layer 1 copied
# with eh_proj ~ [r I | r HIDDEN_MIX noise] (r: the embeddings' mean RMS, which enorm divides out): it reads the next
# token's embedding as layer 1 reads it, plus a little of the target's hidden state (so hnorm and that half of eh_proj
# count). It agrees with the target often, not always (layer 0's share, the hidden mix, a context one token shorter
# than the target's): 0.46 of drafts accepted at k = 1.
LAYER0_SCALE = 0.001
HIDDEN_MIX = 0.01
DEEPSEEK_NAME = "serve-check-deepseek-mtp"  # runs/<this> (the head, recipe.resolved.yaml), data/prepared/<this>
DEEPSEEK_SETS = [f"name={DEEPSEEK_NAME}", "data.max_samples=200", "data.eval_fraction=0.05",
                 "head.draft_vocab_size=full", "head.block_mlp=moe", "head.init=last_layer", "precision.compute=float32",
                 "precision.decode=float32", "target.device=cpu", "tracking.wandb.mode=disabled"]


@dataclass(frozen=True)
class Case:
    """One (head kind, export format) that vLLM serves: `method` is vLLM's speculative_config method; `hf_overrides`: what the target's config
    needs for this method (`LLM(hf_overrides=...)`); `own_target`: the case brings its own target and head
    (`deepseek_head`; HEAD does not apply to it); `k`: speculative tokens unless --k says; `mask_position_0`: compare
    vLLM with our eval run as vLLM's MTP layer computes (`masked_mtp_train`: the token embedding zeroed at position
    0), ours as shipped reported next to it."""

    kind: str
    format: str
    method: str
    hf_overrides: dict | None = None
    own_target: bool = False
    k: int | None = None
    mask_position_0: bool = False

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.format}"


CASES = [
    Case("mtp", "vllm-mtp", "mtp", hf_overrides={"num_nextn_predict_layers": 1}),
    # EAGLE-1 (`eagle`, method "eagle") needs a head trained with head.fc_bias: false; no recipe trains one.
    Case("eagle3", "eagle3", "eagle3"),  # the draft vocabulary kept (d2t)
]
# Checked only when CASES names them.
OPTIONAL_CASES = [
    # A DeepSeek-V3 target (tiny, made here: `deepseek_head`) with its MTP head exported as DeepSeek's own layout;
    # vLLM 0.32 maps a deepseek_v3 draft config to DeepSeekMTP (config/speculative.py) and calls the method "mtp"
    # ("deepseek_mtp" is accepted as a deprecated alias). One MTP module: k = 1, as DeepSeek serves it. Not in the
    # default list (CASES above; it builds its own target): `make serve-check CASES=deepseek-mtp`.
    # vLLM builds DeepSeekMTP's layers from the *target's* config (DeepSeekMultiTokenPredictor reads
    # vllm_config.model_config.hf_config.num_nextn_predict_layers, and the draft's vllm_config keeps the target's
    # model_config): a target config without num_nextn_predict_layers >= 1 gets an MTP model with no layer, and the
    # engine fails with "All drafting layers should belong to the same kv cache group". DeepSeek-V3 checkpoints say 1;
    # the tiny target (it ships no MTP layer) is told so.
    # vLLM's DeepSeekMultiTokenPredictorLayer.forward zeroes the token embedding at position 0 ("masking inputs at
    # position 0, as not needed by MTP"); our heads do not. The agreeing head (a copy of the target's attention block)
    # attends to that row from every position, so it moves acceptance by ~0.04 here (0.464 unmasked, 0.4215 masked,
    # vLLM 0.419): the check compares vLLM with our eval under that mask and reports our unmasked figure too.
    Case("mtp", "deepseek-mtp", "mtp", hf_overrides={"num_nextn_predict_layers": 1},
         own_target=True, k=1, mask_position_0=True),
]


@dataclass
class HeadSource:
    """The head a case checks: its run directory, head directory, the run's resolved recipe, and where it came from
    ("HEAD", "run <dir>" for an existing run, "short run" for one trained here)."""

    kind: str
    run_dir: Path
    head_dir: Path
    origin: str

    @property
    def recipe(self) -> Path:
        return self.run_dir / "recipe.resolved.yaml"


@dataclass
class Timer:
    """Seconds per stage, in the order they ran (printed after the table)."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, started: float) -> None:
        self.seconds[stage] = round(self.seconds.get(stage, 0.0) + time.perf_counter() - started, 1)


# ---- the vLLM side (runs inside .venv-vllm) --------------------------------------------------------------------------


def vllm_worker(job_path: str, out_path: str) -> None:
    """Run one vLLM generation job (JSON: target, prompts, max_new_tokens, stop_token_ids, speculative_config or
    null) and write {outputs, metrics, vllm_version, seconds}."""
    job = json.loads(Path(job_path).read_text())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    kwargs = {}
    if job["speculative_config"]:
        kwargs["speculative_config"] = job["speculative_config"]
        kwargs["hf_overrides"] = job.get("hf_overrides") or None
    llm = LLM(model=job["target"], dtype="float32", enforce_eager=True, max_model_len=job["max_model_len"],
              disable_log_stats=False, seed=0, max_num_seqs=1, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"],
                            stop_token_ids=job["stop_token_ids"])
    outputs = []
    for ids in job["prompts"]:  # one at a time, batch 1, as our eval
        result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        outputs.append(list(result.outputs[0].token_ids))
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = list(metric.values) if hasattr(metric, "values") else metric.value
    Path(out_path).write_text(json.dumps({"outputs": outputs, "metrics": metrics, "vllm_version": vllm.__version__,
                                          "seconds": round(time.perf_counter() - started, 1)}))


def run_vllm(job: dict, work: Path, label: str) -> dict:
    """One vLLM process (the worker above, in .venv-vllm) for `job`; its log goes to work/<label>.log."""
    job_path, out_path, log_path = work / f"{label}.job.json", work / f"{label}.out.json", work / f"{label}.log"
    job_path.write_text(json.dumps(job))
    env = {**os.environ, **VLLM_ENV}
    with log_path.open("w") as log:
        proc = subprocess.run([str(VLLM_PYTHON), __file__, "--vllm-worker", str(job_path), str(out_path)],
                              check=False, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    if proc.returncode != 0 or not out_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        raise RuntimeError(f"vLLM ({label}) failed with exit code {proc.returncode}; {log_path}:\n" + "\n".join(tail))
    return json.loads(out_path.read_text())


# ---- which head each case checks (runs in .venv) ---------------------------------------------------------------------


def head_source(path: Path, origin: str) -> HeadSource:
    """The HeadSource for a run directory or its head/ (the kind read from head_config.json); exits naming what is
    missing."""
    from mtp_train.errors import UserError
    from mtp_train.heads.io import read_head_config

    path = path.resolve()
    is_head = (path / "head_config.json").is_file()
    run_dir, head_dir = (path.parent, path) if is_head else (path, path / "head")
    for needed in (head_dir / "head_config.json", run_dir / "recipe.resolved.yaml"):
        if not needed.is_file():
            sys.exit(f"check_serving: {needed} not found ({origin}: expected a run directory or its head/)")
    try:
        kind = read_head_config(head_dir).kind
    except UserError as err:
        sys.exit(f"check_serving: {err}")
    return HeadSource(kind, run_dir, head_dir, origin)


def find_heads(head_arg: str | None, kinds: list[str], runs_dir: Path) -> dict[str, HeadSource | None]:
    """The head each kind in `kinds` checks: the entry of that kind in `head_arg` (HEAD: comma-separated run or head
    directories), else runs_dir/<its recipe's stem> when that holds a head, else None (a short run is trained)."""
    given: dict[str, HeadSource] = {}
    for entry in filter(None, (part.strip() for part in (head_arg or "").split(","))):
        source = head_source(Path(entry), f"HEAD={entry}")
        if source.kind in given:
            sys.exit(f"check_serving: HEAD names two {source.kind} heads ({given[source.kind].head_dir}, "
                     f"{source.head_dir}); give one per kind")
        if source.kind not in kinds:
            sys.exit(f"check_serving: HEAD={entry} is a {source.kind} head; the cases checked are for "
                     f"{', '.join(kinds)} heads (CASES in scripts/check_serving.py)")
        given[source.kind] = source
    found: dict[str, HeadSource | None] = {}
    for kind in kinds:
        demo_run = runs_dir / RECIPES[kind].stem
        if kind in given:
            found[kind] = given[kind]
        elif (demo_run / "head" / "head_config.json").is_file():
            found[kind] = head_source(demo_run, f"run {demo_run.relative_to(runs_dir.parent)}")
        else:
            found[kind] = None
    return found


def mtp_train(*args: str, cwd: Path = REPO) -> None:
    cmd = [sys.executable, "-m", "mtp_train", *args]
    print("$ mtp-train " + " ".join(args), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def short_run_overrides(kinds: list[str]) -> list[str]:
    """SHORT_DATA plus the one precompute.aux_layers every kind's recipe can read: the union of what the recipes
    store (an eagle3 head reads its three layers; an mtp head reads none and its reader skips them), so that all the
    short runs share one prepared data set and one feature cache (`prepare` / `precompute` of the second kind find
    them up to date)."""
    from mtp_train.recipe import load_recipe

    aux = sorted({j for kind in kinds for j in load_recipe(RECIPES[kind]).precompute.aux_layers})
    return [*SHORT_DATA, f"precompute.aux_layers=[{','.join(map(str, aux))}]"]


def train_short_heads(kinds: list[str], timer: Timer) -> dict[str, HeadSource]:
    """Train a short run of each kind's recipe (SHORT_DATA / SHORT_TRAIN) in runs/serve-check-<kind>."""
    started = time.perf_counter()
    mtp_train("fetch-assets", "--dataset", "sharegpt")  # the model comes with `make serve-check` (`make assets`)
    timer.add("fetch-assets", started)
    shared = short_run_overrides(kinds)
    trained = {}
    for kind in kinds:
        sets = [arg for item in [f"name={SHORT_NAME}-{kind}", *shared, *SHORT_TRAIN] for arg in ("--set", item)]
        for stage in ("prepare", "precompute", "train"):
            started = time.perf_counter()
            mtp_train(stage, "--recipe", str(RECIPES[kind]), *sets)
            timer.add(f"{stage} ({kind})", started)
        trained[kind] = head_source(REPO / "runs" / f"{SHORT_NAME}-{kind}", "short run")
    return trained


def build_tiny_deepseek_v3(directory: Path, seed: int = 0) -> Path:
    """A tiny random DeepSeek-V3 target (TINY_DEEPSEEK_V3, transformers' own model, fp32) with SmolLM2's tokenizer
    files, saved as an HF directory. Norm weights and the router's correction bias are moved off their init so that
    both engines apply them; layer 0's o_proj and down_proj are scaled by LAYER0_SCALE. config.json also spells out
    `topk_method: noaux_tc` and `scoring_func: sigmoid` (what DeepSeek-V3 ships and transformers' DeepseekV3 always
    computes, but transformers 5 does not write): vLLM's DeepseekV2MoE reads both with getattr defaults (None: no
    correction bias; "softmax"), so without them vLLM would serve another model."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TINY_DEEPSEEK_V3)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
                param.mul_(LAYER0_SCALE)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.3)
    model.save_pretrained(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    config_path.write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER_SOURCE / name, directory / name)
    return directory


def agreeing_head(recipe, head_dir: Path, seed: int = 0) -> None:
    """The MTP head of the deepseek-mtp case (see HIDDEN_MIX): `DraftHead.from_target` with the recipe's head config
    (init last_layer: the target's layer 1 and final norm), then eh_proj [d, 2d] = [r I | r HIDDEN_MIX N(0, 1)] (r:
    the mean RMS of the embedding rows, so that the block's residual stream has the target's scale) and hnorm
    perturbed; saved with `save_head` (fp32)."""
    import torch

    from mtp_train.heads.draft_head import DraftHead
    from mtp_train.heads.io import save_head
    from mtp_train.runtime.loader import load_model

    target = load_model(recipe.target.path, dtype="float32", device="cpu")
    head = DraftHead.from_target(target, recipe.head.head_config(target.config, target.fingerprint),
                                 dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    d = target.config.hidden_size
    with torch.no_grad():
        embed_rms = target.model.embed_tokens.weight.float().pow(2).mean(dim=-1).sqrt().mean()
        head.eh_proj.weight[:, :d].copy_(torch.eye(d) * embed_rms)
        head.eh_proj.weight[:, d:].copy_(torch.randn(d, d, generator=gen) * (HIDDEN_MIX * embed_rms))
        head.hnorm.weight.add_(torch.randn(d, generator=gen) * 0.1)
    save_head(head, head_dir)


def deepseek_head(timer: Timer) -> HeadSource:
    """The deepseek-mtp case's head: runs/DEEPSEEK_NAME/head if it is there, else the tiny target (WORK/deepseek-mtp/
    target, built if missing), `prepare` on it (the held-out prompts; DEEPSEEK_SETS on the mtp recipe), the agreeing
    head, and the run's recipe.resolved.yaml."""
    from mtp_train.recipe import load_recipe, save_resolved

    run_dir = REPO / "runs" / DEEPSEEK_NAME
    target = WORK / "deepseek-mtp" / "target"
    if (target / "model.safetensors").is_file() and (run_dir / "head" / "head_config.json").is_file():
        return head_source(run_dir, f"run runs/{DEEPSEEK_NAME}")
    if not (target / "model.safetensors").is_file():
        started = time.perf_counter()
        target.mkdir(parents=True, exist_ok=True)
        build_tiny_deepseek_v3(target)
        timer.add("tiny DeepSeek-V3 target", started)
    started = time.perf_counter()
    mtp_train("fetch-assets", "--dataset", "sharegpt")
    timer.add("fetch-assets", started)
    sets = [*DEEPSEEK_SETS, f"target.path={target}"]
    started = time.perf_counter()
    mtp_train("prepare", "--recipe", str(RECIPES["mtp"]), *[a for item in sets for a in ("--set", item)])
    timer.add("prepare (deepseek-mtp)", started)
    recipe = load_recipe(RECIPES["mtp"], sets)
    agreeing_head(recipe, run_dir / "head")
    save_resolved(recipe, run_dir)
    return head_source(run_dir, "made here")


# ---- our side (runs in .venv) ----------------------------------------------------------------------------------------


def resolve_paths(recipe_path: Path, run_dir: Path) -> list[str]:
    """--set overrides that make the run's relative recipe paths (target, prepared data) absolute: relative to the
    current directory if they exist there, else to the repository the run was made in (<repo>/runs/<name>)."""
    import yaml

    recipe = yaml.safe_load(recipe_path.read_text())
    bases = [Path.cwd(), run_dir.parent.parent]
    sets = []
    for key, value in (("target.path", recipe["target"]["path"]), ("data.output_dir", recipe["data"]["output_dir"])):
        found = next((base / value for base in bases if (base / value).exists()), None)
        if found is None:
            sys.exit(f"check_serving: {key}={value} not found under {', '.join(map(str, bases))}")
        sets.append(f"{key}={found.resolve()}")
    return sets


def masked_mtp_train(argv: list[str]) -> int:
    """`mtp-train <argv>` with every MTP head's token embedding zeroed at position 0, as vLLM's DeepSeekMTP layer
    does (vllm/model_executor/models/deepseek_mtp.py, DeepSeekMultiTokenPredictorLayer.forward: `torch.where(
    positions.unsqueeze(-1) == 0, 0, inputs_embeds)`): DraftHead._forward's embedding lookup is wrapped for the
    call. For the comparison only; our runtime ships without the mask."""
    import types

    import torch
    import torch.nn.functional as F

    from mtp_train.cli import main as cli_main
    from mtp_train.heads import draft_head

    forward = draft_head.DraftHead._forward

    def masked_forward(self, token_ids, hidden, batch, kv_cache):
        def embedding(ids, weight, *args, **kwargs):
            embeds = F.embedding(ids, weight, *args, **kwargs)  # [T, d]
            if ids is token_ids:
                at_zero = (batch.positions == 0).to(embeds.device).unsqueeze(-1)  # [T, 1]
                embeds = torch.where(at_zero, torch.zeros_like(embeds), embeds)
            return embeds

        draft_head.F = types.SimpleNamespace(**{**vars(F), "embedding": embedding})
        try:
            return forward(self, token_ids, hidden, batch, kv_cache)
        finally:
            draft_head.F = F

    draft_head.DraftHead._forward = masked_forward
    return cli_main(argv)


def our_eval(recipe: Path, sets: list[str], export_dir: Path, out: Path, k: int, limit: int, max_new: int,
             mask_position_0: bool = False) -> dict:
    """`mtp-train eval --head EXPORT` (fp32 decode, greedy), returning its report's <head>@k=K entry; with
    `mask_position_0`, run as `masked_mtp_train`."""
    args = ["eval", "--recipe", str(recipe), "--head", str(export_dir), "--out", str(out), "--no-prompt-lookup",
            "--num-speculative-tokens", str(k), "--limit", str(limit), "--max-new-tokens", str(max_new)]
    for item in [*sets, "precision.compute=float32", "precision.decode=float32", "target.device=cpu",
                 "eval.temperature=0.0", "eval.cost_curve=false"]:
        args += ["--set", item]
    if mask_position_0:
        print("$ mtp-train (position 0 masked as in vLLM) " + " ".join(args), flush=True)
        subprocess.run([sys.executable, __file__, "--masked-mtp-train", *args], cwd=REPO, check=True)
    else:
        mtp_train(*args)
    report = json.loads((out / "report.json").read_text())
    key = next(name for name in report["overall"] if name.endswith(f"@k={k}") and name != f"lookup@k={k}")
    return report["overall"][key]


# ---- the comparison --------------------------------------------------------------------------------------------------


def vllm_acceptance(metrics: dict, k: int) -> tuple[float, list[float]]:
    """(mean acceptance length, acceptance per position) from vLLM's spec-decode counters: 1 + accepted / drafts, and
    accepted at position j / drafts (every draft proposes k tokens; position j's token counts when 1..j all are)."""
    drafts = float(metrics.get("vllm:spec_decode_num_drafts") or 0)
    accepted = float(metrics.get("vllm:spec_decode_num_accepted_tokens") or 0)
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * k
    if not drafts:
        return 0.0, [0.0] * k
    return 1.0 + accepted / drafts, [float(a) / drafts for a in per_pos]


def compare(case: Case, ours_pos: list[float], plain_outputs: list[list[int]], spec_outputs: list[list[int]],
            metrics: dict, k: int) -> dict:
    """The checks of one case: vLLM's speculative outputs equal its plain ones; vLLM's mean acceptance length and
    per-position acceptance within TOLERANCE of ours; ours above MIN_ACCEPTANCE at position 1. `ours_pos`: our
    acceptance per position (report.json); vLLM's mean acceptance length counts proposals before the output is cut at
    max_tokens, so ours in the same terms is 1 + their sum (report.json's mean_acceptance_length counts committed
    tokens after that cut, so it is lower by the last step's excess). Returns the result row, `failures` naming each
    failed check."""
    mal, per_pos = vllm_acceptance(metrics, k)
    prompts = len(plain_outputs)
    identical = sum(a == b for a, b in zip(plain_outputs, spec_outputs))
    ours_mal = 1.0 + sum(ours_pos)
    pos_diff = max(abs(a - b) for a, b in zip(per_pos, ours_pos))
    failures = []
    if identical != prompts or len(spec_outputs) != prompts:
        failures.append(f"vLLM speculative output differs from plain on {prompts - identical}/{prompts} prompts")
    if abs(mal - ours_mal) > TOLERANCE:
        failures.append(f"mean acceptance length ours {ours_mal:.3f} vs vLLM {mal:.3f} (tolerance {TOLERANCE})")
    if pos_diff > TOLERANCE:
        failures.append(f"per-position acceptance differs by up to {pos_diff:.3f} (tolerance {TOLERANCE})")
    if not ours_pos or ours_pos[0] <= MIN_ACCEPTANCE:
        first = ours_pos[0] if ours_pos else 0.0
        failures.append(f"our acceptance at position 1 is {first:.3f} <= {MIN_ACCEPTANCE}: the head drafts too little "
                        "for the comparison to mean anything (train it longer)")
    return {"case": case.name, "prompts": prompts, "identical": identical,
            "ours_mal": round(ours_mal, 4), "vllm_mal": round(mal, 4),
            "ours_pos": [round(a, 4) for a in ours_pos], "vllm_pos": [round(a, 4) for a in per_pos],
            "failures": failures, "ok": not failures}


def summary_table(results: list[dict]) -> list[str]:
    """The markdown table of the results (one row per case; an error row for a case that did not run)."""
    header = "| case | head | prompts | vLLM spec == plain | mean acc. length ours / vLLM | per position ours / vLLM | ok |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | {r.get('head', '-')} | - | - | - | error: {r['error'].splitlines()[0]} "
                         "| FAIL |")
            continue
        pos = ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(r["ours_pos"], r["vllm_pos"]))
        lines.append(f"| {r['case']} | {r.get('head', '-')} | {r['prompts']} | {r['identical']}/{r['prompts']} | "
                     f"{r['ours_mal']:.3f} / {r['vllm_mal']:.3f} | {pos} | {'ok' if r['ok'] else 'FAIL'} |")
    return lines


def result_line(results: list[dict]) -> str:
    """`RESULT ok=... <case>_acceptance_ours=... <case>_acceptance_vllm=... <case>_pos1_ours=...
    <case>_identical_outputs=n/N ... vllm=<version> tolerance=... min_pos1=...`: ok only if every case ran and
    passed."""
    fields = []
    for r in results:
        name = r["case"].replace("/", "_")
        if "error" in r:
            fields.append(f"{name}=error")
            continue
        fields += [f"{name}_acceptance_ours={r['ours_mal']:.3f}", f"{name}_acceptance_vllm={r['vllm_mal']:.3f}",
                   f"{name}_pos1_ours={r['ours_pos'][0]:.3f}", f"{name}_identical_outputs={r['identical']}/{r['prompts']}"]
    version = next((r["vllm_version"] for r in results if "vllm_version" in r), "unknown")
    ok = bool(results) and all(r.get("ok") for r in results)
    return (f"RESULT ok={str(ok).lower()} {' '.join(fields)} vllm={version} tolerance={TOLERANCE} "
            f"min_pos1={MIN_ACCEPTANCE}")


# ---- one case --------------------------------------------------------------------------------------------------------


def check_case(case: Case, source: HeadSource, args, plain_runs: dict[str, dict], timer: Timer) -> dict:
    """Export `source`'s head for `case`, evaluate it with our engine and with vLLM, and compare (`compare`).
    `plain_runs`: vLLM's plain outputs by job (the target alone does not depend on the case: run once)."""
    from mtp_train.evaluate.prompts import load_heldout
    from mtp_train.export import export_head
    from mtp_train.runtime.chat import stop_token_ids
    from mtp_train.runtime.config import load_config
    from mtp_train.runtime.loader import load_tokenizer

    work = WORK / case.format
    work.mkdir(parents=True, exist_ok=True)
    k = args.k or case.k or 3
    sets = resolve_paths(source.recipe, source.run_dir)
    target_dir = Path(sets[0].split("=", 1)[1])
    prepared_dir = Path(sets[1].split("=", 1)[1])
    started = time.perf_counter()
    export_dir = export_head(source.head_dir, case.format, work / "export", target_dir, dtype="float32",
                             overwrite=True, num_speculative_tokens=k)
    timer.add(f"export ({case.name})", started)

    started = time.perf_counter()
    ours = our_eval(source.recipe, sets, export_dir, work / "ours", k, args.limit, args.max_new_tokens)
    timer.add(f"our eval ({case.name})", started)
    shipped = ours
    if case.mask_position_0:
        started = time.perf_counter()
        ours = our_eval(source.recipe, sets, export_dir, work / "ours-position-0-masked", k, args.limit,
                        args.max_new_tokens, mask_position_0=True)
        timer.add(f"our eval, position 0 masked ({case.name})", started)

    prompts = [p.prompt_ids for p in load_heldout(prepared_dir, args.limit).prompts]
    stops = list(stop_token_ids(load_tokenizer(str(target_dir)), load_config(target_dir)))
    longest = max(len(p) for p in prompts) + args.max_new_tokens + k + 8
    job = {"target": str(target_dir), "prompts": prompts, "max_new_tokens": args.max_new_tokens,
           "stop_token_ids": stops, "max_model_len": longest, "speculative_config": None}
    plain_key = json.dumps(job, sort_keys=True)
    if plain_key not in plain_runs:
        started = time.perf_counter()
        plain_runs[plain_key] = run_vllm(job, work, "vllm-plain")
        timer.add(f"vLLM plain ({case.name})", started)
    plain = plain_runs[plain_key]
    spec_config = {"method": case.method, "model": str(export_dir), "num_speculative_tokens": k}
    started = time.perf_counter()
    spec = run_vllm({**job, "speculative_config": spec_config, "hf_overrides": case.hf_overrides}, work, "vllm-spec")
    timer.add(f"vLLM speculative ({case.name})", started)

    result = compare(case, ours["acceptance_per_position"], plain["outputs"], spec["outputs"], spec["metrics"], k)
    result.update({"head": source.origin, "head_dir": str(source.head_dir), "ours_tau": ours.get("tau"),
                   "ours_compared": "position 0 masked as in vLLM" if case.mask_position_0 else "as shipped",
                   "ours_unmasked_pos": shipped["acceptance_per_position"],
                   "vllm_version": spec["vllm_version"],
                   "vllm_seconds": {"plain": plain["seconds"], "spec": spec["seconds"]}})
    (work / "result.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    if sys.argv[1:2] == ["--masked-mtp-train"]:  # our eval as vLLM's MTP layer computes (Case.mask_position_0)
        return masked_mtp_train(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--head", default=os.environ.get("HEAD") or None,
                        help="run directories or their head/, comma-separated, at most one per head kind (default: "
                             "$HEAD; a kind not named: runs/<its recipe's stem>, else a short run trained here)")
    parser.add_argument("--cases", default=os.environ.get("CASES") or None,
                        help="comma-separated formats to check (default: $CASES, else every case of CASES)")
    parser.add_argument("--k", type=int, default=None,
                        help="speculative tokens (default: the case's own, e.g. deepseek-mtp's 1, else 3)")
    parser.add_argument("--limit", type=int, default=10, help="held-out prompts (default 10, as the demo's eval)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return 0
    if not VLLM_PYTHON.is_file():
        sys.exit(f"check_serving: {VLLM_PYTHON} not found; run `make serve-check` (it builds .venv-vllm)")
    wanted = [name.strip() for name in args.cases.split(",")] if args.cases else [c.format for c in CASES]
    known = CASES + OPTIONAL_CASES
    unknown = sorted(set(wanted) - {c.format for c in known})
    if unknown:
        sys.exit(f"check_serving: unknown case(s) {', '.join(unknown)}; the cases are "
                 f"{', '.join(c.format for c in known)}")
    cases = [c for c in known if c.format in wanted]
    kinds = list(dict.fromkeys(c.kind for c in cases if not c.own_target))

    timer = Timer()
    begun = time.perf_counter()
    heads = find_heads(args.head, kinds, REPO / "runs")
    missing = [kind for kind, source in heads.items() if source is None]
    if missing:
        print(f"check_serving: no {', '.join(missing)} head given or trained; training short runs "
              f"(runs/{SHORT_NAME}-<kind>)", flush=True)
        heads.update(train_short_heads(missing, timer))
    own_heads = {c.format: deepseek_head(timer) for c in cases if c.own_target}
    head_of = {c.format: own_heads.get(c.format) or heads[c.kind] for c in cases}
    for case in cases:
        print(f"check_serving: {case.name}: head {head_of[case.format].head_dir} ({head_of[case.format].origin})",
              flush=True)

    results, plain_runs = [], {}
    for case in cases:
        try:
            results.append(check_case(case, head_of[case.format], args, plain_runs, timer))
        except (RuntimeError, subprocess.CalledProcessError) as err:
            results.append({"case": case.name, "head": head_of[case.format].origin, "ok": False, "error": str(err)})
            print(err, file=sys.stderr)

    print()
    print("\n".join(summary_table(results)))
    for r in results:
        if r.get("ours_compared", "as shipped") != "as shipped":
            print(f"{r['case']}: ours compared {r['ours_compared']}; ours as shipped: acceptance per position "
                  f"{', '.join(f'{a:.3f}' for a in r['ours_unmasked_pos'])}")
        for failure in r.get("failures", []):
            print(f"FAIL {r['case']}: {failure}")
    print(f"Checks: vLLM speculative == vLLM plain on every prompt; mean acceptance length and each position within "
          f"{TOLERANCE} of ours; ours at position 1 > {MIN_ACCEPTANCE} (the heads draft something).")
    stages = ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in timer.seconds.items())
    print(f"Time: {time.perf_counter() - begun:.0f} s in all ({stages})")
    print(result_line(results))
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
