"""Atomic file writes shared by every stage: write a temporary sibling, fsync, rename into place.

A reader never sees a half-written file, and a killed writer leaves only a `.<name>.tmp-<pid>` file behind (stages
that resume remove those of their own)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno == errno.ENOSPC:
            raise UserError(f"{target}: disk full while writing; free space and rerun the same command") from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike[str], value: Any) -> Path:
    return atomic_write_bytes(path, (json.dumps(value, indent=2) + "\n").encode("utf-8"))
