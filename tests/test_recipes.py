"""Every recipe in recipes/ validates, its DeepSpeed JSON agrees with it, the production recipes are sized as their
comments (and docs/scaling.md) say, and scripts/launch_multinode.sh builds the torchrun command it documents."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from mtp_train.errors import UserError
from mtp_train.recipe import load_recipe

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO_ROOT / "recipes").glob("*.yaml"))
DEEPSPEED_JSONS = sorted((REPO_ROOT / "recipes" / "deepspeed").glob("*.json"))
PRODUCTION = {
    "llama-3.1-8b-mtp": {"ranks": 8, "zero": 2, "storage": "bfloat16"},
    "llama-3.1-8b-eagle3": {"ranks": 8, "zero": 2, "storage": "bfloat16"},
    "llama-3.3-70b-mtp": {"ranks": 8, "zero": 2, "storage": "float8_e4m3"},
    "qwen2.5-coder-1.5b-mtp": {"ranks": 8, "zero": 1, "storage": "bfloat16"},
}
# Keys the trainer owns (deepspeed_config() fills them from the recipe and rejects different values).
TRAINER_OWNED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


@pytest.fixture(autouse=True)
def _repo_root_cwd(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # recipe paths (train.deepspeed_config) are relative to the repository root


def _validate_with_deepspeed(config: dict, grad_accum: int) -> None:
    """DeepSpeed's own parser (pydantic, unknown zero_optimization keys rejected), outside torch.distributed: it then
    sees world size 1, so the global batch is checked for one rank."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig({**config, "train_batch_size": grad_accum})
    assert parsed.zero_optimization_stage == config["zero_optimization"]["stage"]


