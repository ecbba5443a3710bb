"""vLLM's hidden-states connector, able to write on a CPU build. Loaded by vLLM's engine processes through
`kv_connector_module_path` (this directory is on their PYTHONPATH); imports vLLM, never mtp_train.

vLLM 0.32's `ExampleHiddenStatesConnector` extracts a finished request's captured states from the hidden-state cache
and writes them from a thread after an asynchronous device-to-host copy into pinned memory, timed by CUDA events. A
CPU build has neither pinned memory nor CUDA events: only the lock file appears. Here, where the cache lives in host
memory, the states are gathered and written at once (to a temporary name, renamed when complete) and the request is
reported finished on the next poll; on a GPU the stock path runs unchanged."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """Stands for the stock path's copy-done CUDA event: the write already happened."""

    def query(self) -> bool:
        return True


class MtpTrainHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + torch.arange(self._block_size)[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden_states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()  # [T, layers, hidden]
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        partial = pending.filename + ".partial"
        try:
            save_file({"hidden_states": hidden_states.contiguous(), "token_ids": pending.token_ids.clone()}, partial)
            os.replace(partial, pending.filename)
        finally:
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader waiting on the lock file
        self._req_copy_events[pending.req_id] = _Written()
