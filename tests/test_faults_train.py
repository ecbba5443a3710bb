"""Training's run dir under faults (issue 14): `--resume never` moves the previous run aside (auto-resume and pruning
never mix runs), a planted pickle in a checkpoint does not run, a truncated checkpoint falls back to the previous one,
a full disk removes the partial checkpoint and says so, a checkpoint of another world size is refused naming it, one
trainer per run dir, summary.json counting the whole run, workers exiting with their launcher, and kill -9 + resume
matching an uninterrupted run. Issue 44: a checkpoint tied to the cache, data and target it trained on (item 2);
resuming an older checkpoint retires the later ones, and saves are staged (item 3)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.recipe import load_recipe
from tests.pipeline_fixtures import RECIPE_PATH, free_port, tiny_features

REPO = Path(__file__).resolve().parent.parent
RECIPE = RECIPE_PATH
TRAIN = {"train.micro_batch_tokens": 256, "train.warmup_steps": 2, "train.lr": 3e-3, "train.zero_stage": 2,
         "train.eval_every": 100, "train.save_every": 2}


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults-train")
    _, overrides = tiny_features(root, num_conversations=40, **TRAIN)
    return root, overrides


def _train(overrides: list[str], run_dir: Path, *extra: str, resume: str = "auto") -> Path:
    from mtp_train.train.trainer import run_training

    recipe = load_recipe(RECIPE, overrides + [f"train.run_dir={run_dir}", *extra])
    return run_training(recipe, resume=resume, show_progress=False)


def _head(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "head" / "model.safetensors")


def _assert_same_head(a: Path, b: Path) -> None:
    head_a, head_b = _head(a), _head(b)
    assert head_a.keys() == head_b.keys()
    for key in head_a:
        assert torch.equal(head_a[key], head_b[key]), key


def _steps(run_dir: Path) -> list[str]:
    return sorted((p.name for p in (run_dir / "checkpoints").glob("step-*")), key=lambda n: int(n.split("-")[1]))


@pytest.fixture(scope="module")
def finished(features):
    """A finished 4-step run (checkpoints step-2, step-4) that tests copy and damage."""
    root, overrides = features
    run_dir = root / "finished"
    _train(overrides, run_dir, "train.max_steps=4")
    return run_dir


def test_resume_never_moves_the_previous_run_aside(features, finished, tmp_path, capsys):
    """Issue item 1: the new run's checkpoints are not pruned in favour of the old run's, and auto-resume continues
    the new run, not the old one."""
    _, overrides = features
    run_dir = tmp_path / "reused"
    shutil.copytree(finished, run_dir)
    _train(overrides, run_dir, "train.max_steps=3", "train.save_every=1", "train.keep_last=2", resume="never")
    out = capsys.readouterr().out
    assert "previous run's checkpoints, metrics, summary and head were moved to" in out
    assert _steps(run_dir) == ["step-2", "step-3"]
    (backup,) = (run_dir / "previous-runs").iterdir()
    assert _steps(backup) == ["step-2", "step-4"]
    _assert_same_head(backup, finished)
    new_head = _head(run_dir)
    run_id = (run_dir / "run_id").read_text().strip()
    assert run_id != (backup / "run_id").read_text().strip()
    assert json.loads((run_dir / "checkpoints" / "step-3" / "client_state.json").read_text())["run_id"] == run_id
    _train(overrides, run_dir, "train.max_steps=3", "train.save_every=1", "train.keep_last=2")
    assert f"resumed from {run_dir / 'checkpoints' / 'step-3'} at step 3" in capsys.readouterr().out
    assert all(torch.equal(new_head[k], v) for k, v in _head(run_dir).items())
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_pruning_keeps_other_runs_checkpoints(features, finished, tmp_path):
    """A checkpoint of another run id in the checkpoints dir is neither resumed nor pruned."""
    from mtp_train.train.checkpoints import run_checkpoints

    run_dir = tmp_path / "mixed"
    shutil.copytree(finished, run_dir)
    foreign = run_dir / "checkpoints" / "step-40"
    shutil.copytree(run_dir / "checkpoints" / "step-4", foreign)
    state = json.loads((foreign / "client_state.json").read_text())
    (foreign / "client_state.json").write_text(json.dumps({**state, "step": 40, "run_id": "someone-else"}))
    own = run_checkpoints(run_dir / "checkpoints", (run_dir / "run_id").read_text().strip())
    assert [c.path.name for c in own] == ["step-2", "step-4"]
    _, overrides = features
    _train(overrides, run_dir, "train.max_steps=6", "train.keep_last=1")
    assert _steps(run_dir) == ["step-6", "step-40"]


class _Planted:
    """An object whose unpickling creates a file (what a malicious checkpoint would do with a shell command)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_pickle_in_a_checkpoint_does_not_run(features, finished, tmp_path):
    """Issue item 3: resuming loads DeepSpeed's files weights-only; the planted object is refused by file name."""
    _, overrides = features
    run_dir = tmp_path / "planted"
    shutil.copytree(finished, run_dir)
    marker = tmp_path / "pwned"
    planted = run_dir / "checkpoints" / "step-4" / "mp_rank_00_model_states.pt"
    torch.save({"module": _Planted(marker)}, planted)
    with pytest.raises(UserError, match=f"{planted}: refused to load") as caught:
        _train(overrides, run_dir, "train.max_steps=6")
    assert "nothing in it was run" in str(caught.value)
    assert not marker.exists()


