"""The target's hidden states captured by vLLM (`precompute.backend: vllm`).

`VllmCapture` starts `worker/mtp_train_vllm_worker.py` in vLLM's interpreter (`find_vllm_python`), which runs the
target with vLLM's speculative method `extract_hidden_states`: every prompt position's residual stream after the
chosen decoder layers is written by a hidden-states KV connector to one safetensors file per sample. Layer ids are
vLLM's: id 0 the embedding output, id k >= 1 the output of decoder layer k - 1, with no final norm applied (the
caller applies it where it wants the post-norm state). The files are read here with safetensors (never pickle),
checked against the sample's token ids and removed.

The worker's own output (vLLM's logs, a traceback) goes to a log file; an error names it with its last lines."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from mtp_train.vllm_engine.engine import VllmWorker


class VllmCapture:
    """One vLLM engine over `model_dir` capturing `layer_ids` (vLLM's ids, any order, no repeats) for each sample.

    `start()` returns what the engine reports (vLLM version, dtype, K/V cache dtype, device); `capture(samples)` the
    states of each sample, [T, len(layer_ids), hidden] in the engine's dtype, layers in the order given; `close()`
    ends the worker. `work_dir` holds the per-sample files on their way (removed as read) and `worker.log`;
    `devices`: the CUDA devices the engine takes (`VllmWorker`)."""

    def __init__(self, model_dir: str | Path, dtype: str, layer_ids: list[int], work_dir: str | Path,
                 engine_args: dict | None = None, python: str | None = None, devices: list[int] | None = None):
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"repeated layer ids {layer_ids}")
        self.layer_ids = list(layer_ids)
        self.stored_ids = sorted(self.layer_ids)  # vLLM stores its ids sorted
        self.order = [self.stored_ids.index(i) for i in self.layer_ids]
        self.engine_args = dict(engine_args or {})
        self.states_dir = Path(work_dir) / "states"
        self.worker = VllmWorker({"mode": "capture", "model": str(Path(model_dir).resolve()), "dtype": dtype,
                                  "layer_ids": self.stored_ids, "out_dir": str(self.states_dir),
                                  "engine_args": self.engine_args}, work_dir, python, devices)
        self.python, self.log_path = self.worker.python, self.worker.log_path

    def start(self) -> dict:
        if self.states_dir.exists():
            shutil.rmtree(self.states_dir)  # files of a killed run's worker: never read
        self.states_dir.mkdir(parents=True)
        return self.worker.start()

    def capture(self, samples: list[list[int]]) -> list[torch.Tensor]:
        files = self.worker.request({"op": "capture", "samples": samples}, "files")
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
        self.worker.close(abort)
        shutil.rmtree(self.states_dir, ignore_errors=True)  # what a failed request left; the log stays
