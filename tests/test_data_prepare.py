"""The whole `prepare` stage through its CLI entry, on tiny synthetic data with a tiny offline ChatML tokenizer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mtp_train.commands.prepare import register
from mtp_train.data.prepare import _inputs_fingerprint, prepare_dataset
from mtp_train.data.prepared import (
    eval_split_of,
    load_prepared,
    prompt_before_first_reply,
    tokenizer_hash,
)
from mtp_train.data.templating import masked_runs
from mtp_train.errors import UserError
from mtp_train.recipe import load_recipe
from tests.conftest_data import (
    CHATML_SPECIAL_TOKENS,
    SMOLLM2_CHATML_TEMPLATE,
    build_tokenizer,
    sharegpt_row,
    write_jsonl,
    write_target_dir,
)

NUM_GOOD_SHAREGPT = 30


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prepare")
    tokenizer = build_tokenizer(
        CHATML_SPECIAL_TOKENS, bos="<|im_start|>", eos="<|im_end|>", chat_template=SMOLLM2_CHATML_TEMPLATE
    )
    target = write_target_dir(root / "models" / "tiny-chatml", tokenizer)

    sharegpt_rows = []
    for i in range(NUM_GOOD_SHAREGPT):
        turns = [("human", f"Question {i}: how are you?"), ("gpt", f"I am fine, thank you. Answer {i}.")]
        if i % 3 == 0:
            turns += [
                ("human", "Tell me more."),
                ("gpt", "The quick brown fox jumps over the lazy dog. " * (1 + i % 4)),
            ]
        if i % 5 == 0:
            turns = [("gpt", "A reply left over from a split conversation.")] + turns
        sharegpt_rows.append(
            sharegpt_row(f"sg{i}", *turns, system="You are a helpful assistant." if i % 7 == 0 else None)
        )
    sharegpt_rows.append(sharegpt_row("no-reply", ("human", "Anyone there?")))
    sharegpt_rows.append({"id": "empty", "conversations": []})
    sharegpt_path = root / "datasets" / "chats.json"
    sharegpt_path.parent.mkdir(parents=True)
    sharegpt_path.write_text(json.dumps(sharegpt_rows, indent=1), encoding="utf-8")

    messages_path = write_jsonl(
        root / "datasets" / "extra.jsonl",
        [
            {"id": "m0", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
            '{"id": "m1", "messages": [',
            {"id": "m2", "messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "{}"}]},
            {
                "id": "m3",
                "messages": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye!"}],
            },
        ],
    )
    recipe_path = root / "tiny.yaml"
    recipe_path.write_text(
        f"""
target:
  path: {target}
data:
  sources:
    - path: {sharegpt_path}
    - path: {messages_path}
      format: messages
  max_seq_len: 256
  eval_fraction: 0.3
  seed: 1
  output_dir: {root / "prepared" / "tiny"}
