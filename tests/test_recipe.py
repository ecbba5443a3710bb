"""Recipe schema, YAML loading, --set overrides, error messages, resolved recipes and hashes."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path
from typing import get_args

import pytest
import yaml

from mtp_train.cli_options import add_recipe_args, recipe_from_args
from mtp_train.errors import UserError
from mtp_train.features.format import STORAGE_DTYPES
from mtp_train.runtime.decode_runner import HEAD_DECODE_DTYPES
from mtp_train.runtime.precision import DECODE_ONLY_DTYPES, DTYPE_NAMES, KV_CACHE_DTYPES
from mtp_train.runtime.spec.engine import MAX_SPECULATIVE_TOKENS as ENGINE_LIMIT
from mtp_train.recipe import (
    DEFAULT_RECIPE_PATH,
    MAX_SPECULATIVE_TOKENS,
    MOVED_KEYS,
    RESOLVED_RECIPE_FILENAME,
    PrecisionSection,
    Recipe,
    load_recipe,
    recipe_hash,
    save_resolved,
    with_precision,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO_ROOT / DEFAULT_RECIPE_PATH


def write_recipe(directory: Path, text: str, name: str = "exp.yaml") -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


# The default recipe is tuned for `make demo` (docs/benchmarks.md); these keys differ from the schema defaults, each
# marked `# demo:` in the file. Everything else is the schema default, spelled out.
DEMO_TUNED = {
    "data.max_samples": 600, "data.max_seq_len": 256, "head.draft_vocab_size": 8192, "train.zero_stage": 2,
    "train.micro_batch_tokens": 512, "train.lr": 2e-3, "train.warmup_steps": 10, "train.epochs": 6,
    "train.unroll_steps": 1, "train.loss_rows": "all", "train.eval_every": 100, "train.save_every": 100,
    "eval.limit": 10, "eval.num_speculative_tokens": [1, 2, 3, 4], "eval.max_new_tokens": 96,
    "eval.cost_curve": True,
}


def test_default_recipe_file_spells_out_the_schema_defaults() -> None:
    recipe = load_recipe(DEFAULT_RECIPE)
    defaults = Recipe(name="smollm2-135m-mtp").model_dump()
    values = recipe.model_dump()
    differing = {
        f"{section}.{key}": values[section][key]
        for section in defaults if isinstance(defaults[section], dict)
        for key in defaults[section] if values[section][key] != defaults[section][key]
    }
    assert differing == DEMO_TUNED
    text = DEFAULT_RECIPE.read_text(encoding="utf-8")
    assert text.count("# demo:") == len(DEMO_TUNED) + 1  # + the header line explaining the marker
    assert recipe.target.path == "data/models/smollm2-135m-instruct"
    assert [source.path for source in recipe.data.sources] == ["data/datasets/sharegpt/sharegpt.jsonl"]
    # The file mentions every key of every section (commented `name` aside), so it documents the schema.
    raw = yaml.safe_load(DEFAULT_RECIPE.read_text(encoding="utf-8"))
    assert set(raw) == set(Recipe.model_fields) - {"name"}
    for section, model in raw.items():
        assert set(model) == set(type(getattr(recipe, section)).model_fields), section


def test_name_defaults_to_file_stem_and_names_the_outputs(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, "train:\n  lr: 1.0e-3\n", name="my-exp.yaml"))
    assert recipe.name == "my-exp"
    assert recipe.data.output_dir == "data/prepared/my-exp"
    assert recipe.precompute.output_dir == "data/features/my-exp"
    assert recipe.train.run_dir == "runs/my-exp"
    assert recipe.tracking.wandb.run_name == "my-exp"
    renamed = load_recipe(tmp_path / "my-exp.yaml", ["name=other"])
    assert renamed.data.output_dir == "data/prepared/other"


def test_empty_file_gives_all_defaults(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, ""))
    assert recipe == Recipe(name="exp")


def test_overrides_use_yaml_scalar_rules(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, "train:\n  lr: 1.0e-3\n")
    recipe = load_recipe(
        path,
        [
            "train.lr=3e-4",  # a float even without a dot (YAML 1.2 style)
            "train.max_steps=100",
            "head.draft_vocab_size=32000",
            "data.sources=[{path: a.jsonl, format: sharegpt}, {path: b, format: hf, split: test}]",
            "data.sources.1.limit=10",
            "eval.prompts=",  # empty = null
            "tracking.wandb.tags=[a, b]",
            "data.regenerate.enabled=true",
        ],
    )
    assert recipe.train.lr == pytest.approx(3e-4) and isinstance(recipe.train.lr, float)
    assert recipe.train.max_steps == 100
    assert recipe.head.draft_vocab_size == 32000
    assert [(s.path, s.format, s.split, s.limit) for s in recipe.data.sources] == [
        ("a.jsonl", "sharegpt", None, None),
        ("b", "hf", "test", 10),
    ]
    assert recipe.eval.prompts is None
    assert recipe.tracking.wandb.tags == ["a", "b"]
    assert recipe.data.regenerate.enabled is True


def test_float_without_dot_in_the_file_is_a_float(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, "train:\n  lr: 2e-4\n  weight_decay: 1E-2\n"))
    assert recipe.train.lr == pytest.approx(2e-4)
    assert recipe.train.weight_decay == pytest.approx(1e-2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("train:\n  lrr: 1.0\n", "exp.yaml: train.lrr: unknown key (did you mean 'lr'?)"),
        ("trian:\n  lr: 1.0\n", "exp.yaml: trian: unknown key (did you mean 'train'?)"),
        ("data:\n  sources:\n    - path: a\n      fromat: sharegpt\n", "exp.yaml: data.sources[0].fromat: unknown key"),
        ("data:\n  sources:\n    - format: sharegpt\n", "exp.yaml: data.sources[0].path: required key missing"),
        ("train:\n  schedule: cos\n", "exp.yaml: train.schedule: expected one of 'cosine', 'linear' or 'constant'"),
        ("train:\n  epochs: two\n", "exp.yaml: train.epochs: expected an integer, got 'two'"),
        ("train:\n  warmup_steps: -1\n", "exp.yaml: train.warmup_steps: expected a value >= 0, got -1"),
        ("train: 3\n", "exp.yaml: train: expected a mapping of keys, got 3"),
        ("head:\n  draft_vocab_size: half\n", "exp.yaml: head.draft_vocab_size: expected 'full' or a positive integer"),
        ("data:\n  system_prompt:\n    mode: override\n", "exp.yaml: data.system_prompt: mode 'override' needs"),
        ("eval:\n  num_speculative_tokens: [1, 0]\n",
         "exp.yaml: eval.num_speculative_tokens[1]: expected a value >= 1, got 0"),
        ("eval:\n  num_speculative_tokens: [9]\n",
         "exp.yaml: eval.num_speculative_tokens[0]: expected a value <= 8, got 9"),
        ("eval:\n  batch_sizes: [2, 2]\n", "exp.yaml: eval.batch_sizes: expected distinct batch sizes, got [2, 2]"),
        ("precision:\n  compute: fp8\n", "exp.yaml: precision.compute: expected one of 'auto', 'bfloat16', "),
        ("precision:\n  computee: auto\n", "exp.yaml: precision.computee: unknown key (did you mean 'compute'?)"),
        ("name: has space\n", "exp.yaml: name: expected letters, digits"),
    ],
)
def test_bad_values_in_the_file_name_file_and_key_path(tmp_path: Path, text: str, expected: str) -> None:
    path = write_recipe(tmp_path, text)
    with pytest.raises(UserError) as caught:
        load_recipe(path)
    message = str(caught.value)
    assert message.startswith(str(path.parent) + os.sep) and expected in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lr=abc", "--set train.lr=abc: train.lr: expected a number, got 'abc'"),
        ("train.lrr=1", "--set train.lrr=1: train.lrr: unknown key (did you mean 'lr'?)"),
        ("data.sources=[{path: a, fmt: x}]", "data.sources[0].fmt: unknown key"),
        ("data.overlong=cut", "data.overlong: expected one of 'truncate' or 'drop', got 'cut'"),
        ("data.sources.0.path.x=1", "--set data.sources.0.path.x=1: data.sources.0.path is a value ('a.jsonl')"),
        ("train.lr.x=1", "--set train.lr.x=1: train.lr: expected a number, got {'x': 1}"),
        ("data.sources.3.path=x", "--set data.sources.3.path=x: data.sources.3: index 3 out of range (the list has 1"),
        ("data.sources.first.path=x", "--set data.sources.first.path=x: data.sources.first: expected a list index"),
        ("train.lr", "--set expects KEY=VALUE"),
        ("=3", "--set expects KEY=VALUE"),
        ("data.sources=[unclosed", "--set data.sources=[unclosed: value is not valid YAML"),
    ],
)
def test_bad_overrides_name_the_option_and_key_path(tmp_path: Path, override: str, expected: str) -> None:
    path = write_recipe(tmp_path, "data:\n  sources:\n    - path: a.jsonl\n")
    with pytest.raises(UserError) as caught:
        load_recipe(path, [override])
    assert expected in str(caught.value), str(caught.value)


def test_error_in_the_file_is_not_blamed_on_an_unrelated_override(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, "train:\n  lrr: 1.0\n")
    with pytest.raises(UserError, match=r"exp\.yaml: train\.lrr: unknown key"):
        load_recipe(path, ["data.max_samples=10"])


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(UserError, match=r"exp\.yaml: invalid YAML \(line \d+, column \d+\): expected ','"):
        load_recipe(write_recipe(tmp_path, "train:\n  lr: [1, 2\n"))
    with pytest.raises(UserError, match="expected a mapping of sections at the top level, got list"):
        load_recipe(write_recipe(tmp_path, "- a\n- b\n"))


def test_save_resolved_round_trips_atomically(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, "train:\n  lr: 1.0e-3\n"), ["data.max_samples=7"])
    out_dir = tmp_path / "out"
    written = save_resolved(recipe, out_dir)
    assert written == out_dir / RESOLVED_RECIPE_FILENAME
    assert sorted(p.name for p in out_dir.iterdir()) == [RESOLVED_RECIPE_FILENAME]  # no temp file left behind
    assert stat.S_IMODE(written.stat().st_mode) & 0o044  # readable by others, not mkstemp's 0600
    reloaded = load_recipe(written)
    assert reloaded == recipe
    assert reloaded.data.output_dir == "data/prepared/exp"  # derived paths are resolved, not re-derived
    save_resolved(recipe.model_copy(update={"name": "renamed"}), out_dir)  # overwrite in place
    assert load_recipe(written).name == "renamed"


def test_recipe_hash_is_stable_and_section_scoped(tmp_path: Path) -> None:
    a = load_recipe(write_recipe(tmp_path, "train:\n  lr: 1.0e-3\ndata:\n  seed: 3\n", name="a.yaml"), ["name=x"])
    # Same values, different key order and spelling of the number.
    b = load_recipe(write_recipe(tmp_path, "data:\n  seed: 3\ntrain:\n  lr: 0.001\n", name="b.yaml"), ["name=x"])
    assert recipe_hash(a) == recipe_hash(b)
    assert len(recipe_hash(a)) == 64 and int(recipe_hash(a), 16) >= 0

    c = load_recipe(tmp_path / "b.yaml", ["name=x", "train.lr=2e-3"])
    assert recipe_hash(a) != recipe_hash(c)
    assert recipe_hash(a, ["data", "target"]) == recipe_hash(c, ["data", "target"])
    assert recipe_hash(a, ["train"]) != recipe_hash(c, ["train"])
    assert recipe_hash(a, ["data", "target"]) == recipe_hash(a, ["target", "data"])
    with pytest.raises(ValueError, match="unknown recipe section"):
        recipe_hash(a, ["nope"])


def test_add_recipe_args_parses_recipe_and_repeated_sets(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_recipe_args(parser)
    defaults = parser.parse_args([])
    assert defaults.recipe == DEFAULT_RECIPE_PATH and defaults.overrides == []

    path = write_recipe(tmp_path, "")
    args = parser.parse_args(["--recipe", str(path), "--set", "train.lr=1e-3", "--set", "data.seed=5"])
    recipe = recipe_from_args(args)
    assert recipe.train.lr == pytest.approx(1e-3) and recipe.data.seed == 5


def test_assignment_is_validated() -> None:
    recipe = Recipe(name="x")
    recipe.data.regenerate.enabled = True
    assert recipe.data.regenerate.enabled is True
    with pytest.raises(ValueError):
        recipe.train.schedule = "sometimes"  # type: ignore[assignment]


@pytest.mark.parametrize(("old", "new"), sorted(MOVED_KEYS.items()))
def test_a_moved_key_names_its_new_place_in_the_file_and_in_set(tmp_path: Path, old: str, new: str) -> None:
    """The six dtype keys of the sections moved into `precision`: a recipe or `--set` that still uses one is refused
    with the key's new name (nothing maps them silently)."""
    section, key = old.split(".")
    path = write_recipe(tmp_path, f"{section}:\n  {key}: auto\n")
    with pytest.raises(UserError) as caught:
        load_recipe(path)
    assert str(caught.value) == f"{path}: {old}: moved to {new}"
    with pytest.raises(UserError) as caught:
        load_recipe(write_recipe(tmp_path, "", name="empty.yaml"), [f"{old}=auto"])
    assert str(caught.value) == f"--set {old}=auto: {old}: moved to {new}"


