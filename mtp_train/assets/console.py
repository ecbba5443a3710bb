"""Progress output of the asset builds: messages and tqdm bars on stderr (stdout is left to the command's summary)."""

from __future__ import annotations

import sys
from typing import Any


def say(message: str) -> None:
    """A progress message on stderr that does not tear tqdm bars."""
    from tqdm import tqdm  # local: keeps tqdm out of `mtp-train --help` (the CLI imports assets)

    tqdm.write(message, file=sys.stderr)


def progress(**kwargs: Any) -> Any:
    """A tqdm bar on stderr (bytes bars scale to KiB/MiB)."""
    from tqdm import tqdm  # local: keeps tqdm out of `mtp-train --help` (the CLI imports assets)

    if kwargs.get("unit") == "B":
        kwargs.setdefault("unit_scale", True)
        kwargs.setdefault("unit_divisor", 1024)
    return tqdm(file=sys.stderr, dynamic_ncols=True, **kwargs)