""",
        encoding="utf-8",
    )
    return {"root": root, "target": target, "recipe": recipe_path, "sharegpt": sharegpt_path, "messages": messages_path}


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mtp-train")
    subparsers = parser.add_subparsers(dest="command")
    register(subparsers)
    args = parser.parse_args(["prepare", *argv])
    return args.func(args)


def test_prepare_cli_writes_datasets_stats_fingerprint_and_recipe(workspace, capsys) -> None:
    assert run_cli("--recipe", str(workspace["recipe"]), "--force") == 0
    output_dir = workspace["root"] / "prepared" / "tiny"
    assert sorted(p.name for p in output_dir.iterdir()) == [
        ".mtp_train-output.json",  # the marker that makes it prepare's to replace
        "eval",
        "fingerprint.json",
        "recipe.resolved.yaml",
        "stats.json",
        "train",
    ]
    assert not (output_dir.parent / ".tiny.work").exists()
    assert "prepared 32 samples from 36 rows" in capsys.readouterr().out

    stats = json.loads((output_dir / "stats.json").read_text())
    assert stats["rows_read"] == NUM_GOOD_SHAREGPT + 2 + 4
    assert stats["kept"] == NUM_GOOD_SHAREGPT + 2
    assert stats["skipped"] == {
        "empty conversation": 1,
        "malformed JSON": 1,
        "no assistant turn": 1,
        "unknown role: tool": 1,
    }
    assert stats["adjusted"] == {"leading assistant turns dropped": NUM_GOOD_SHAREGPT // 5}
    assert [source["kept"] for source in stats["sources"]] == [NUM_GOOD_SHAREGPT, 2]
    assert stats["truncated"] == 0 and stats["offset_fallback"] == 0

    prepared = load_prepared(output_dir, verify=True)
    assert stats["splits"]["train"]["samples"] == len(prepared.train) > 0
    assert stats["splits"]["eval"]["samples"] == len(prepared.eval) > 0
    assert str(prepared.train.features["input_ids"].feature.dtype) == "int32"
    assert str(prepared.train.features["loss_mask"].feature.dtype) == "uint8"
    for split_name, split in (("train", prepared.train), ("eval", prepared.eval)):
        assert sum(len(ids) for ids in split["input_ids"]) == stats["splits"][split_name]["tokens"]
        assert sum(sum(mask) for mask in split["loss_mask"]) == stats["splits"][split_name]["assistant_tokens"]
        assert all(eval_split_of(sid, 1, 0.3) == split_name for sid in split["source_id"])

    # A sample's masked tokens are its replies plus <|im_end|>; the orphan leading reply is gone.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(workspace["target"]))
    rows = {row["source_id"]: row for split in (prepared.train, prepared.eval) for row in split}
    sample = rows["chats:sg0"]
    runs = [
        tokenizer.decode(ids, skip_special_tokens=False)
        for ids in masked_runs(sample["input_ids"], sample["loss_mask"])
    ]
    assert runs == [
        "I am fine, thank you. Answer 0.<|im_end|>",
        "The quick brown fox jumps over the lazy dog. <|im_end|>",
    ]
    assert "left over" not in tokenizer.decode(sample["input_ids"])
    prompt = tokenizer.decode(prompt_before_first_reply(sample["input_ids"], sample["loss_mask"]))
    assert prompt.endswith("<|im_start|>user\nQuestion 0: how are you?<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful assistant." in tokenizer.decode(sample["input_ids"])  # its own system prompt (i % 7 == 0)

    fingerprint = prepared.fingerprint
    assert fingerprint["tokenizer_hash"] == tokenizer_hash(workspace["target"], SMOLLM2_CHATML_TEMPLATE)
    assert fingerprint["samples"] == {"train": len(prepared.train), "eval": len(prepared.eval)}
    resolved = load_recipe(output_dir / "recipe.resolved.yaml")
    assert resolved.data.max_seq_len == 256 and resolved.name == "tiny"


def test_rerun_is_up_to_date_and_force_rebuilds_identically(workspace, capsys) -> None:
    assert run_cli("--recipe", str(workspace["recipe"]), "--force") == 0
    output_dir = workspace["root"] / "prepared" / "tiny"
    first = json.loads((output_dir / "fingerprint.json").read_text())
    capsys.readouterr()

    assert run_cli("--recipe", str(workspace["recipe"])) == 0
    assert "up to date" in capsys.readouterr().out
    assert json.loads((output_dir / "fingerprint.json").read_text())["created"] == first["created"]

    assert run_cli("--recipe", str(workspace["recipe"]), "--force") == 0
    again = json.loads((output_dir / "fingerprint.json").read_text())
    assert again["dataset_hash"] == first["dataset_hash"] and again["inputs_hash"] == first["inputs_hash"]

    # A changed recipe value changes the inputs: rebuilt without --force.
    assert run_cli("--recipe", str(workspace["recipe"]), "--set", "data.seed=2") == 0
    changed = json.loads((output_dir / "fingerprint.json").read_text())
    assert changed["inputs_hash"] != first["inputs_hash"]


def test_strict_fails_on_the_first_malformed_row(workspace) -> None:
    out = workspace["root"] / "prepared" / "strict"
    with pytest.raises(UserError, match=rf"{workspace['messages']}:2: malformed JSON .*\(--strict\)"):
        run_cli("--recipe", str(workspace["recipe"]), "--strict", "--set", f"data.output_dir={out}")
    assert not out.exists() and not (out.parent / ".strict.work").exists()  # nothing half-written or left over


def test_overlong_samples_are_truncated_or_dropped(workspace) -> None:
    recipe_path = str(workspace["recipe"])
    truncate_dir = workspace["root"] / "prepared" / "truncate"
    assert (
        run_cli("--recipe", recipe_path, "--set", "data.max_seq_len=100", "--set", f"data.output_dir={truncate_dir}")
        == 0
    )
    truncated = load_prepared(truncate_dir)
    stats = truncated.stats
    assert stats["truncated"] > 0 and "no assistant tokens within max_seq_len" not in stats["skipped"]
    assert max(len(ids) for split in (truncated.train, truncated.eval) for ids in split["input_ids"]) == 100

    drop_dir = workspace["root"] / "prepared" / "drop"
    overrides = ["--set", "data.max_seq_len=100", "--set", "data.overlong=drop", "--set", f"data.output_dir={drop_dir}"]
    assert run_cli("--recipe", recipe_path, *overrides) == 0
    dropped = load_prepared(drop_dir)
    assert dropped.stats["truncated"] == 0
    assert dropped.stats["skipped"]["longer than max_seq_len"] == stats["truncated"]
    assert dropped.stats["kept"] == stats["kept"] - stats["truncated"]


def test_max_samples_and_limit(workspace) -> None:
    recipe_path = str(workspace["recipe"])
    out = workspace["root"] / "prepared" / "small"
    assert run_cli("--recipe", recipe_path, "--set", "data.max_samples=5", "--set", f"data.output_dir={out}") == 0
    stats = load_prepared(out).stats
    assert stats["kept"] == 5 and stats["sources"][1]["rows_read"] == 0

    assert run_cli("--recipe", recipe_path, "--limit", "4", "--set", f"data.output_dir={out}") == 0
    stats = load_prepared(out).stats
    assert stats["rows_read"] == 4 and stats["options"]["row_limit"] == 4


def test_regeneration_replaces_replies_and_keeps_them(workspace) -> None:
    out = workspace["root"] / "prepared" / "regen"
    recipe = load_recipe(
        workspace["recipe"],
        [
            "data.regenerate.enabled=true",
            "data.regenerate.batch_size=4",
            f"data.output_dir={out}",
            "data.max_samples=6",
        ],
    )
    calls: list[int] = []

    def fake_generate(batch):
        calls.append(len(batch))
        return [f"Regenerated reply number {len(messages)}." for messages in batch]

    result = prepare_dataset(recipe, generate_fn=fake_generate, show_progress=False)
    # Regeneration works in whole batches: 6 samples wanted, 2 batches of 4 conversations generated.
    assert result.stats["kept"] == 6 and result.stats["regeneration"]["generated"] == 8
    assert sum(calls) == result.stats["regeneration"]["replies"]
    assert len((out / "regenerated.jsonl").read_text().splitlines()) == 8
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(workspace["target"]))
    prepared = load_prepared(out)
    for row in list(prepared.train) + list(prepared.eval):
        for ids in masked_runs(row["input_ids"], row["loss_mask"]):
            text = tokenizer.decode(ids, skip_special_tokens=False)
            assert text.startswith("Regenerated reply number ") and text.endswith(".<|im_end|>")


def test_target_without_chat_template_is_a_user_error(workspace, tmp_path: Path) -> None:
    bare = write_target_dir(tmp_path / "bare", build_tokenizer(CHATML_SPECIAL_TOKENS, eos="<|im_end|>"))
    with pytest.raises(UserError, match="has no chat template; set `data.chat_template"):
        run_cli("--recipe", str(workspace["recipe"]), "--set", f"target.path={bare}")
    with pytest.raises(UserError, match="data.sources: .*nope.jsonl: not found"):
        run_cli("--recipe", str(workspace["recipe"]), "--set", f"data.sources=[{{path: {tmp_path}/nope.jsonl}}]")


def test_interrupted_regeneration_resumes_from_the_work_directory(workspace) -> None:
    out = workspace["root"] / "prepared" / "regen-resume"
    recipe = load_recipe(
        workspace["recipe"],
        [
            "data.regenerate.enabled=true",
            "data.regenerate.batch_size=2",
            f"data.output_dir={out}",
            "data.max_samples=6",
        ],
    )
    prompted: list[str] = []

    def generate(batch):
        prompted.extend(messages[-1]["content"] for messages in batch)
        if len(prompted) > 4:
            raise KeyboardInterrupt  # the user stops the run
        return ["Short reply." for _ in batch]

    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(recipe, generate_fn=generate, show_progress=False)
    work_dir = out.parent / ".regen-resume.work"
    assert not out.exists()
    (progress_file,) = work_dir.iterdir()  # only the regeneration progress is kept
    finished = [json.loads(line) for line in progress_file.read_text().splitlines()]
    finished_before_stop = len(finished)
    assert progress_file.name.startswith("regenerated-") and finished_before_stop >= 1
    finished_questions = {m["content"] for r in finished for m in r["messages"] if m["content"].startswith("Question")}

    second_run_prompts: list[str] = []

    def generate_again(batch):
        second_run_prompts.extend(messages[-1]["content"] for messages in batch)
        return ["Short reply." for _ in batch]

    result = prepare_dataset(recipe, generate_fn=generate_again, show_progress=False)
    regeneration = result.stats["regeneration"]
    assert regeneration["resumed"] == finished_before_stop and result.stats["kept"] == 6
    assert len(second_run_prompts) == regeneration["replies"]
    assert finished_questions and not finished_questions & set(
        second_run_prompts
    )  # finished conversations are not generated again
    assert not work_dir.exists()


def test_no_eval_fraction_gives_an_empty_eval_split(workspace) -> None:
    out = workspace["root"] / "prepared" / "no-eval"
    assert (
        run_cli(
            "--recipe", str(workspace["recipe"]), "--set", "data.eval_fraction=0", "--set", f"data.output_dir={out}"
        )
        == 0
    )
    prepared = load_prepared(out, verify=True)
    assert len(prepared.eval) == 0 and len(prepared.train) == prepared.stats["kept"]
    assert prepared.eval.features == prepared.train.features


def test_the_precision_counts_for_prepared_data_only_when_the_target_writes_the_replies(tmp_path):
    """`precision` (compute, decode, K/V cache) decides the target's replies under `data.regenerate`, so it is part of
    the inputs a prepared dataset is reused for; without regeneration it changes nothing prepare writes."""
    source = tmp_path / "chats.jsonl"
    source.write_text("{}\n", encoding="utf-8")
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text("", encoding="utf-8")

    def inputs(*sets):
        recipe = load_recipe(recipe_path, [f"data.sources=[{{path: {source}}}]", *sets])
        return _inputs_fingerprint(recipe, "tokenizer digest", None)

    assert inputs() == inputs("precision.compute=float32")
    regenerate = "data.regenerate.enabled=true"
    assert inputs(regenerate) != inputs(regenerate, "precision.compute=float32")
    assert inputs(regenerate) == inputs(regenerate, "precision.features=float16")  # the feature cache's, not prepare's

