"""`prepare --regenerate` through the runtime: assistant turns are replaced by the target's own greedy replies."""

from __future__ import annotations

import json
from pathlib import Path

from mtp_train.data.prepare import prepare_dataset
from mtp_train.recipe import load_recipe
from mtp_train.runtime.chat import encode_chat, stop_token_ids
from mtp_train.runtime.generate import generate
from mtp_train.runtime.loader import load_model, load_tokenizer
from tests.pipeline_fixtures import make_tiny_target, synthetic_sharegpt, tiny_recipe_overrides

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
