"""docs/recipe-reference.md is generated from the recipe schema and kept current; every key is described there."""

from __future__ import annotations

from pathlib import Path
from typing import get_args, get_origin

from pydantic import BaseModel

from mtp_train.recipe import Recipe
from mtp_train.recipe_reference import REFERENCE_PATH, REGENERATE_COMMAND, main, render_reference

REPO_ROOT = Path(__file__).resolve().parents[1]


def _schema_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> dict[str, object]:
    """Every value key of the schema, dotted (`data.sources[].path`), with its field; sections are walked into."""
    keys: dict[str, object] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.update(_schema_keys(annotation, f"{prefix}{name}."))
        elif get_origin(annotation) is list and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            keys.update(_schema_keys(args[0], f"{prefix}{name}[]."))
        else:
            keys[f"{prefix}{name}"] = field
    return keys


def test_the_committed_reference_is_what_the_schema_gives() -> None:
    committed = (REPO_ROOT / REFERENCE_PATH).read_text(encoding="utf-8")
    assert committed == render_reference(), (
        f"{REFERENCE_PATH} is out of date with mtp_train/recipe.py: run `{REGENERATE_COMMAND}` and commit it")


def test_every_recipe_key_has_a_description() -> None:
    """The reference (and each generated option's help) says what every key does: a key needs a description=."""
    undescribed = [key for key, field in _schema_keys().items() if not field.description]
    assert undescribed == []


def test_the_reference_has_a_row_per_key_with_its_default() -> None:
    text = render_reference()
    rows = {line.split(" | ")[0].strip("| `"): line for line in text.splitlines() if line.startswith("| `")}
    sections = {key for key, line in rows.items() if "section" in line.split(" | ")[1]}
    assert set(rows) - sections == set(_schema_keys())
    assert sections == {"data.sources", "data.system_prompt", "data.regenerate", "precompute.vllm", "tracking.wandb"}
    for name in Recipe.model_fields:  # a heading per top-level section
        assert name == "name" or f"\n## {name}\n" in text
    assert "| `train.lr` | `float (> 0.0)` | `0.0005` |" in rows["train.lr"]
    assert "| `eval.num_speculative_tokens` | `list of int (>= 1, <= 8)` | `[1, 2, 3]` |" in \
        rows["eval.num_speculative_tokens"]
    assert "`one of: truncate, drop` | `truncate`" in rows["data.overlong"]
    assert "`str or null` | `null` | null = data/prepared/&lt;name&gt;" in rows["data.output_dir"]
    assert "| `name` | `str` | `(the file's stem)` |" in rows["name"]
    assert "## data.sources[]" in text and "## tracking.wandb" in text


def test_check_mode_reports_a_stale_file_and_names_the_command(tmp_path: Path, capsys) -> None:
    out = tmp_path / "reference.md"
    assert main(["--check", "--out", str(out)]) == 1  # missing
    assert REGENERATE_COMMAND in capsys.readouterr().err
    assert main(["--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render_reference()
    assert main(["--check", "--out", str(out)]) == 0
    out.write_text(render_reference().replace("`0.0005`", "`0.001`"), encoding="utf-8")
    assert main(["--check", "--out", str(out)]) == 1
