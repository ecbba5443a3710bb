"""A whole tiny pipeline on disk for stage tests: a tiny random Llama target with a tiny ChatML tokenizer, a
synthetic ShareGPT file, a recipe pointing at temporary directories, and the prepared dataset. A helper module (plain
functions, not pytest fixtures), imported as `from tests.pipeline_fixtures import ...`."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

from tests.conftest_data import SMOLLM2_CHATML_TEMPLATE, build_tokenizer
from tests.tiny_models import save_tiny_model

RECIPE_PATH = Path(__file__).resolve().parent.parent / "recipes" / "smollm2-135m-mtp.yaml"

WORDS = (
    "the model drafts tokens and the target verifies them in one pass so generation is faster when drafts are "
    "accepted hello world python code data cache page head layer norm train loss step rank shard"
).split()


def free_port() -> int:
    """A TCP port free on this machine now, for a torchrun rendezvous (a fixed port can clash with another run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def synthetic_sharegpt(path: Path, num_conversations: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = []
    for i in range(num_conversations):
        turns = []
        for _ in range(rng.randint(1, 2)):
            turns.append({"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))})
            turns.append({"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(4, 30)))})
        rows.append({"id": f"conv-{i}", "conversations": turns})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def make_tiny_target(directory: Path, seed: int = 0, model_type: str = "llama", **overrides) -> Path:
    tokenizer = build_tokenizer(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos="<|im_start|>", eos="<|im_end|>",
        chat_template=SMOLLM2_CHATML_TEMPLATE,
    )
    save_tiny_model(
        directory, model_type, seed=seed, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, **overrides
    )
    tokenizer.save_pretrained(str(directory))
    return directory


def tiny_recipe_overrides(root: Path, target: Path, source: Path, **extra) -> list[str]:
    overrides = {
        "name": "tiny",
        "target.path": str(target),
        "precision.compute": "float32",
        "target.device": "cpu",
        "data.sources": f"[{{path: '{source}', format: sharegpt}}]",
        "data.output_dir": str(root / "prepared"),
        "data.eval_fraction": "0.1",
        "data.max_seq_len": "128",
        "precompute.output_dir": str(root / "features"),
        "precompute.samples_per_shard": "4",
        "precompute.tokens_per_batch": "256",
        "train.run_dir": str(root / "run"),
        "head.draft_vocab_size": "full",  # the default recipe's 8192 exceeds the tiny vocabulary
        "tracking.wandb.mode": "disabled",
    }
    overrides.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in overrides.items()]


def tiny_pipeline(root: Path, num_conversations: int = 40, seed: int = 0, target_overrides: dict | None = None,
                  model_type: str = "llama", **extra):
    """Returns (recipe, overrides) after running `prepare` into `root/prepared`; the tiny target is a `model_type`
    model (`save_tiny_model`) whose config `target_overrides` change."""
    from mtp_train.data.prepare import prepare_dataset
    from mtp_train.recipe import load_recipe

    root.mkdir(parents=True, exist_ok=True)
    target = make_tiny_target(root / "target", seed=seed, model_type=model_type, **(target_overrides or {}))
    source = synthetic_sharegpt(root / "chats.jsonl", num_conversations, seed=seed)
    overrides = tiny_recipe_overrides(root, target, source, **extra)
    recipe = load_recipe(RECIPE_PATH, overrides)
    prepare_dataset(recipe, show_progress=False)
    return recipe, overrides


def tiny_features(root: Path, num_conversations: int = 40, **extra):
    """`tiny_pipeline` followed by `precompute` (one process): (recipe, overrides) with a complete feature cache."""
    from mtp_train.features.precompute import run_precompute

    recipe, overrides = tiny_pipeline(root, num_conversations, **extra)
    run_precompute(recipe)
    return recipe, overrides


# A precompute (argv: recipe path, JSON list of overrides) that prints "SHARD_WRITTEN n" after each progress file it
# writes and then blocks, so that a test can kill it after its first shard (`python -c PRECOMPUTE_UNTIL_FIRST_SHARD`).
PRECOMPUTE_UNTIL_FIRST_SHARD = """
import json, sys
import mtp_train.features.precompute as precompute
from mtp_train.recipe import load_recipe

write_progress = precompute.write_json_atomic


def write_then_wait(path, obj):
    write_progress(path, obj)
    print("SHARD_WRITTEN", len(obj["shards"]), flush=True)
    sys.stdin.read()  # blocks until the test kills this process


precompute.write_json_atomic = write_then_wait
precompute.run_precompute(load_recipe(sys.argv[1], json.loads(sys.argv[2])))
"""


def vllm_python() -> str:
    """vLLM's interpreter (`make .venv-vllm/.installed`), or skip the test; a failure instead where `make test` set
    MTP_TRAIN_REQUIRE_VLLM=1, so that a CI without vLLM cannot pass by skipping."""
    import os

    import pytest

    from mtp_train.errors import UserError
    from mtp_train.vllm_engine.engine import find_vllm_python

    try:
        return find_vllm_python(None)
    except UserError as err:
        if os.environ.get("MTP_TRAIN_REQUIRE_VLLM") == "1":
            pytest.fail(f"MTP_TRAIN_REQUIRE_VLLM=1 and {err}")
        pytest.skip(str(err))
