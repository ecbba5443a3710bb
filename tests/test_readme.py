"""The README's commands work as written.

Every command the README shows (its ```bash blocks and its inline `...` commands) is accounted for in `EXERCISED`:
run here on small inputs, parsed here by the real command line and run end to end by the test named beside it, run
by CI, or (a GPU, the network, another engine) said why this machine cannot run it. A command added to the README
without an entry fails `test_every_readme_command_is_accounted_for`, and an entry naming a test that does not exist
fails `test_the_tests_named_for_readme_commands_exist`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
VENV_BIN = Path(sys.executable).parent

# What a command line starts with, for an inline `...` span to count as a command.
_COMMAND_START = re.compile(r"^(?:make|mtp-train|\.venv/bin/\S+|python3?|torchrun|vllm|hf)\s")

# (pattern the command matches, how it is exercised). "test:" names a test (tests/<file>.py::<function>) that runs it
# or what it stands for end to end; "here" names a test of this file that runs it as written.
EXERCISED: list[tuple[str, str]] = [
    (r"make demo", "here: test_make_demo_runs_every_stage_on_a_small_budget"),
    (r"make test", "CI: .ci/run runs `make test` on a fresh clone"),
    (r"make test PYTEST_ARGS='-m \"not slow\"'", "CI runs the whole suite, of which this is the part not marked slow"),
    (r"make bench BENCH_ARGS=--quick", "not a test by design (benchmarks time contenders side by side and print "
                                       "ratios); run by hand, figures in docs/benchmarks.md"),
    (r"\.venv/bin/mtp-train generate --prompt .*", "here: test_generate_answers_the_readme_prompt"),
    (r"mtp-train env", "here: test_env_describes_the_machine"),
    (r"mtp-train verify-features DIR", "test: tests/test_precompute.py::test_verify_catches_flipped_byte_and_truncation"),
    (r"mtp-train inspect DIR", "test: tests/test_export.py::test_inspect_cli_ok_table"),
    (r"python3 -m venv \.venv && \.venv/bin/pip install torch && \.venv/bin/pip install -e '\.\[gpu\]'",
     "GPU machine only (the `gpu` extra is FlashInfer's CUDA wheels); CI installs the same way with the `dev` extra"),
    (r"python3 -m venv \.venv-vllm && \.venv-vllm/bin/pip install vllm",
     "GPU machine only (vLLM's CUDA build); CI installs vLLM's CPU build the same way (`make .venv-vllm/.installed`)"),
    (r"\.venv/bin/python scripts/gpu_check\.py", "test: tests/test_gpu_check.py::test_gpu_check_runs_in_its_cpu_smoke_mode"),
    (r"hf download .*", "network: the model hub is unreachable from CI machines; the loader's input is the same HF "
                        "directory the tests build (tests/tiny_models.py)"),
    (r"R=my-model\.yaml", "a shell variable for the lines below"),
    (r"\.venv/bin/mtp-train prepare --recipe \$R", "here (parsed): test_gpu_quick_start_commands_parse; "
                                                   "test: tests/test_data_prepare.py::"
                                                   "test_prepare_cli_writes_datasets_stats_fingerprint_and_recipe"),
    (r"\.venv/bin/torchrun --nproc_per_node=8 -m mtp_train precompute --recipe \$R",
     "here (parsed); test: tests/test_vllm_backend.py::test_torchrun_ranks_are_engines_side_by_side"),
    (r"\.venv/bin/torchrun --nproc_per_node=8 -m mtp_train train --recipe \$R",
     "here (parsed); test: tests/test_train.py::test_torchrun_zero2_two_ranks_loss_falls_and_head_has_no_frozen_tensors"),
    (r"\.venv/bin/mtp-train eval --recipe \$R",
     "here (parsed); test: tests/test_vllm_families.py::test_eagle3_head_trained_on_vllm_features_is_served_by_vllm"),
    (r"\.venv/bin/mtp-train export --format eagle3 --head runs/my-model/head .*",
     "here (parsed); test: tests/test_export.py::test_inspect_accepts_every_export"),
    (r"vllm serve data/models/llama-3\.1-8b-instruct .*",
     "test: tests/test_vllm_families.py::test_eagle3_head_trained_on_vllm_features_is_served_by_vllm (vLLM serves "
     "the eagle3 export with this speculative config through `LLM(...)`)"),
    (r"vllm serve", "the command's name in a sentence; the whole command is the line above"),
    (r"python -m sglang\.launch_server .*", "SGLang is not installed here: the export layout is matched against "
                                            "SGLang's source (docs/export.md)"),
]


def readme_commands(text: str) -> list[str]:
    """The commands of a README: each line of its ```bash blocks (continuations joined, `# comments` dropped) and each
    inline `...` span, joined over line breaks, that starts like a command."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        pending = ""
        for line in block.splitlines():
            line = pending + line.strip()
            pending = ""
            if line.endswith("\\"):
                pending = line[:-1].strip() + " "
                continue
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if _COMMAND_START.match(span + " "):
            commands.append(span)
    return commands


