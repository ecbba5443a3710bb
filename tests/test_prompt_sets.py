"""The eval prompt sets shipped with the package (mtp_train/evaluate/prompt_sets): they load, an install carries them,
they are named wherever a prompts file is taken (recipe `eval.prompts`, `eval --prompts`, `generate --prompts-file`,
the bench scripts' `--prompts`, whose default is the built-in MT-bench set), and an unknown name is a clear error."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import sys
import tomllib
from pathlib import Path

import pytest

from mtp_train.errors import UserError
from mtp_train.evaluate.prompts import BUILT_IN_SETS, PROMPT_SETS_DIR, load_mt_bench, prompts_file
from mtp_train.recipe import EvalSection

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def _script(name: str):
    """scripts/<name>.py as a module (its directory on sys.path, as when it runs: the bench scripts import each
    other)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "turns_per_prompt", "categories"), [
    ("mt_bench", 2, {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}),
    ("humaneval", 1, {"code"}),
    ("gsm8k", 1, {"math"}),
])
def test_each_built_in_set_loads_whole(name: str, turns_per_prompt: int, categories: set[str]) -> None:
    prompt_set = load_mt_bench(name)
    assert len(prompt_set.prompts) == 80 and not prompt_set.skipped
    assert all(len(prompt.turns) == turns_per_prompt and all(turn.strip() for turn in prompt.turns)
               for prompt in prompt_set.prompts)
    assert {prompt.category for prompt in prompt_set.prompts} == categories
    assert len({prompt.question_id for prompt in prompt_set.prompts}) == 80
    assert prompt_set.source == f"{name} (built-in prompt set)"
    assert len(load_mt_bench(name, limit=3).prompts) == 3


def test_the_sets_files_and_their_notes_ship_in_the_package() -> None:
    """Each set is a file of the package folder whose origin and licence its README names, and pyproject's
    package-data carries every file of the folder into an install (a wheel, not only an editable checkout)."""
    assert sorted(path.stem for path in PROMPT_SETS_DIR.glob("*.jsonl")) == sorted(BUILT_IN_SETS)
    readme = (PROMPT_SETS_DIR / "README.md").read_text(encoding="utf-8")
    licences = (PROMPT_SETS_DIR / "LICENSES.txt").read_text(encoding="utf-8")
    for name, upstream in (("mt_bench", "lm-sys/FastChat"), ("humaneval", "openai/human-eval"),
                           ("gsm8k", "openai/grade-school-math")):
        assert f"`{name}`" in readme and upstream in readme and f"{name}.jsonl: from https://github.com/{upstream}" \
            in licences
    assert "Apache License" in licences and licences.count("MIT License") == 2
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["mtp_train.evaluate"]
    for path in PROMPT_SETS_DIR.iterdir():
        relative = path.relative_to(PROMPT_SETS_DIR.parent).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), relative


def test_a_name_or_a_path_and_an_unknown_name_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the built-in sets do not depend on the working directory
    assert prompts_file("humaneval") == PROMPT_SETS_DIR / "humaneval.jsonl"
    own = tmp_path / "mine.jsonl"
    own.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["Hi?"]}) + "\n")
    assert prompts_file(str(own)) == own and load_mt_bench(own).prompts[0].turns == ["Hi?"]
    assert load_mt_bench("mine.jsonl").source == "mine.jsonl"  # relative to the working directory, as before
    for unknown in ("mt-bench", "MT_BENCH", str(tmp_path / "missing.jsonl")):
        with pytest.raises(UserError, match=r"prompts file not found, and not a built-in prompt set "
                                            r"\(mt_bench, humaneval, gsm8k\)"):
            load_mt_bench(unknown)


def test_the_recipe_key_names_the_built_in_sets() -> None:
    """`eval.prompts`'s description is the CLI's `--prompts` help and the recipe reference: it names every set."""
    description = EvalSection.model_fields["prompts"].description
    assert all(name in description for name in BUILT_IN_SETS)


def test_eval_refuses_an_unknown_set_before_loading_models(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mtp_train.cli import main

    head = tmp_path / "head"
    head.mkdir()  # an empty directory: a check made after loading the head would fail with another message
    assert main(["eval", "--head", str(head), "--prompts", "mtbench", "--set", "target.path=/nonexistent"]) == 2
    assert "mtbench: prompts file not found, and not a built-in prompt set (mt_bench, humaneval, gsm8k)" \
        in capsys.readouterr().err


def test_generate_reads_a_built_in_set_by_name() -> None:
    from mtp_train.commands.generate import read_prompts_file

    messages = read_prompts_file("gsm8k")
    assert messages == [prompt.turns[0] for prompt in load_mt_bench("gsm8k").prompts] and len(messages) == 80
    with pytest.raises(UserError, match=r"^--prompts-file gsm8k\.jsonl: prompts file not found, and not a built-in"):
        read_prompts_file("gsm8k.jsonl")


def test_bench_scripts_default_to_the_built_in_mt_bench_set(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`make bench` runs the scripts from a fresh clone: their default prompts are the package's MT-bench set, found
    from any working directory."""
    import argparse

    monkeypatch.chdir(tmp_path)
    bench_decode, bench_spec = _script("bench_decode"), _script("bench_spec")
    mt_bench_first_turns = [prompt.turns[0] for prompt in load_mt_bench("mt_bench").prompts]

    args = bench_decode.parse_args(["--quick"])
    assert prompts_file(args.prompts) == PROMPT_SETS_DIR / "mt_bench.jsonl"
    assert bench_decode.load_prompts(args.prompts, 82) == mt_bench_first_turns + mt_bench_first_turns[:2]

    parser = argparse.ArgumentParser()
    bench_spec.add_run_arguments(parser, new_tokens=8)
    args = parser.parse_args([])
    assert prompts_file(args.prompts) == PROMPT_SETS_DIR / "mt_bench.jsonl"
    (label, text), *docs = bench_spec.prompt_sources(args.prompts)
    assert label == "mt_bench questions" and mt_bench_first_turns[0] in text and text.count("\n\n") >= 159
    assert [label for label, _ in docs] == ["README/docs"]