def test_checkpoint_classes_are_exactly_the_allowed_ones(finished):
    """The allow-list covers what a real ZeRO-2 checkpoint stores (so resuming works), and nothing is left over."""
    from mtp_train.train.checkpoints import safe_torch_load

    for path in sorted((finished / "checkpoints" / "step-4").glob("*.pt")):
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        assert set(unsafe) <= {"numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct",
                               "numpy.core.multiarray._reconstruct", "numpy.dtypes.UInt32DType",
                               "deepspeed.utils.tensor_fragment.fragment_address",
                               "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                               "deepspeed.runtime.zero.config.ZeroStageEnum"}, (path, unsafe)
        assert isinstance(safe_torch_load(path), dict)


def test_truncated_checkpoint_falls_back_to_the_previous_one(features, finished, tmp_path, capsys):
    _, overrides = features
    run_dir = tmp_path / "truncated"
    shutil.copytree(finished, run_dir)
    shutil.rmtree(run_dir / "head")
    broken = run_dir / "checkpoints" / "step-4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.truncate(broken, broken.stat().st_size // 2)
    with pytest.raises(UserError, match=f"step-4: cannot resume from this checkpoint: {broken}: truncated"):
        _train(overrides, run_dir, "train.max_steps=4", resume=str(run_dir / "checkpoints" / "step-4"))
    _train(overrides, run_dir, "train.max_steps=4")
    out = capsys.readouterr().out
    assert f"skipping checkpoint step-4: {broken}: truncated" in out
    assert "step-2 at step 2" in out
    _assert_same_head(run_dir, finished)  # resumed from step 2 exactly


def test_disk_full_while_saving_removes_the_partial_checkpoint(features, tmp_path, monkeypatch):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    _, overrides = features
    real_save = TorchCheckpointEngine.save

    def full_at_step_4(self, state_dict, path):
        if "step-4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, state_dict, path)

    monkeypatch.setattr(TorchCheckpointEngine, "save", full_at_step_4)
    run_dir = tmp_path / "full"
    with pytest.raises(UserError, match=r"step-4: disk full while saving this checkpoint .* partial checkpoint was "
                                        r"removed\. Free space") as caught:
        _train(overrides, run_dir, "train.max_steps=6")
    assert "older checkpoints: step-2" in str(caught.value)
    assert _steps(run_dir) == ["step-2"]


def test_other_world_size_is_refused_naming_it(features, finished, tmp_path):
    _, overrides = features
    run_dir = tmp_path / "two-ranks"
    shutil.copytree(finished, run_dir)
    step = run_dir / "checkpoints" / "step-4"
    state = json.loads((step / "client_state.json").read_text())
    (step / "client_state.json").write_text(json.dumps({**state, "world_size": 2}))
    with pytest.raises(UserError, match="step-4: saved by 2 ranks, this run has 1; ZeRO-2 .* Resume with 2 ranks"):
        _train(overrides, run_dir, "train.max_steps=6")


@pytest.mark.parametrize("key", ["run_id", "world_size", "tokens"])
def test_checkpoint_of_an_older_mtp_train_is_refused(features, finished, tmp_path, key):
    """A client state without a key this trainer records: refused, naming the file and what to do (not guessed from
    the reader state, the ZeRO partitions or the metric rows)."""
    _, overrides = features
    run_dir = tmp_path / "older"
    shutil.copytree(finished, run_dir)
    client = run_dir / "checkpoints" / "step-4" / "client_state.json"
    state = json.loads(client.read_text())
    del state[key]
    client.write_text(json.dumps(state))
    if key == "run_id":  # a run dir of before run ids: no run_id file either, so every checkpoint is a candidate
        (run_dir / "run_id").unlink()
    with pytest.raises(UserError, match=rf"step-4/client_state\.json: no {key}: a checkpoint written by an older "
                                        r"mtp-train; start over with --resume never"):
        _train(overrides, run_dir, "train.max_steps=6")


def test_second_trainer_is_refused_and_a_stale_lock_taken_over(features, tmp_path, capsys):
    from mtp_train.train.checkpoints import RunDirLock

    _, overrides = features
    run_dir = tmp_path / "locked"
    with RunDirLock(run_dir):
        with pytest.raises(UserError, match=f"another process is using this run dir \\(pid {os.getpid()} on host "
                                            f"{socket.gethostname()}, `python -m pytest "):
            _train(overrides, run_dir, "train.max_steps=2")
    assert (run_dir / ".lock").read_text() == ""  # released
    (run_dir / ".lock").write_text("4194305 otherhost\n")  # left by a trainer that was killed
    _train(overrides, run_dir, "train.max_steps=2")
    assert "taking over the lock" in capsys.readouterr().out


def test_summary_counts_the_whole_run_after_a_resume(features, tmp_path, capsys):
    """bf16 training (DeepSpeed's bf16 checkpoint classes load weights-only too); summary tokens = all metric rows."""
    _, overrides = features
    run_dir = tmp_path / "summary"
    _train(overrides, run_dir, "train.max_steps=2", "precision.compute=bfloat16")
    _train(overrides, run_dir, "train.max_steps=4", "precision.compute=bfloat16")
    assert "resumed from" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_at_step"] == 2
    assert summary["tokens"] == sum(r["tokens"] for r in rows)
    assert summary["session_tokens"] == sum(r["tokens"] for r in rows[2:])


CHILD = """
import os, signal, sys, time
from pathlib import Path
sys.argv[1:] = []
from mtp_train.cli import exit_with_launcher
exit_with_launcher()
Path(os.environ["READY"]).write_text(str(os.getpid()))
time.sleep(60)
"""
LAUNCHER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", os.environ["CHILD"]])
time.sleep(60)
"""


def test_workers_exit_when_their_launcher_is_killed(tmp_path):
    """The mechanism `mtp-train` uses under torchrun: a worker asks to be killed with its parent."""
    ready = tmp_path / "ready"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "READY": str(ready), "CHILD": CHILD, "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.is_file() or not ready.read_text():
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
        worker = int(ready.read_text())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 5
        while Path(f"/proc/{worker}").exists() and "Z" not in _state(worker):
            assert time.monotonic() < deadline, "the worker outlived its launcher"
            time.sleep(0.05)
    finally:
        launcher.kill()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


KILLED_CHILD = """
import sys, time
from pathlib import Path
import torch
import mtp_train.train.trainer as trainer
from mtp_train.cli import main

ready, stop_after = Path(sys.argv[1]), int(sys.argv[2])
real_save = trainer.save_checkpoint

def save_then_wait(run, step, **kwargs):
    path = real_save(run, step, **kwargs)
    if step == stop_after:
        ready.write_text("saved")
        time.sleep(600)
    return path

trainer.save_checkpoint = save_then_wait
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow
def test_kill_9_of_a_new_run_then_resume_matches_uninterrupted(features, finished, tmp_path, capsys):
    """`--resume never` into a used run dir, SIGKILL right after its step-2 checkpoint, rerun: it resumes the new
    run (not the old one) and ends with the head an uninterrupted run gets."""
    root, overrides = features
    straight = tmp_path / "straight"
    _train(overrides, straight, "train.max_steps=4")
    run_dir = tmp_path / "killed"
    shutil.copytree(finished, run_dir)
    ready = tmp_path / "ready"
    args = ["train", "--recipe", str(RECIPE), *[a for o in overrides for a in ("--set", o)],
            "--set", f"train.run_dir={run_dir}", "--set", "train.max_steps=4", "--resume", "never"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "MASTER_PORT": str(free_port())}  # the in-process runs' group holds the inherited port
    log = tmp_path / "child.log"
    with log.open("w") as stream:
        child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(ready), "2", *args], cwd=REPO, env=env,
                                 stdout=stream, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not ready.is_file():
            assert child.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert _steps(run_dir) == ["step-2"]
    _train(overrides, run_dir, "train.max_steps=4")
    assert f"resumed from {run_dir / 'checkpoints' / 'step-2'} at step 2" in capsys.readouterr().out
    _assert_same_head(run_dir, straight)
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses == [json.loads(line)["loss"] for line in (straight / "metrics.jsonl").read_text().splitlines()]