def test_recipes_exist() -> None:
    names = {path.stem for path in RECIPES}
    assert {"smollm2-135m-mtp", *PRODUCTION} <= names
    assert {path.name for path in DEEPSPEED_JSONS} >= {"zero1.json", "zero2.json", "zero3.json"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_validates_and_agrees_with_its_deepspeed_config(path: Path) -> None:
    from mtp_train.train.trainer import deepspeed_config

    recipe = load_recipe(path)
    assert recipe.name == path.stem
    world_size = PRODUCTION.get(recipe.name, {}).get("ranks", 8)
    config = deepspeed_config(recipe, world_size=world_size, use_bf16=True)
    train = recipe.train
    assert config["zero_optimization"]["stage"] == train.zero_stage
    assert config["train_micro_batch_size_per_gpu"] == 1
    assert config["gradient_accumulation_steps"] == train.grad_accum
    assert config["train_batch_size"] == train.grad_accum * world_size
    assert config["gradient_clipping"] == train.clip  # the JSON does not silently override train.clip
    assert config["bf16"]["enabled"] is True
    if train.deepspeed_config:
        assert (REPO_ROOT / train.deepspeed_config).is_file()
        assert Path(train.deepspeed_config).parent == Path("recipes/deepspeed")
    _validate_with_deepspeed(config, train.grad_accum)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_evaluates_on_prompts_a_clone_has(path: Path) -> None:
    """`eval.prompts` is null (the held-out split), a built-in set, or a file of the repository: nothing to fetch."""
    from mtp_train.evaluate.prompts import load_mt_bench

    prompts = load_recipe(path).eval.prompts
    assert prompts is None or load_mt_bench(prompts, limit=1).prompts


@pytest.mark.parametrize("name", sorted(PRODUCTION))
def test_production_recipes_are_sized_for_h100_nodes(name: str) -> None:
    expected = PRODUCTION[name]
    recipe = load_recipe(REPO_ROOT / "recipes" / f"{name}.yaml")
    assert recipe.precision.compute == "bfloat16" and recipe.target.device == "cuda"
    assert recipe.target.path.startswith("data/models/")
    assert 2048 <= recipe.data.max_seq_len <= 4096
    assert len(recipe.data.sources) >= 2
    assert recipe.precision.features == expected["storage"]
    assert recipe.train.zero_stage == expected["zero"]
    assert recipe.train.deepspeed_config == f"recipes/deepspeed/zero{expected['zero']}.json"
    assert 16384 <= recipe.train.micro_batch_tokens <= 32768
    assert 1e-4 <= recipe.train.lr <= 3e-4 and recipe.train.warmup_steps >= 100
    assert recipe.train.unroll_steps == 3
    assert recipe.train.micro_batch_tokens >= recipe.data.max_seq_len  # a micro-batch holds the longest sample
    global_tokens = recipe.train.micro_batch_tokens * recipe.train.grad_accum * expected["ranks"]
    assert 2**18 <= global_tokens <= 2**20
    assert max(recipe.eval.num_speculative_tokens) >= 3  # prompts: a file, or null = the held-out split
    wandb = recipe.tracking.wandb
    assert wandb.mode == "online" and wandb.group and wandb.project == "mtp-train"


def test_the_gpu_quick_start_recipe_runs_the_target_in_vllm() -> None:
    """The README's GPU quick start: an EAGLE-3 head whose features and acceptance come from vLLM, one engine per
    GPU (torchrun ranks), aux layers as vLLM's default for 32 layers, the draft vocabulary kept by the eagle3 export."""
    recipe = load_recipe(REPO_ROOT / "recipes" / "llama-3.1-8b-eagle3.yaml")
    assert recipe.precompute.backend == "vllm" and recipe.eval.engine == "vllm"
    assert recipe.precompute.vllm.tensor_parallel_size == 1 and recipe.target.tensor_parallel == 1
    assert recipe.head.kind == "eagle3" and recipe.precompute.aux_layers == [1, 15, 28]
    assert recipe.head.draft_vocab_size == 32768


def test_70b_on_two_nodes_keeps_the_global_batch() -> None:
    from mtp_train.train.trainer import deepspeed_config

    one_node = load_recipe(REPO_ROOT / "recipes" / "llama-3.3-70b-mtp.yaml")
    two_nodes = load_recipe(REPO_ROOT / "recipes" / "llama-3.3-70b-mtp.yaml", ["train.grad_accum=2"])
    config = deepspeed_config(two_nodes, world_size=16, use_bf16=True)
    assert config["train_batch_size"] == 32 and config["gradient_accumulation_steps"] == 2
    assert (one_node.train.micro_batch_tokens * one_node.train.grad_accum * 8
            == two_nodes.train.micro_batch_tokens * two_nodes.train.grad_accum * 16 == 524_288)
    # Without the override 16 ranks double the global batch; still a valid config.
    assert deepspeed_config(one_node, world_size=16, use_bf16=True)["train_batch_size"] == 64


@pytest.mark.parametrize("path", DEEPSPEED_JSONS, ids=lambda p: p.name)
def test_deepspeed_jsons_leave_batch_and_clipping_to_the_recipe(path: Path) -> None:
    from mtp_train.train.trainer import deepspeed_config

    raw = json.loads(path.read_text())
    for key in (*TRAINER_OWNED, "gradient_clipping"):
        assert key not in raw, f"{path.name} sets {key}; the recipe owns it"
    stage = raw["zero_optimization"]["stage"]
    assert path.name == f"zero{stage}.json"
    recipe = load_recipe(REPO_ROOT / "recipes" / "smollm2-135m-mtp.yaml",
                         [f"train.deepspeed_config=recipes/deepspeed/{path.name}", f"train.zero_stage={stage}",
                          "train.grad_accum=3"])
    config = deepspeed_config(recipe, world_size=8, use_bf16=True)
    assert config["train_batch_size"] == 24
    assert config["zero_optimization"] == raw["zero_optimization"]
    _validate_with_deepspeed(config, recipe.train.grad_accum)
    # A recipe whose zero stage disagrees with the JSON is refused, naming both.
    other = 2 if stage != 2 else 1
    mismatched = load_recipe(REPO_ROOT / "recipes" / "smollm2-135m-mtp.yaml",
                             [f"train.deepspeed_config=recipes/deepspeed/{path.name}", f"train.zero_stage={other}"])
    with pytest.raises(UserError, match=rf"zero_optimization.stage={stage} but the recipe's train.zero_stage={other}"):
        deepspeed_config(mismatched, world_size=8, use_bf16=True)


# --- the sizes docs/scaling.md and the recipe comments quote ------------------------------------------------------

# name: (transformers config class, config kwargs, target params, head params)
MODELS = {
    "SmolLM2-135M": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
                     134_515_008, 4_205_376),
    "Qwen2.5-Coder-1.5B": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                           num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                           tie_word_embeddings=True), 1_543_714_304, 51_521_024),
    "Llama-3.1-8B": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
                     8_030_261_248, 251_678_720),
    "Llama-3.3-70B": ("LlamaConfig", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
                      70_553_706_496, 989_896_704),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_documented_parameter_counts(name: str, tmp_path: Path) -> None:
    """Target and MTP-head parameter counts, built on the meta device from each model's published config shape."""
    import torch
    import transformers

    from mtp_train.heads import DraftHead, HeadConfig
    from mtp_train.runtime.config import load_config
    from mtp_train.runtime.model import CausalLM

    class_name, kwargs, target_params, head_params = MODELS[name]
    getattr(transformers, class_name)(**kwargs).save_pretrained(str(tmp_path))
    config = load_config(tmp_path)
    with torch.device("meta"):
        target = CausalLM(config)
        head = DraftHead(config, HeadConfig.for_target(config, kind="mtp"), target.model.embed_tokens, target.lm_head)
    unique = {id(p): p for p in target.parameters()}  # tied embeddings count once
    assert sum(p.numel() for p in unique.values()) == target_params
    assert sum(p.numel() for p in head.parameters()) == head_params


