"""Command options generated from the recipe schema (mtp_train/cli_options.py): each carries its field's choices,
limits, default and help, sets its recipe key as `--set` would, and is checked by the recipe's validation alone."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mtp_train import cli
from mtp_train.cli_options import add_recipe_args, defaults_from_args, recipe_from_args, schema_field
from mtp_train.commands import eval as eval_command
from mtp_train.recipe import MAX_SPECULATIVE_TOKENS, EvalSection, load_recipe


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


@pytest.fixture
def recipe_file(tmp_path: Path) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text("eval:\n  limit: 7\n", encoding="utf-8")
    return path


def test_eval_options_carry_the_schemas_choices_limits_and_help():
    parser = _subparser("eval")
    ks = _option(parser, "--num-speculative-tokens")
    assert ks.nargs == "+" and ks.dest == "recipe:eval.num_speculative_tokens"
    assert ks.help.startswith(EvalSection.model_fields["num_speculative_tokens"].description)
    assert f"(recipe: eval.num_speculative_tokens, default [1, 2, 3]; each >= 1 and <= {MAX_SPECULATIVE_TOKENS})" \
        in ks.help
    limit = _option(parser, "--limit")
    assert "(recipe: eval.limit, default 32; >= 1, null = none)" in limit.help
    assert _option(parser, "--engine").choices == ["ours", "vllm", "both"]
    assert _option(parser, "--batch-size").dest == "recipe:eval.batch_sizes"  # the spelling users know
    assert _option(parser, "--tp").dest == "recipe:target.tensor_parallel"
    dtype = _option(parser, "--dtype")  # precision.compute's own flag (json_schema_extra)
    assert dtype.choices == ["auto", "bfloat16", "float16", "float32"]
    assert dtype.help.startswith(schema_field("precision.compute").description)
    assert _option(parser, "--decode-dtype").choices == ["auto", "bfloat16", "float16", "float32", "int8"]
    assert _option(parser, "--head-decode-dtype").choices == ["auto", "target", "int8"]
    assert set(eval_command.RECIPE_OPTIONS) == {a.dest.removeprefix("recipe:") for a in parser._actions
                                                if a.dest.startswith("recipe:")}


def test_an_option_sets_its_key_as_set_would(recipe_file: Path):
    args = _subparser("eval").parse_args(["--recipe", str(recipe_file), "--limit", "5", "--dtype", "float32",
                                          "--num-speculative-tokens", "1", "4", "--temperature", "0.5",
                                          "--prompts", "yes", "--batch-size", "1", "2"])
    recipe = recipe_from_args(args)
    assert recipe == load_recipe(recipe_file, ["eval.limit=5", "precision.compute=float32",
                                               "eval.num_speculative_tokens=[1, 4]", "eval.temperature=0.5",
                                               "eval.prompts='yes'", "eval.batch_sizes=[1, 2]"])
    assert recipe.eval.prompts == "yes"  # a string field keeps the text (YAML would read a bool)
    untouched = recipe_from_args(_subparser("eval").parse_args(["--recipe", str(recipe_file)]))
    assert untouched.eval.limit == 7 and untouched.precision.compute == "auto"  # not given: the recipe's value
    after_set = _subparser("eval").parse_args(["--recipe", str(recipe_file), "--set", "eval.limit=3", "--limit", "4"])
    assert recipe_from_args(after_set).eval.limit == 4  # options apply after every --set
    nullable = _subparser("eval").parse_args(["--recipe", str(recipe_file), "--limit", "null", "--prompts", "null"])
    assert recipe_from_args(nullable).eval.limit is None and recipe_from_args(nullable).eval.prompts is None


@pytest.mark.parametrize(("argv", "expected"), [
    (["--num-speculative-tokens", "1", "9"],
     f"--num-speculative-tokens 1 9: eval.num_speculative_tokens[1]: expected a value <= {MAX_SPECULATIVE_TOKENS}, "
     "got 9"),
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens 0: eval.num_speculative_tokens[0]: expected a value "
     ">= 1, got 0"),
    (["--limit", "0"], "--limit 0: eval.limit: expected a value >= 1, got 0"),
    (["--limit", "many"], "--limit many: eval.limit: expected an integer, got 'many'"),
    (["--batch-size", "2", "2"], "--batch-size 2 2: eval.batch_sizes: expected distinct batch sizes, got [2, 2]"),
    (["--batch-size", "257"], "--batch-size 257: eval.batch_sizes[0]: expected a value <= 256, got 257"),
    (["--tp", "0"], "--tp 0: target.tensor_parallel: expected a value >= 1, got 0"),
])
def test_eval_limits_come_from_the_schema(recipe_file: Path, capsys, argv: list[str], expected: str):
    """Out-of-range values are refused by the recipe's validation, naming the option and the key, before any model
    loads (eval re-checks nothing by hand)."""
    assert cli.main(["eval", "--recipe", str(recipe_file), *argv]) == 2
    assert capsys.readouterr().err.strip() == f"mtp-train eval: error: {expected}"


def test_choices_are_checked_by_argparse(recipe_file: Path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "--recipe", str(recipe_file), "--dtype", "fp8"])
    assert exit_info.value.code == 2
    assert "argument --dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_each_command_exposes_its_keys():
    assert _option(_subparser("precompute"), "--features-dtype").dest == "recipe:precision.features"
    assert _option(_subparser("precompute"), "--kv-cache-dtype").choices == ["auto", "float32", "bfloat16"]
    assert _option(_subparser("train"), "--dtype").dest == "recipe:precision.compute"
    assert _option(_subparser("draft-vocab"), "--source").choices == ["target", "data"]
    regenerate = _option(_subparser("prepare"), "--regenerate")
    assert regenerate.option_strings == ["--regenerate", "--no-regenerate"]
    assert "self-distillation" in regenerate.help
    assert _option(_subparser("generate"), "--kv-cache-dtype").dest == "recipe:precision.kv_cache"


def test_a_bool_option_and_a_command_without_a_recipe(recipe_file: Path):
    prepare = _subparser("prepare")
    assert recipe_from_args(prepare.parse_args(["--recipe", str(recipe_file), "--regenerate"])).data.regenerate.enabled
    generate = _subparser("generate").parse_args(["--prompt", "hi", "--dtype", "float32", "--head-decode-dtype",
                                                  "target"])
    precision = defaults_from_args(generate).precision  # generate reads no recipe: schema defaults + its options
    assert (precision.compute, precision.decode, precision.head_decode) == ("float32", "auto", "target")


def test_a_parser_refuses_keys_that_are_not_recipe_keys():
    with pytest.raises(KeyError, match="eval.k: eval.k is not a recipe key"):
        add_recipe_args(argparse.ArgumentParser(), ["eval.k"])
    with pytest.raises(KeyError, match="eval.limit.x: eval.limit is a value"):
        add_recipe_args(argparse.ArgumentParser(), ["eval.limit.x"])
    with pytest.raises(KeyError, match="flags given for keys not exposed"):
        add_recipe_args(argparse.ArgumentParser(), ["eval.limit"], {"eval.engine": "--e"})
