"""`scripts/gpu_check.py --cpu`: the GPU machine's check runs on CPU in its smoke mode, so that it cannot rot between
the rare sessions that have a GPU. Every section that can run on a CPU must pass; the CUDA-only one says why it
skipped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_runs_in_its_cpu_smoke_mode(tmp_path):
    # A rendezvous port taken, as the suite's own in-process trainer leaves MASTER_PORT set and its store listening:
    # the script's training processes must pick their own.
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "MASTER_PORT": str(taken.getsockname()[1])}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--cpu", "--out", str(tmp_path),
                           "--work", str(tmp_path / "work")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    taken.close()
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")][-1]
    pairs = dict(item.split("=", 1) for item in result.split()[1:])
    for section in ("env", "parity", "precompute", "train", "eval", "attention"):
        assert pairs[section] == "ok", (section, output[-4000:])
    assert pairs["flashinfer"] == "skipped"
    assert pairs["train_resumed_at_step"] == "10" and pairs["train_steps"] == "20"
    assert pairs["eval_b1_identical"] == "1" and pairs["eval_b4_identical"] == "1"
    assert float(pairs["eval_b1_syncs_per_forward"]) > 0  # the counter reached the decode loop
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    skipped = {s["name"]: s["reason"] for s in report["sections"] if s["status"] == "skipped"}
    assert skipped == {"flashinfer": "needs CUDA"}


def test_gpu_check_refuses_to_run_without_cuda_unless_told_cpu():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--cpu" in done.stderr
