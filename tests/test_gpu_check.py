"""`scripts/gpu_check.py --cpu`: the GPU machine's check runs on CPU in its smoke mode, so that it cannot rot between
the rare sessions that have a GPU. Every section that can run on a CPU must pass; the CUDA-only one says why it
skipped. It runs where mtp_train is not installed (the GPU machine gets the working tree). And
`scripts/gpu_wheelhouse.sh`, which builds the wheels for that machine: the command it prints is the one
docs/scaling.md shows, and it carries the FlashInfer version pyproject.toml's `gpu` extra names."""

from __future__ import annotations

import json
import os
import re
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


def _site_without_mtp_train(tmp_path: Path) -> Path:
    """A folder of links to every entry of this interpreter's site-packages except mtp_train's own (a copy or an
    editable install's finder) and the path files (.pth, which only `site` reads): on PYTHONPATH, under `python -S`,
    it is a machine where torch and the rest are installed and mtp_train is not (the GPU machine's image)."""
    import sysconfig

    site = tmp_path / "site"
    site.mkdir()
    for folder in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(folder).iterdir():
            if entry.name.startswith(("mtp_train", "__editable__")) or entry.suffix == ".pth":
                continue
            if not (site / entry.name).exists():
                (site / entry.name).symlink_to(entry)
    return site


def test_gpu_check_runs_from_a_checkout_where_mtp_train_is_not_installed(tmp_path):
    """The GPU machine gets the working tree and a wheelhouse, not an install of mtp_train: the script puts its own
    checkout on the path before any mtp_train import."""
    env = {**os.environ, "PYTHONPATH": str(_site_without_mtp_train(tmp_path))}
    plain = subprocess.run([sys.executable, "-S", "-c", "import torch, mtp_train"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    # the premise: in this setup torch imports and mtp_train does not, but through the script's own path insertion
    assert plain.returncode != 0 and "No module named 'mtp_train'" in plain.stderr, plain.stderr[-2000:]
    done = subprocess.run([sys.executable, "-S", str(REPO / "scripts" / "gpu_check.py"), "--cpu", "--sections", "env",
                           "--work", str(tmp_path / "work")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "RESULT device=cpu env=ok" in done.stdout


def test_gpu_check_refuses_to_run_without_cuda_unless_told_cpu():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--cpu" in done.stderr


WHEELHOUSE = REPO / "scripts" / "gpu_wheelhouse.sh"


def _doc_commands() -> list[str]:
    """The ```bash blocks of docs/scaling.md's "Checking a GPU machine", each with its continuations joined."""
    text = (REPO / "docs" / "scaling.md").read_text(encoding="utf-8")
    section = text.split("### Checking a GPU machine", 1)[1].split("\n## ", 1)[0]
    return [re.sub(r"\s*\\\n\s*", " ", block).strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_the_wheelhouse_command_is_the_one_the_docs_show():
    printed = subprocess.run(["bash", str(WHEELHOUSE), "--print-command"], cwd=REPO, capture_output=True, text=True,
                             timeout=60, check=True).stdout.strip()
    assert "scripts/gpu_check.py --out" in printed and "--target /tmp/wh wheelhouse/base/*.whl" in printed
    assert printed in _doc_commands(), "docs/scaling.md shows another first-call command than the script prints"
    second = subprocess.run(["bash", str(WHEELHOUSE), "--print-command", "--flashinfer"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert "wheelhouse/flashinfer/*.whl" in second and "--sections flashinfer" in second
    for command in (printed, second):  # each ends inside a 600 s call, its timeouts what is left of 570 s
        assert "D=$((SECONDS + 570))" in command and "timeout $(( D - SECONDS" in command
        assert len(command) <= 2000


def test_the_wheelhouse_refuses_an_output_folder_outside_the_checkout(tmp_path):
    done = subprocess.run(["bash", str(WHEELHOUSE), "--out", str(tmp_path), "--print-command"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "inside the repository" in done.stderr


def test_the_wheelhouse_carries_the_flashinfer_version_the_gpu_extra_names():
    script = WHEELHOUSE.read_text(encoding="utf-8")
    carried = re.search(r'FLASHINFER_PINS=\("flashinfer-python==([^"]+)"\)', script).group(1)
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'gpu = \["flashinfer-python>=([^"]+)"\]', pyproject).group(1) == carried
