"""Trainer: DeepSpeed ZeRO-2 under torchrun (loss falls, head files hold no frozen tensors), exact resume after a
kill, frozen target tensors untouched, and the refusals (changed recipe, foreign features, too-small cache)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.features.precompute import run_precompute
from mtp_train.recipe import load_recipe
from tests.pipeline_fixtures import free_port, tiny_features, tiny_pipeline

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "smollm2-135m-mtp.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
TRAIN = {"train.micro_batch_tokens": 256, "train.warmup_steps": 2, "train.lr": 3e-3, "train.zero_stage": 2,
         "train.eval_every": 10, "train.save_every": 10}


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _head_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "head" / "model.safetensors")


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    _, overrides = tiny_features(root, num_conversations=60, **TRAIN)
    return root, overrides


@pytest.mark.slow
def test_torchrun_zero2_two_ranks_loss_falls_and_head_has_no_frozen_tensors(features):
    root, overrides = features
    run_dir = root / "run-ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}", "-m",
               "mtp_train", "train", "--recipe", str(RECIPE), *_sets(overrides),
               "--set", f"train.run_dir={run_dir}", "--set", "train.max_steps=24", "--set", "precision.compute=bfloat16"]
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = _metrics(run_dir)
    assert len(rows) == 24
    first = sum(r["loss"] for r in rows[:4]) / 4
    last = sum(r["loss"] for r in rows[-4:]) / 4
    assert last < first * 0.9, (first, last)
    tensors = _head_tensors(run_dir)
    assert not [k for k in tensors if "embed" in k or "lm_head" in k]
    assert "eh_proj.weight" in tensors and "layers.0.mlp.down_proj.weight" in tensors
    config = json.loads((run_dir / "head" / "head_config.json").read_text())
    assert config["kind"] == "mtp" and config["target_fingerprint"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and "val/step1/top1" in summary


def test_training_probes_no_peak_and_logs_its_speed(features, monkeypatch):
    """Training's summary gives tokens/s and the head's counted GFLOP/s; it runs no probe of the machine's matmul
    peak (scripts/bench_train.py does)."""
    import mtp_train.runtime.hardware as hardware
    from mtp_train.train import trainer

    def no_probe(*args, **kwargs):
        raise AssertionError("training probed the machine's matmul peak")

    monkeypatch.setattr(hardware, "measure_matmul_gflops", no_probe)
    root, overrides = features
    run_dir = root / "run-speed"
    trainer.run_training(load_recipe(RECIPE, overrides + [f"train.run_dir={run_dir}", "train.max_steps=2"]),
                         show_progress=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens_per_s"] > 0 and summary["gflops"] > 0
    assert not {"peak_gflops", "fraction_of_peak"} & set(summary)


@pytest.mark.parametrize("init", ["random", "last_layer"])
def test_frozen_target_tensors_unchanged(features, monkeypatch, init):
    """Training reads only the target's frozen parts (never builds the whole target; the last layer only for init
    last_layer, released after the head's init) and leaves them untouched."""
    import mtp_train.runtime.frozen_parts as frozen_parts
    import mtp_train.runtime.loader as loader
    from mtp_train.train import trainer

    root, overrides = features
    recipe = load_recipe(RECIPE, overrides + [f"train.run_dir={root / f'run-frozen-{init}'}", "train.max_steps=4",
                                              f"head.init={init}"])
    captured = {}
    load_frozen_parts = frozen_parts.load_frozen_parts

    def capturing_load(*args, **kwargs):
        parts = load_frozen_parts(*args, **kwargs)
        captured["parts"] = parts
        captured["embed"] = parts.embed_tokens.weight.detach().clone()
        captured["lm_head"] = parts.lm_head.weight.detach().clone()
        captured["read_last_layer"] = parts.last_layer is not None
        return parts

    def no_full_load(*args, **kwargs):
        raise AssertionError("training built the whole target")

    monkeypatch.setattr(trainer, "load_frozen_parts", capturing_load)  # where the trainer calls it
    monkeypatch.setattr(loader, "load_model", no_full_load)
    trainer.run_training(recipe, show_progress=False)
    parts = captured["parts"]
    assert torch.equal(parts.embed_tokens.weight, captured["embed"])
    assert torch.equal(parts.lm_head.weight, captured["lm_head"])
    assert parts.embed_tokens.weight.grad is None and parts.lm_head.weight.grad is None
    assert captured["read_last_layer"] == (init == "last_layer") and parts.last_layer is None