def how_exercised(command: str) -> str | None:
    matches = [how for pattern, how in EXERCISED if re.fullmatch(pattern, command)]
    return matches[0] if len(matches) == 1 else None


def test_the_extractor_joins_continuations_and_finds_inline_commands():
    text = ("Run `mtp-train env` first, then `make\ndemo`; not `export --format eagle3`.\n"
            "```bash\nmake test   # the suite\n# a comment\nmtp-train export --head h \\\n    --out o\n```\n")
    assert readme_commands(text) == ["make test", "mtp-train export --head h --out o", "mtp-train env", "make demo"]


def test_every_readme_command_is_accounted_for():
    unaccounted = [c for c in readme_commands(README.read_text(encoding="utf-8")) if how_exercised(c) is None]
    assert not unaccounted, ("README commands with no (or several) entries in tests/test_readme.py EXERCISED:\n"
                             + "\n".join(unaccounted))


def test_the_tests_named_for_readme_commands_exist():
    here = Path(__file__).read_text(encoding="utf-8")
    for _, how in EXERCISED:
        for path, function in re.findall(r"(tests/\w+\.py)::(\w+)", how):
            source = (REPO / path).read_text(encoding="utf-8")
            assert re.search(rf"^def {function}\(", source, re.MULTILINE), f"{path}::{function} does not exist"
        for function in re.findall(r"here(?: \(parsed\))?: (test_\w+)", how):
            assert re.search(rf"^def {function}\(", here, re.MULTILINE), f"test_readme.py::{function} does not exist"


def _mtp_train_argv(command: str) -> list[str]:
    """The arguments after `mtp-train` (or `torchrun ... -m mtp_train`) of a README command."""
    words = shlex.split(command)
    if "mtp_train" in words:
        return words[words.index("mtp_train") + 1 :]
    return words[next(i for i, w in enumerate(words) if w.endswith("mtp-train")) + 1 :]