# ---- issue 44, item 2: a checkpoint is tied to the cache, data and target it trained on ------------------------------


@pytest.fixture(scope="module")
def other_features(tmp_path_factory):
    """Another prepared dataset (more conversations) and its cache: what `prepare` with more samples and `precompute
    --force` leave behind."""
    root = tmp_path_factory.mktemp("faults-train-other")
    _, overrides = tiny_features(root, num_conversations=48, **TRAIN)
    return overrides


def test_resume_on_another_feature_cache_is_refused_naming_both(features, finished, other_features, tmp_path):
    from mtp_train.features.format import cache_identity, load_manifest

    _, overrides = features
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    state = json.loads((run_dir / "checkpoints" / "step-4" / "client_state.json").read_text())
    recorded = state["trained_on"]
    old_cache = load_manifest(Path(recorded["features_dir"]))
    assert recorded["features"] == cache_identity(old_cache)
    new_dir = next(o.split("=", 1)[1] for o in other_features if o.startswith("precompute.output_dir="))
    new_cache = cache_identity(load_manifest(Path(new_dir)))
    with pytest.raises(UserError, match=rf"step-4: trained on another prepared data {recorded['dataset']}; this "
                                        r"run's is \w+; continuing would train on the new data from the old position"):
        _train(other_features, run_dir, "train.max_steps=6")
    assert _steps(run_dir) == ["step-2", "step-4"]  # nothing trained, nothing pruned
    assert new_cache != recorded["features"]

    # the same cache under another directory (moved): its identity is the same, the run resumes
    moved = tmp_path / "moved-features"
    shutil.copytree(recorded["features_dir"], moved)
    _train(overrides + [f"precompute.output_dir={moved}"], run_dir, "train.max_steps=6")
    assert _steps(run_dir)[-1] == "step-6"