def test_precision_section_defaults_and_resolved_values(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, "precision:\n  kv_cache: bfloat16\n"), ["precision.decode=int8"])
    assert (recipe.precision.compute, recipe.precision.decode, recipe.precision.kv_cache, recipe.precision.features,
            recipe.precision.head_decode) == ("auto", "int8", "bfloat16", "bfloat16", "auto")
    resolved = with_precision(recipe, {"compute": "float32", "decode": "int8"})
    assert resolved.precision.compute == "float32" and recipe.precision.compute == "auto"  # a copy
    save_resolved(resolved, tmp_path / "out")
    assert load_recipe(tmp_path / "out" / RESOLVED_RECIPE_FILENAME).precision == resolved.precision


def test_eval_k_limit_is_the_engines() -> None:
    """The recipe bounds eval.num_speculative_tokens by the engine's limit without importing torch; pinned equal."""
    assert MAX_SPECULATIVE_TOKENS == ENGINE_LIMIT


def test_precision_choices_are_what_the_stages_accept() -> None:
    """The schema's choices (and so the options' and the validation's) are the values the runtime and the feature
    cache take, so no stage re-checks them."""
    choices = {name: set(get_args(field.annotation)) for name, field in PrecisionSection.model_fields.items()}
    assert choices["compute"] == {"auto", *DTYPE_NAMES}
    assert choices["decode"] == {"auto", *DTYPE_NAMES, *DECODE_ONLY_DTYPES}
    assert choices["kv_cache"] == set(KV_CACHE_DTYPES)
    assert choices["features"] == set(STORAGE_DTYPES)
    assert choices["head_decode"] == set(HEAD_DECODE_DTYPES)