# --- scripts/launch_multinode.sh ------------------------------------------------------------------------------------

SCRIPT = REPO_ROOT / "scripts" / "launch_multinode.sh"


def _launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "RDZV_ID")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env={**clean, **env},
                          timeout=30, check=False)


def test_launch_script_syntax_and_help() -> None:
    assert os.access(SCRIPT, os.X_OK)
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    text = SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    result = _launch("--help")
    assert result.returncode == 0 and "NNODES=2 NODE_RANK=1 MASTER_ADDR=" in result.stdout
    if shutil.which("shellcheck"):
        assert subprocess.run(["shellcheck", str(SCRIPT)], check=False).returncode == 0


def test_launch_script_builds_the_torchrun_command() -> None:
    result = _launch("--dry-run", "train", "--recipe", "recipes/llama-3.3-70b-mtp.yaml", "--set", "train.grad_accum=2",
                     NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29600")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29600",
        "--rdzv-id=mtp-train-29600", "--rdzv-conf=is_host=0", "-m", "mtp_train", "train",
        "--recipe", "recipes/llama-3.3-70b-mtp.yaml", "--set", "train.grad_accum=2",
    ]
    # Options override the environment; node 0 hosts the rendezvous store.
    result = _launch("--dry-run", "--nnodes=2", "--node-rank", "0", "--master-addr", "h0", "--gpus-per-node", "4",
                     "--", "precompute", "--recipe", "r.yaml", NNODES="3")
    assert result.returncode == 0, result.stderr
    assert "--nnodes=2 --nproc-per-node=4" in result.stdout and "--rdzv-conf=is_host=1" in result.stdout
    assert "--rdzv-endpoint=h0:29500" in result.stdout and result.stdout.rstrip().endswith("precompute --recipe r.yaml")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("train",), {"NNODES": "2"}, "MASTER_ADDR (node 0's address) is required"),
        (("eval",), {}, "SUBCOMMAND must be precompute or train"),
        ((), {}, "missing SUBCOMMAND"),
        (("--node-rank", "2", "train"), {"NNODES": "2", "MASTER_ADDR": "h"}, "NODE_RANK must be an integer in 0..1"),
        (("--gpus-per-node", "x", "train"), {}, "GPUS_PER_NODE must be an integer >= 1"),
        (("--bogus", "train"), {}, "unknown option --bogus"),
        (("--nnodes",), {}, "--nnodes needs a value"),
    ],
)
def test_launch_script_rejects_bad_input(args: tuple, env: dict, message: str) -> None:
    result = _launch("--dry-run", *args, **env)
    assert result.returncode == 2 and message in result.stderr