@pytest.mark.slow
def test_kill_after_checkpoint_then_resume_matches_uninterrupted(features):
    root, overrides = features
    common = _sets(overrides) + ["--set", "train.max_steps=16", "--set", "train.save_every=4",
                                 "--set", "train.keep_last=5", "--set", "precision.compute=bfloat16"]
    straight = root / "run-straight"
    result = subprocess.run([sys.executable, "-m", "mtp_train", "train", "--recipe", str(RECIPE), *common,
                             "--set", f"train.run_dir={straight}"], cwd=REPO, env=ENV, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    killed = root / "run-killed"
    command = [sys.executable, "-m", "mtp_train", "train", "--recipe", str(RECIPE), *common,
               "--set", f"train.run_dir={killed}"]
    process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if (killed / "checkpoints" / "step-8" / "client_state.json").is_file():
            break
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "head").exists(), "the run finished before it could be killed"
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stdout
    a, b = _head_tensors(straight), _head_tensors(killed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    losses_a = [r["loss"] for r in _metrics(straight)]
    losses_b = [r["loss"] for r in _metrics(killed)]
    assert losses_a == losses_b


@pytest.mark.slow
def test_torchrun_zero3_two_ranks_saves_and_resumes_exactly(features, tmp_path):
    """ZeRO-3 partitions the weights: each rank writes and reads its own model states file. A 2-rank bf16 run saves
    step-2 and step-4; the same run dir without step-4 and the head resumes from step-2 and ends with the same head;
    each rank's files load weights-only."""
    import shutil

    from mtp_train.train.checkpoints import files_to_load

    root, overrides = features
    straight = tmp_path / "straight"

    def train(run_dir: Path) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
                   "-m", "mtp_train", "train", "--recipe", str(RECIPE), *_sets(overrides),
                   "--set", "train.zero_stage=3", "--set", "train.max_steps=4", "--set", "train.save_every=2",
                   "--set", "precision.compute=bfloat16", "--set", f"train.run_dir={run_dir}"]
        return subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)

    result = train(straight)
    assert result.returncode == 0, result.stderr[-4000:]
    step2 = straight / "checkpoints" / "step-2"
    expected = {path.name for rank in (0, 1) for path in files_to_load(step2, rank, 3)} | {"client_state.json"}
    assert {path.name for path in step2.iterdir()} == expected
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    shutil.rmtree(resumed / "head")
    result = train(resumed)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"resumed from {resumed / 'checkpoints' / 'step-2'} at step 2" in result.stdout
    a, b = _head_tensors(straight), _head_tensors(resumed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # Each rank reads its own model states through the weights-only loader: a pickle planted in rank 1's is refused.
    marker = tmp_path / "pwned"

    class Planted:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    planted = resumed / "checkpoints" / "step-4" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    torch.save({"module": Planted()}, planted)
    result = train(resumed)
    assert result.returncode != 0 and f"{planted}: refused to load" in result.stderr, result.stderr[-4000:]
    assert not marker.exists()


def test_refusals(features, tmp_path):
    from mtp_train.train.trainer import run_training

    root, overrides = features
    run_dir = root / "run-refusals"
    recipe = load_recipe(RECIPE, overrides + [f"train.run_dir={run_dir}", "train.max_steps=2", "train.save_every=1"])
    run_training(recipe, show_progress=False)
    changed = load_recipe(RECIPE, overrides + [f"train.run_dir={run_dir}", "train.max_steps=4", "train.lr=1e-2"])
    with pytest.raises(UserError, match=r"changed recipe \(train.lr\)"):
        run_training(changed, show_progress=False)
    # Features of another target: the fingerprint check names it.
    other_root = tmp_path / "other"
    other, _ = tiny_pipeline(other_root, num_conversations=12, seed=5)
    run_precompute(other)
    foreign = load_recipe(RECIPE, overrides + [f"precompute.output_dir={other.precompute.output_dir}",
                                               f"train.run_dir={tmp_path / 'run-foreign'}"])
    with pytest.raises(UserError, match="fingerprint 'target'"):
        run_training(foreign, show_progress=False)
    # A cache too small for the batch settings (one huge micro-batch cannot feed two ranks).
    from mtp_train.features.reader import FeatureReader

    with pytest.raises(UserError, match="fewer than the 2 ranks"):
        FeatureReader(recipe.precompute.output_dir, micro_batch_tokens=100000, world_size=2)


def test_deepspeed_config_conflicts(tmp_path):
    from mtp_train.train.trainer import deepspeed_config

    recipe = load_recipe(RECIPE, ["train.grad_accum=2", "train.zero_stage=2"])
    config = deepspeed_config(recipe, world_size=4, use_bf16=True)
    assert config["train_batch_size"] == 8 and config["zero_optimization"]["stage"] == 2 and config["bf16"]["enabled"]
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 16}))
    with pytest.raises(UserError, match="train_batch_size=16 does not equal"):
        deepspeed_config(load_recipe(RECIPE, [f"train.deepspeed_config={bad}", "train.grad_accum=2"]), 4, True)
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(UserError, match="stage=3 but the recipe"):
        deepspeed_config(load_recipe(RECIPE, [f"train.deepspeed_config={bad}", "train.zero_stage=2"]), 1, True)