def test_a_checkpoint_that_names_no_cache_resumes_only_with_force(features, finished, tmp_path):
    _, overrides = features
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    client = run_dir / "checkpoints" / "step-4" / "client_state.json"
    state = json.loads(client.read_text())
    del state["trained_on"]  # as saved before checkpoints recorded it
    client.write_text(json.dumps(state))
    with pytest.raises(UserError, match="saved before checkpoints named their feature cache.*--force to resume"):
        _train(overrides, run_dir, "train.max_steps=6")
    from mtp_train.train.trainer import run_training

    run_training(load_recipe(RECIPE, overrides + [f"train.run_dir={run_dir}", "train.max_steps=6"]), force=True,
                 show_progress=False)
    assert _steps(run_dir)[-1] == "step-6"


# ---- issue 44, item 3: resuming an older checkpoint, and saves that never write over a checkpoint in place ----------


def test_resuming_an_older_checkpoint_retires_the_later_ones(features, finished, tmp_path, capsys):
    """Before: step-4 stayed beside the continuation from step-2, and a later automatic resume jumped back to it."""
    _, overrides = features
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    _train(overrides, run_dir, "train.max_steps=3", "train.save_every=1", resume=str(run_dir / "checkpoints/step-2"))
    out = capsys.readouterr().out
    assert "its later checkpoints (step-4) were moved to" in out
    assert _steps(run_dir) == ["step-2", "step-3"]
    retired = list((run_dir / "previous-runs").glob("*-after-step-2/checkpoints/step-4"))
    assert len(retired) == 1 and (retired[0] / "client_state.json").is_file()  # kept, not deleted
    _train(overrides, run_dir, "train.max_steps=4", "train.save_every=1")  # auto: continues the new branch
    assert f"resumed from {run_dir / 'checkpoints' / 'step-3'} at step 3" in capsys.readouterr().out
    assert _steps(run_dir) == ["step-3", "step-4"] and retired[0].is_dir()  # keep_last 2; the retired one kept