# --- what the recipes' comments promise: files that exist or a named command that makes them -----------------------

def _comments(path: Path) -> list[str]:
    """The text of every comment line of a recipe (`#` and what follows it, stripped)."""
    return [line.split("#", 1)[1].strip() for line in path.read_text(encoding="utf-8").splitlines() if "#" in line]


def _header(path: Path) -> str:
    """The comment block at the top of a recipe, before its first key."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return "\n".join(lines)


def _fetched_assets() -> dict[str, str]:
    """Path (relative to the repository root) of each asset `mtp-train fetch-assets` makes → the option that makes
    it; the whole directory of each is replaced when it is (re)built."""
    from mtp_train.assets import catalogue

    made = {f"data/models/{name}": f"--model {name}" for name in catalogue.MODELS}
    made.update({f"data/datasets/{name}/{spec.filename}": f"--dataset {name}"
                 for name, spec in catalogue.DATASETS.items()})
    return made


def _named_paths(recipe) -> dict[str, str]:
    """The recipe keys that name a file or directory to read, with their values. eval.prompts is left to the eval
    prompt sets' own tests (it may name a prompt set shipped with the package)."""
    paths = {"target.path": recipe.target.path, "data.chat_template": recipe.data.chat_template,
             "train.deepspeed_config": recipe.train.deepspeed_config}
    paths.update({f"data.sources[{i}].path": source.path for i, source in enumerate(recipe.data.sources)})
    return {key: value for key, value in paths.items() if value is not None}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_file_a_recipe_reads_is_shipped_or_made_by_a_command_it_names(path: Path) -> None:
    """A path outside data/ is a file of the repository; a path under data/ (not part of the repository) is made by
    `mtp-train fetch-assets` with the option the recipe's comments name, or the recipe's header names it beside the
    command that makes it (`hf download ... --local-dir`, `save_to_disk(...)`, a conversion) or says it is the user's
    own. A download never lands inside a fetched asset's directory, which fetch-assets replaces whole."""
    from mtp_train.assets.catalogue import DEFAULT_MODEL

    recipe = load_recipe(path)
    comments = "\n".join(_comments(path))
    header = _header(path)
    fetched = _fetched_assets()
    for key, value in _named_paths(recipe).items():
        if not value.startswith("data/"):
            assert (REPO_ROOT / value).is_file(), f"{path.name}: {key}={value} is not a file of the repository"
        elif value in fetched:
            option = fetched[value]
            plain = value == f"data/models/{DEFAULT_MODEL}" and "`mtp-train fetch-assets`" in comments
            assert plain or ("fetch-assets" in comments and option in comments), (
                f"{path.name}: {key}={value} is made by `mtp-train fetch-assets {option}`; the recipe must say so")
        else:
            downloaded_into = re.findall(r"--local-dir (\S+)", header)
            assert value in header or any(value == d or value.startswith(d + "/") for d in downloaded_into), (
                f"{path.name}: {key}={value}: the recipe's header must say where it comes from")
            assert any(marker in header for marker in ("hf download", "save_to_disk", "is yours", "yours to make")), (
                f"{path.name}: {key}={value}: the header names no command that makes it")
            for asset in fetched:
                directory = asset if asset.startswith("data/models/") else asset.rsplit("/", 1)[0]
                assert not value.startswith(directory + "/"), (
                    f"{path.name}: {key}={value} lies in {directory}/, which fetch-assets replaces whole")