def test_gpu_quick_start_commands_parse(tmp_path):
    """The quick start's pipeline, with `$R` a copy of the recipe it tells the user to copy: every line parses with
    the real command line, and the copy loads through the schema once `target.path` and `data.sources` are set."""
    from mtp_train.cli import build_parser
    from mtp_train.recipe import load_recipe

    recipe = tmp_path / "my-model.yaml"
    recipe.write_text((REPO / "recipes" / "llama-3.1-8b-eagle3.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    loaded = load_recipe(recipe, ["target.path=data/models/my-model", "data.sources=[{path: my-chats.jsonl}]"])
    assert loaded.name == "my-model" and loaded.head.kind == "eagle3"
    text = README.read_text(encoding="utf-8")
    pipeline = [c for c in readme_commands(text) if "$R" in c or "export --format eagle3" in c]
    assert [_mtp_train_argv(c)[0] for c in pipeline] == ["prepare", "precompute", "train", "eval", "export"]
    parser = build_parser()
    for command in pipeline:
        argv = [str(recipe) if word == "$R" else word for word in _mtp_train_argv(command)]
        args = parser.parse_args(argv)
        assert getattr(args, "recipe", str(recipe)) == str(recipe)


# Set by torchrun, or by an earlier test's in-process trainer (whose store may still hold MASTER_PORT): a user's shell
# that runs the README's commands has none of them.
_LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                       "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


def _run(argv: list[str], timeout: int, **kwargs) -> subprocess.CompletedProcess:
    """A README command as a user's shell runs it: from the repository root, the virtualenv's scripts on PATH, no
    launcher variables inherited from the test process."""
    env = {name: value for name, value in os.environ.items()
           if name not in _LAUNCHER_VARIABLES and not name.startswith("TORCHELASTIC_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


def test_env_describes_the_machine():
    result = _run([str(VENV_BIN / "mtp-train"), "env"], timeout=300)
    assert result.returncode == 0, result.stderr
    for field in ("packages:", "cpu:", "auto dtype:"):
        assert field in result.stdout


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.cpu_paths
def test_generate_answers_the_readme_prompt(smollm2_dir):
    """The README's `generate` command prints transformers' fp32 greedy answer, which the README quotes, on this
    CPU's `auto` path (and, rerun by tests/test_cpu_kinds.py, as each other CPU kind). It holds on every CPU by
    construction: at each step of the answer the top-1/top-2 margin exceeds twice the largest logit error of this
    CPU's auto path and of a bf16 model (what auto runs on a native-bf16 CPU whose probe picks torch's bf16 matmuls:
    the largest rounding of the paths auto picks). A prompt closer to a tie fails here, naming the step."""
    import torch
    from transformers import AutoModelForCausalLM

    from mtp_train.evaluate.margins import MarginCheck, decode_logits, reference_answer
    from mtp_train.runtime.chat import encode_chat, stop_token_ids
    from mtp_train.runtime.config import load_config
    from mtp_train.runtime.loader import load_model, load_tokenizer
    from mtp_train.runtime.precision import resolve_precision

    readme = README.read_text(encoding="utf-8")
    (command,) = [c for c in readme_commands(readme) if " generate " in c]
    argv = shlex.split(command)
    tokenizer = load_tokenizer(smollm2_dir)
    stops = stop_token_ids(tokenizer, load_config(smollm2_dir))
    prompt_ids = encode_chat(tokenizer, [{"role": "user", "content": argv[argv.index("--prompt") + 1]}])
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    answer_ids, reference = reference_answer(hf, prompt_ids, 256, stops)
    assert answer_ids[-1] in stops, "the README's prompt should have a short answer"
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    assert f'"{answer}"' in " ".join(readme.split()), f"the README should quote the answer: {answer!r}"
    for name, precision in (("auto", resolve_precision("auto", "auto", "cpu")),
                            ("bf16 model", resolve_precision("bfloat16", "bfloat16", "cpu"))):
        check = MarginCheck.of(reference, decode_logits(load_model(smollm2_dir, device="cpu", precision=precision),
                                                        prompt_ids, answer_ids))
        assert not check.unsafe_steps(), (
            f"{name} ({precision.describe()}): {check.describe()}: the README's prompt is too close to a tie for "
            "this path; pick one with clearer margins (scripts/prompt_margins.py)")

    argv[0] = str(VENV_BIN / "mtp-train")
    result = _run(argv, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == answer


@pytest.mark.slow
@pytest.mark.real_model
def test_make_demo_runs_every_stage_on_a_small_budget(tmp_path):
    """`make demo` as the README shows it, on a small budget: every stage on the default model and data (one rank,
    40 conversations, 8 steps, 2 held-out prompts of 16 tokens), outputs under a temporary folder but the exports
    (`exports/<name>/`, a name of its own, removed afterwards); it ends with the summary table."""
    name = f"readme-demo-{os.getpid()}"
    exports = REPO / "exports" / name
    sets = [f"name={name}", f"data.output_dir={tmp_path / 'prepared'}", f"precompute.output_dir={tmp_path / 'features'}",
            f"train.run_dir={tmp_path / 'run'}", "data.max_samples=40", "train.max_steps=8", "train.epochs=1",
            "eval.limit=2", "eval.max_new_tokens=16", "eval.num_speculative_tokens=[1,2]", "eval.cost_curve=false"]
    demo_args = " ".join(f"--set {shlex.quote(s)}" for s in sets) + " --nproc 1"
    try:
        result = _run(["make", "demo", f"DEMO_ARGS={demo_args}"], timeout=1500)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        summary = (tmp_path / "run" / "demo_summary.md").read_text(encoding="utf-8")
        assert summary.startswith(f"## Demo summary: {name}") and "held-out top-1" in summary
        assert (exports / "vllm-mtp" / "model.safetensors").is_file()
    finally:
        if exports.is_dir():
            shutil.rmtree(exports)