def _process_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def test_a_save_that_fails_midway_leaves_the_existing_checkpoint_whole(tmp_path, monkeypatch):
    """A save over an existing step-N used to write in place: DeepSpeed's files first, the client state last, so a
    kill in between paired new model states with the old optimizer state and client state. Now the save is staged
    and renamed into place; an interrupted one leaves the old checkpoint as it was and no staging directory."""
    from types import SimpleNamespace

    from mtp_train.train import trainer

    _process_group()
    checkpoints = tmp_path / "checkpoints"
    old = checkpoints / "step-4"
    old.mkdir(parents=True)
    (old / "mp_rank_00_model_states.pt").write_bytes(b"old model")
    (old / "client_state.json").write_text(json.dumps({"step": 4, "run_id": "r"}))

    class Engine:
        def save_checkpoint(self, save_dir, tag, client_state, save_latest=True):
            (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
            (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"new model")

    manifest = {"fingerprints": {"dataset": "d"}, "splits": {}}
    run = SimpleNamespace(
        world_size=1, is_main=True, checkpoint_dir=checkpoints, run_id="r", fingerprint="t", engine=Engine(),
        train_reader=SimpleNamespace(state_dict=lambda: {}, manifest=manifest),
        recipe=SimpleNamespace(features_dir=tmp_path / "features", target=SimpleNamespace(path="target"),
                               train=SimpleNamespace(keep_last=3)))

    def killed(path, value):  # the client state is written last: fail there, as a kill at that moment would
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(trainer, "write_json_atomic", killed)  # where save_checkpoint calls it
    with pytest.raises(OSError):
        trainer.save_checkpoint(run, 4)
    assert (old / "mp_rank_00_model_states.pt").read_bytes() == b"old model"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-4"]  # no staging directory left

    monkeypatch.undo()
    trainer.save_checkpoint(run, 4)  # complete: replaces the old one whole
    assert (old / "mp_rank_00_model_states.pt").read_bytes() == b"new model"
    assert json.loads((old / "client_state.json").read_text())["step"] == 4
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-4"]


# ---- issue 43, item 1: ZeRO-3 checkpoints resume ---------------------------------------------------------------------


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_files_to_load_are_the_names_deepspeed_gives(tmp_path, zero_stage, bf16):
    """The files resume checks are the ones DeepSpeed's engine names for this rank (its own naming functions, called
    with the engine's settings): ZeRO-3 reads the rank's own `zero_pp_rank_{r}_..._model_states.pt`, never the
    `mp_rank_00_model_states.pt` that only ZeRO-0/1/2 write."""
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine

    from mtp_train.train.checkpoints import files_to_load

    engine = SimpleNamespace(checkpoint_mp_rank=0, zero_optimization_partition_weights=lambda: zero_stage == 3,
                             _get_zero_ckpt_prefix=lambda dp_rank, bf16_mode: DeepSpeedEngine._get_zero_ckpt_prefix(
                                 None, dp_rank, bf16_mode))
    for rank in range(3):
        model_states = DeepSpeedEngine._get_ckpt_name(engine, str(tmp_path), "step-2", pp_placeholder=rank)
        expected = [Path(model_states)]
        if zero_stage > 0:
            optim_states = Path(DeepSpeedEngine._get_rank_zero_ckpt_name(engine, str(tmp_path), "step-2", 0, rank,
                                                                          bf16))
            optim_states.parent.mkdir(exist_ok=True)
            optim_states.touch()  # the bf16 name is chosen when that file is there
            expected.append(optim_states)
        assert files_to_load(tmp_path / "step-2", rank, zero_stage) == expected