def _quoted_commands(path: Path) -> list[list[str]]:
    """The `mtp-train ...` commands (also `torchrun ... -m mtp_train ...`) a recipe's comments quote on lines of their
    own, continuation lines joined, as the argument lists after `mtp-train`; a command shown elided (`...`) is left
    out."""
    pattern = re.compile(r"^(?:Run:\s+)?(?:[A-Z_]+=\S+\s+)*(?:mtp-train|torchrun\s.*?-m mtp_train)\s+(.*)$")
    commands, pending = [], ""
    for text in _comments(path):
        if pending:
            text, pending = pending + " " + text, ""
        elif not pattern.match(text):
            continue
        if text.endswith("\\"):
            pending = text[:-1].strip()
            continue
        body = pattern.match(text).group(1).split(" # ")[0]
        if "..." not in body and " / " not in body:
            commands.append(shlex.split(body))
    return commands


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_commands_quoted_in_a_recipe_parse_and_name_that_recipe(path: Path) -> None:
    from mtp_train.cli import build_parser

    parser = build_parser()
    commands = _quoted_commands(path)
    assert commands or path.stem == "smollm2-135m-mtp"  # the default recipe's header quotes none; the others do
    for argv in commands:
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{path.name}: `mtp-train {' '.join(argv)}` does not parse")
        recipe = getattr(args, "recipe", None)
        if "--recipe" in argv:
            assert recipe == f"recipes/{path.name}", f"{path.name}: `mtp-train {' '.join(argv)}` names another recipe"


def test_the_eagle3_demo_recipe_names_every_key_it_changes_from_the_default() -> None:
    """Its header lists what differs from the default recipe; the keys derived from `name` aside."""
    from mtp_train.recipe import flatten_recipe, recipe_to_dict

    default = flatten_recipe(recipe_to_dict(load_recipe(REPO_ROOT / "recipes" / "smollm2-135m-mtp.yaml")))
    path = REPO_ROOT / "recipes" / "smollm2-135m-eagle3.yaml"
    eagle3 = flatten_recipe(recipe_to_dict(load_recipe(path)))
    derived = {"name", "data.output_dir", "precompute.output_dir", "train.run_dir", "tracking.wandb.run_name"}
    changed = sorted(key for key in default.keys() - derived if default[key] != eagle3[key])
    assert changed == ["head.kind", "precompute.aux_layers", "train.epochs", "train.loss_rows",
                       "train.micro_batch_tokens", "train.unroll_steps"]
    header = _header(path)
    assert [key for key in changed if key not in header and f"`{key.split('.')[-1]}" not in header] == []



def test_a_recipe_that_lists_only_its_changes_lists_no_default() -> None:
    """A recipe whose header says it lists only the keys that differ from the schema defaults does."""
    import yaml

    from mtp_train.recipe import Recipe

    def listed_defaults(node: dict, value, default, prefix: str) -> list[str]:
        found = []
        for key, sub in node.items():
            if isinstance(sub, dict):
                found += listed_defaults(sub, getattr(value, key), getattr(default, key), f"{prefix}{key}.")
            elif getattr(value, key) == getattr(default, key):
                found.append(f"{prefix}{key}")
        return found

    claiming = [path for path in RECIPES
                if "Only the keys that differ from the schema defaults are listed" in _header(path)]
    assert [path.stem for path in claiming] == ["smollm2-135m-mtp-long"]
    for path in claiming:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert listed_defaults(raw, load_recipe(path), Recipe(name=path.stem), "") == [], path.name

def test_the_recipes_table_of_the_docs_lists_every_recipe_as_it_is() -> None:
    """docs/recipes.md has a row per shipped recipe whose target and head kind are the recipe's."""
    rows = [line for line in (REPO_ROOT / "docs" / "recipes.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| [")]
    by_name = {row.split("](../recipes/", 1)[1].split(".yaml)", 1)[0]: row.split(" | ") for row in rows}
    assert sorted(by_name) == sorted(path.stem for path in RECIPES)
    for name, cells in by_name.items():
        recipe = load_recipe(REPO_ROOT / "recipes" / f"{name}.yaml")
        assert cells[1] == f"`{recipe.target.path}`", name
        assert cells[2] == recipe.head.kind, name
