"""`make serve-check` (scripts/check_serving.py) without vLLM: which head each case checks (HEAD, a comma list, one per
kind; the recipe's run; else a short run), the short runs sharing one prepared data set and feature cache, the
acceptance arithmetic from vLLM's spec-decode counters, the checks (including the vacuous-comparison guard), and the
table and RESULT line covering every case."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mtp_train.export.registry import get_format
from mtp_train.heads import HeadConfig
from mtp_train.recipe import load_recipe, recipe_hash

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_serving.py"


@pytest.fixture(scope="module")
def cs():
    """scripts/check_serving.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("check_serving", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_serving"] = module  # its dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("check_serving", None)


def make_run(run_dir: Path, kind: str) -> Path:
    """A run directory as `mtp-train train` leaves it, as far as the script reads it: head/head_config.json of `kind`
    and recipe.resolved.yaml."""
    aux = (1, 2, 3) if kind == "eagle3" else ()
    config = HeadConfig(hidden_size=8, vocab_size=32, model_type="llama", kind=kind, aux_layers=aux)
    (run_dir / "head").mkdir(parents=True)
    (run_dir / "head" / "head_config.json").write_text(json.dumps(config.to_dict()))
    (run_dir / "recipe.resolved.yaml").write_text("name: test\n")
    return run_dir


def test_head_list_assigns_each_entry_to_its_kind(cs, tmp_path):
    mtp = make_run(tmp_path / "a", "mtp")
    eagle3 = make_run(tmp_path / "b", "eagle3")
    heads = cs.find_heads(f"{eagle3}, {mtp / 'head'}", ["mtp", "eagle3"], tmp_path / "runs")
    assert heads["mtp"].run_dir == mtp and heads["mtp"].head_dir == mtp / "head"  # a head/ given: its run is the parent
    assert heads["eagle3"].run_dir == eagle3 and heads["eagle3"].kind == "eagle3"
    assert heads["mtp"].origin.startswith("HEAD=") and heads["mtp"].recipe == mtp / "recipe.resolved.yaml"


def test_kind_not_in_head_falls_back_to_the_recipes_run_then_to_a_short_run(cs, tmp_path):
    runs = tmp_path / "runs"
    demo_mtp = make_run(runs / cs.RECIPES["mtp"].stem, "mtp")  # runs/smollm2-135m-mtp, as `make demo` leaves it
    heads = cs.find_heads(None, ["mtp", "eagle3"], runs)
    assert heads["mtp"].head_dir == demo_mtp / "head" and heads["mtp"].origin == f"run runs/{demo_mtp.name}"
    assert heads["eagle3"] is None  # nothing: main() trains a short run
    given = make_run(tmp_path / "mine", "eagle3")
    heads = cs.find_heads(str(given), ["mtp", "eagle3"], runs)
    assert heads["eagle3"].head_dir == given / "head" and heads["mtp"].head_dir == demo_mtp / "head"


def test_head_list_refusals_name_the_problem(cs, tmp_path, capsys):
    one, two = make_run(tmp_path / "one", "mtp"), make_run(tmp_path / "two", "mtp")
    with pytest.raises(SystemExit, match="two mtp heads"):
        cs.find_heads(f"{one},{two}", ["mtp", "eagle3"], tmp_path / "runs")
    with pytest.raises(SystemExit, match=r"is a mtp head; the cases checked are for eagle3 heads"):
        cs.find_heads(str(one), ["eagle3"], tmp_path / "runs")
    with pytest.raises(SystemExit, match=r"nowhere/head/head_config.json not found \(HEAD=.*nowhere"):
        cs.find_heads(str(tmp_path / "nowhere"), ["mtp"], tmp_path / "runs")


def test_every_kind_has_a_recipe_and_every_case_a_kind(cs):
    assert {case.kind for case in cs.CASES} <= set(cs.RECIPES)
    assert [case.format for case in cs.CASES] == ["vllm-mtp", "eagle3"]
    assert [get_format(case.format).draft_vocab for case in cs.CASES] == [None, "tensors"]  # full vocab, d2t kept
    for recipe in cs.RECIPES.values():
        assert recipe.is_file()


def test_short_runs_share_prepared_data_and_feature_cache(cs):
    """Both kinds' short runs resolve to the same data and precompute sections (so the second kind's prepare and
    precompute find the first's output up to date), the cache storing the eagle3 recipe's aux layers, and the eagle3
    recipe's reduced draft vocabulary kept."""
    kinds = ["mtp", "eagle3"]
    overrides = cs.short_run_overrides(kinds)
    eagle3_aux = load_recipe(cs.RECIPES["eagle3"]).precompute.aux_layers
    assert f"precompute.aux_layers=[{','.join(map(str, eagle3_aux))}]" in overrides
    recipes = {kind: load_recipe(cs.RECIPES[kind], [f"name={cs.SHORT_NAME}-{kind}", *overrides, *cs.SHORT_TRAIN])
               for kind in kinds}
    assert recipe_hash(recipes["mtp"], ["data", "precompute"]) == recipe_hash(recipes["eagle3"], ["data", "precompute"])
    assert recipes["mtp"].prepared_dir == Path(f"data/prepared/{cs.SHORT_NAME}")
    assert recipes["eagle3"].head.kind == "eagle3" and recipes["eagle3"].head.draft_vocab_size == 8192
    assert recipes["mtp"].run_dir != recipes["eagle3"].run_dir
    assert cs.short_run_overrides(["mtp"])[-1] == "precompute.aux_layers=[]"  # an mtp-only run stores none


def test_vllm_acceptance_from_spec_decode_counters(cs):
    metrics = {"vllm:spec_decode_num_drafts": 200.0, "vllm:spec_decode_num_accepted_tokens": 90.0,
               "vllm:spec_decode_num_accepted_tokens_per_pos": [60.0, 24.0, 6.0]}
    mal, per_pos = cs.vllm_acceptance(metrics, 3)
    assert mal == pytest.approx(1.45)
    assert per_pos == pytest.approx([0.30, 0.12, 0.03])
    assert cs.vllm_acceptance({}, 3) == (0.0, [0.0, 0.0, 0.0])  # no draft at all


def counters(per_pos: list[int], drafts: int = 100) -> dict:
    return {"vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_accepted_tokens": sum(per_pos),
            "vllm:spec_decode_num_accepted_tokens_per_pos": per_pos}


def test_compare_passes_when_engines_agree(cs):
    outputs = [[1, 2, 3], [4, 5]]
    row = cs.compare(cs.CASES[1], [0.305, 0.12, 0.03], outputs, [list(o) for o in outputs], counters([30, 12, 3]), 3)
    assert row["ok"] and row["failures"] == []
    assert row["identical"] == 2 and row["ours_mal"] == pytest.approx(1.455) and row["vllm_mal"] == pytest.approx(1.45)


def test_compare_names_each_failed_check(cs):
    case = cs.CASES[0]
    row = cs.compare(case, [0.30, 0.12, 0.03], [[1, 2], [3]], [[1, 2], [9]], counters([30, 12, 3]), 3)
    assert not row["ok"] and row["failures"] == ["vLLM speculative output differs from plain on 1/2 prompts"]
    row = cs.compare(case, [0.30, 0.12, 0.03], [[1]], [[1]], counters([34, 12, 3]), 3)  # 0.04 apart at position 1
    assert [f.split(" ")[0] for f in row["failures"]] == ["mean", "per-position"]
    assert "ours 1.450 vs vLLM 1.490" in row["failures"][0]


def test_compare_refuses_a_vacuous_comparison(cs):
    """A head that drafts nothing acceptable agrees with vLLM trivially (0 == 0): that is a failure, not a pass."""
    row = cs.compare(cs.CASES[1], [0.0, 0.0, 0.0], [[1]], [[1]], counters([0, 0, 0]), 3)
    assert not row["ok"]
    vacuous = ("our acceptance at position 1 is 0.000 <= 0.05: the head drafts too little for the comparison to mean "
               "anything (train it longer)")
    assert row["failures"] == [vacuous]


def test_table_and_result_line_cover_every_case(cs):
    good = cs.compare(cs.CASES[0], [0.32, 0.09, 0.03], [[1]], [[1]], counters([32, 9, 3]), 3)
    good.update(head="short run", vllm_version="0.32.0")
    broken = {"case": "eagle3/eagle3", "head": "short run", "ok": False, "error": "vLLM (vllm-spec) failed\nmore"}
    table = cs.summary_table([good, broken])
    assert table[2] == ("| mtp/vllm-mtp | short run | 1 | 1/1 | 1.440 / 1.440 | 0.320/0.320, 0.090/0.090, "
                        "0.030/0.030 | ok |")
    assert table[3] == "| eagle3/eagle3 | short run | - | - | - | error: vLLM (vllm-spec) failed | FAIL |"
    line = cs.result_line([good, broken])
    assert line == ("RESULT ok=false mtp_vllm-mtp_acceptance_ours=1.440 mtp_vllm-mtp_acceptance_vllm=1.440 "
                    "mtp_vllm-mtp_pos1_ours=0.320 mtp_vllm-mtp_identical_outputs=1/1 eagle3_eagle3=error "
                    "vllm=0.32.0 tolerance=0.02 min_pos1=0.05")
    assert cs.result_line([good]).startswith("RESULT ok=true ")
    assert cs.result_line([]).startswith("RESULT ok=false ")
