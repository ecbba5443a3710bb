"""`prepare --regenerate` through the runtime: assistant turns are replaced by the target's own greedy replies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_train.data.prepare import prepare_dataset
from mtp_train.errors import UserError
from mtp_train.recipe import load_recipe
from mtp_train.runtime.chat import encode_chat, stop_token_ids
from mtp_train.runtime.generate import generate
from mtp_train.runtime.loader import load_model, load_tokenizer
from tests.margin_checks import assert_clear_decode_margins
from tests.pipeline_fixtures import free_port, make_tiny_target, synthetic_sharegpt, tiny_recipe_overrides

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "smollm2-135m-mtp.yaml"


def test_regenerated_replies_are_the_targets_greedy_output(tmp_path):
    target = make_tiny_target(tmp_path / "target")
    source = synthetic_sharegpt(tmp_path / "chats.jsonl", 6)
    overrides = tiny_recipe_overrides(tmp_path, target, source) + [
        "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=6", "data.regenerate.batch_size=4",
    ]
    recipe = load_recipe(RECIPE, overrides)
    prepare_dataset(recipe, show_progress=False)
    rows = [json.loads(line) for line in (Path(recipe.data.output_dir) / "regenerated.jsonl").read_text().splitlines()]
    assert len(rows) >= 4
    model = load_model(target, dtype="float32", device="cpu")
    tokenizer = load_tokenizer(target)
    stops = stop_token_ids(tokenizer, model.config)
    checked = 0
    for row in rows:
        messages = row["messages"]
        first_user = next(m for m in messages if m["role"] == "user")
        first_reply = next(m for m in messages if m["role"] == "assistant")
        prompt = encode_chat(tokenizer, [first_user])
        expected, _ = generate(model, [prompt], 6, stop_token_ids=stops)
        expected_text = tokenizer.decode([t for t in expected[0].token_ids if t not in stops], skip_special_tokens=True)
        assert first_reply["content"] == expected_text.strip()
        checked += 1
    assert checked == len(rows)


def _regenerated(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "regenerated.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.real_model
def test_regeneration_over_torchrun_ranks_gives_the_one_process_replies(tmp_path, smollm2_dir):
    """`prepare --regenerate` under torchrun, the default model split over 2 ranks (TP 2) and whole on each of 2
    ranks (2 data-parallel groups, each generating its half of every batch): greedy fp32 replies, their order and
    the prepared datasets equal one process's."""
    source = synthetic_sharegpt(tmp_path / "chats.jsonl", 5)
    overrides = tiny_recipe_overrides(tmp_path, smollm2_dir, source) + [
        "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=6", "data.regenerate.batch_size=3",
        "data.regenerate.temperature=0",
    ]
    reference = prepare_dataset(load_recipe(RECIPE, overrides), show_progress=False)
    expected = _regenerated(reference.output_dir)
    assert len(expected) == 5 and all(m["content"] for row in expected for m in row["messages"])
    # Tensor parallelism sums each matmul in another order (fp32): every reply step clear of 2 × 1e-3, the fp32
    # runtime's bound against transformers (tests/test_runtime_real.py), so the ranks must give the same tokens.
    model, tokenizer = load_model(smollm2_dir, dtype="float32", device="cpu"), load_tokenizer(smollm2_dir)
    stops = stop_token_ids(tokenizer, model.config)
    for row in expected:
        for turn, message in enumerate(row["messages"]):
            if message["role"] == "assistant":
                prompt = encode_chat(tokenizer, row["messages"][:turn])
                (reply,), _ = generate(model, [prompt], 6, stop_token_ids=stops)
                assert_clear_decode_margins(model, prompt, reply.token_ids, 1e-3, f"{row['source_id']} turn {turn}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(RECIPE.parent.parent)}
    for tensor_parallel in (2, 1):
        out = tmp_path / f"prepared-tp{tensor_parallel}"
        sets = [a for o in overrides + [f"data.output_dir={out}"] for a in ("--set", o)]
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                              f"--master-port={free_port()}", "-m", "mtp_train", "prepare", "--recipe", str(RECIPE),
                              "--tp", str(tensor_parallel), *sets],
                             cwd=RECIPE.parent.parent, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-4000:]
        layout = f"tensor parallel {tensor_parallel} × data parallel {2 // tensor_parallel} (world 2)"
        assert run.stdout.count("prepare --regenerate: ") == 2 and layout in run.stdout  # rank 0 alone prints
        assert run.stdout.count("prepared ") == 1
        assert _regenerated(out) == expected, tensor_parallel
        fingerprint = json.loads((out / "fingerprint.json").read_text())
        assert fingerprint["dataset_hash"] == reference.fingerprint["dataset_hash"]


def test_sampled_regeneration_takes_the_recipes_temperature_and_top_p(tmp_path, monkeypatch):
    """`data.regenerate.temperature` and `top_p` reach the sampler that writes the replies (nucleus sampling keeps a
    small target's sampled replies off its long tail)."""
    import mtp_train.runtime.generate as runtime_generate

    target = make_tiny_target(tmp_path / "target")
    source = synthetic_sharegpt(tmp_path / "chats.jsonl", 3)
    overrides = tiny_recipe_overrides(tmp_path, target, source) + [
        "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=4", "data.regenerate.temperature=0.7",
        "data.regenerate.top_p=0.9",
    ]
    seen = []
    real_generate = runtime_generate.generate

    def recording_generate(model, prompts, limits, sampling, **kwargs):
        seen.append(sampling)
        return real_generate(model, prompts, limits, sampling, **kwargs)

    monkeypatch.setattr(runtime_generate, "generate", recording_generate)
    prepare_dataset(load_recipe(RECIPE, overrides), show_progress=False)
    assert seen and all((s.temperature, s.top_p) == (0.7, 0.9) for s in seen)
    with pytest.raises(UserError, match=r"data\.regenerate\.top_p"):
        load_recipe(RECIPE, overrides[:-1] + ["data.regenerate.top_p=0"])