def test_nan_loss_stops_with_a_checkpoint(features, monkeypatch):
    import mtp_train.train.losses as losses
    import mtp_train.train.trainer as trainer
    import mtp_train.train.validation as validation
    from mtp_train.train.trainer import run_training

    root, overrides = features
    real = losses.unrolled_losses
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] >= 3:
            loss = loss * float("nan")
            metrics["loss"] = loss.detach()
        return loss, metrics

    monkeypatch.setattr(trainer, "unrolled_losses", poisoned)  # where training and validation call it
    monkeypatch.setattr(validation, "unrolled_losses", poisoned)
    run_dir = root / "run-nan"
    recipe = load_recipe(RECIPE, overrides + [f"train.run_dir={run_dir}", "train.max_steps=50"])
    with pytest.raises(UserError, match="loss is nan at step 3; stopped"):
        run_training(recipe, show_progress=False)
    assert (run_dir / "checkpoints" / "nan-step-3").is_dir()
    assert len(_metrics(run_dir)) == 2


def test_muon_optimizer_takes_the_matrices_and_adamw_the_rest(features):
    """`train.optimizer: muon`: DeepSpeed's MuonWithAuxAdam with every trainable matrix in the Muon group at
    `train.muon_lr` (flagged `use_muon` for ZeRO) and the norms in the AdamW group at `train.lr`; adamw stays one
    torch AdamW over every trainable parameter."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    from mtp_train.train.trainer import make_optimizer

    root, overrides = features
    head = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8, bias=False))
    frozen = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
    head.register_parameter("frozen", frozen)
    recipe = load_recipe(RECIPE, overrides + ["train.optimizer=muon", "train.muon_lr=0.03", "train.lr=1e-3",
                                              "train.clip=0"])
    optimizer = make_optimizer(head, recipe.train)
    assert isinstance(optimizer, MuonWithAuxAdam)
    muon, adam = optimizer.param_groups
    matrices = [head[0].weight, head[2].weight]
    assert muon["use_muon"] and muon["lr"] == 0.03 and [id(p) for p in muon["params"]] == list(map(id, matrices))
    assert not adam["use_muon"] and adam["lr"] == 1e-3
    assert {id(p) for p in adam["params"]} == {id(head[0].bias), id(head[1].weight), id(head[1].bias)}
    assert all(p.use_muon for p in matrices) and not head[1].weight.use_muon
    with pytest.raises(UserError, match=r"train: optimizer muon with zero_stage 2 needs clip 0"):
        load_recipe(RECIPE, overrides + ["train.optimizer=muon", "train.zero_stage=2", "train.clip=1.0"])
    assert load_recipe(RECIPE, overrides + ["train.optimizer=muon", "train.zero_stage=0"]).train.clip == 1.0
    adamw = make_optimizer(head, load_recipe(RECIPE, overrides).train)
    assert type(adamw) is torch.optim.AdamW
    assert id(frozen) not in {id(p) for group in adamw.param_groups for p in group["params"]}


def test_input_noise_perturbs_step_one_inputs_reproducibly():
    """`train.input_noise`: σ · rms(row) · N(0, 1) on what step 1 reads; 0 leaves the loss bit-identical, a seed
    reproduces the noised loss, and the targets are not noised (a head that copies its input sees a loss of its
    noise only)."""
    from mtp_train.train.losses import unrolled_losses

    class Copy(torch.nn.Module):  # the head's output is its input: its KL measures the noise on the inputs alone
        def __init__(self, weight):
            super().__init__()
            self.lm_head_weight = weight
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, token_ids, hidden, batch):
            return hidden * self.scale

    torch.manual_seed(0)
    d, vocab, lengths = 16, 32, [7, 5]
    weight = torch.randn(vocab, d)
    hidden = torch.randn(sum(lengths), d)
    hidden[1:7] = hidden[0]  # sequence 0 holds one state, so a copying head is exact on its rows without noise
    token_ids = torch.randint(0, vocab, (sum(lengths),))
    mask = torch.ones(sum(lengths))
    head = Copy(weight)

    def loss(noise: float, seed: int = 1) -> torch.Tensor:
        torch.manual_seed(seed)
        total, _ = unrolled_losses(head, token_ids, hidden, mask, lengths, unroll_steps=1, feature_weight=0.0,
                                   chunk_size=None, input_noise=noise)
        return total.detach()

    assert torch.equal(loss(0.0), loss(0.0, seed=2))
    assert torch.equal(loss(0.1), loss(0.1))
    assert not torch.equal(loss(0.1), loss(0.1, seed=2))
    assert loss(0.1) > loss(0.0) and loss(0.5) > loss(0.1)


@pytest.mark.slow
def test_muon_with_input_noise_on_two_ranks_learns_and_resumes_exactly(features):
    """Muon under ZeRO-2 on 2 ranks with noised inputs: the loss falls, and a run killed after a checkpoint resumes
    to the uninterrupted run's head and losses bit for bit (Muon's momentum and the noise generator's state are in
    the checkpoint)."""
    root, overrides = features
    common = _sets(overrides) + ["--set", "train.optimizer=muon", "--set", "train.clip=0",
                                 "--set", "train.input_noise=0.05",
                                 "--set", "train.max_steps=16", "--set", "train.save_every=4",
                                 "--set", "train.keep_last=5"]

    def command(run_dir: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
                "-m", "mtp_train", "train", "--recipe", str(RECIPE), *common, "--set", f"train.run_dir={run_dir}"]

    straight = root / "run-muon-straight"
    result = subprocess.run(command(straight), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = _metrics(straight)
    assert sum(r["loss"] for r in rows[-4:]) < 0.97 * sum(r["loss"] for r in rows[:4])
    killed = root / "run-muon-killed"
    process = subprocess.Popen(command(killed), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if (killed / "checkpoints" / "step-8" / "client_state.json").is_file():
            break
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (killed / "head").exists(), "the run finished before it could be killed"
    result = subprocess.run(command(killed), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stdout
    a, b = _head_tensors(straight), _head_tensors(killed)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [r["loss"] for r in _metrics(straight)] == [r["loss"] for r in _metrics(killed)]
