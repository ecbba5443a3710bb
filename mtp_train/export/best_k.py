"""The chain k an export writes for serving, read from the head's `mtp-train eval` report: the k with the largest
measured speedup over plain decoding (`evaluate.report.measured_best_k`, the report's own rule), recorded in
config.json's `mtp_train.speculative` with the τ and speedup measured at each k (docs/export.md, "The measured best
k"). Nothing is measured or estimated here.

Which report: `--eval-report FILE` (or its directory), else `<head>/../eval/report.json` (where `mtp-train eval`
writes a run's report) when it measured this head and is not older than its weights. A report of another draft is
refused when given and passed over, with the reason in the export's log line, when found.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.evaluate.report import chain_results, measured_best_k
from mtp_train.fileio import read_json_object
from mtp_train.heads.io import WEIGHTS_SHA256_KEY

log = logging.getLogger(__name__)

REPORT_FILENAME = "report.json"
SPECULATIVE_KEY = "speculative"  # config.json: mtp_train.speculative
DEFAULT_NUM_SPECULATIVE_TOKENS = 3  # k written when neither --num-speculative-tokens nor a report gives one


@dataclass(frozen=True)
class MeasuredK:
    """The eval report's best chain k by measured speedup, and what it measured at each k."""

    report: Path
    method: str  # "<draft>@k=<k>"
    k: int
    by_k: dict[int, dict[str, float]]  # k -> {"tau": ..., "speedup": ...}

    def block(self) -> dict[str, Any]:
        """config.json's mtp_train.speculative."""
        return {"eval_report": str(self.report), "best_k": self.k, "method": self.method,
                "measured": {str(k): numbers for k, numbers in sorted(self.by_k.items())}}


def serving_k(measured: MeasuredK | None, requested: int | None) -> tuple[int, str]:
    """(k for the serving arguments, where it came from): `requested` (--num-speculative-tokens), else the eval
    report's best k by measured speedup, else DEFAULT_NUM_SPECULATIVE_TOKENS."""
    if requested is not None:
        return requested, "--num-speculative-tokens"
    if measured is not None:
        return measured.k, f"the eval report's best k by measured speedup ({measured.method})"
    return DEFAULT_NUM_SPECULATIVE_TOKENS, "the default (no measured k)"


def find_measured_k(head_dir: Path, eval_report: str | os.PathLike[str] | None,
                    use_report: bool = True) -> tuple[MeasuredK | None, str]:
    """(the measured best k, one line saying where it came from or why there is none). `eval_report`: a report
    file or directory given by the user (it must exist and have measured this head: UserError otherwise); None: the
    default place, used only when the report there measured this head. `use_report` False: none."""
    if not use_report:
        return None, "no eval report used (--no-eval-report)"
    if eval_report is not None:
        path = Path(eval_report)
        if path.is_dir():
            path = path / REPORT_FILENAME
        report = read_json_object(path, "an mtp-train eval report")
        reason = _not_this_head(report, head_dir)
        if reason:
            raise UserError(f"{path}: {reason}; pass the report of an eval of this head (mtp-train eval --head "
                            f"{head_dir}), or leave out --eval-report")
        if _older_than_weights(path, head_dir):
            log.warning("%s is older than %s: used as given (--eval-report), but re-run mtp-train eval if the head "
                        "was trained again since", path, head_dir / "model.safetensors")
        return read_measured_k(report, path), f"best k from {path}"
    path = head_dir.parent / "eval" / REPORT_FILENAME
    if not path.is_file():
        return None, f"no eval report at {path} (run mtp-train eval, or pass --eval-report FILE)"
    try:
        report = read_json_object(path, "an mtp-train eval report")
        reason = _not_this_head(report, head_dir)
        if reason:
            return None, f"{path} not used: {reason}"
        if _older_than_weights(path, head_dir):
            return None, (f"{path} not used: it is older than {head_dir / 'model.safetensors'} (the head changed "
                          "since: re-run mtp-train eval, or pass --eval-report FILE to use it anyway)")
        return read_measured_k(report, path), f"best k from {path}"
    except UserError as err:
        raise UserError(f"{err} (found next to the head: fix it, pass --eval-report FILE, or --no-eval-report)"
                        ) from None


def read_measured_k(report: dict[str, Any], path: Path) -> MeasuredK:
    """The best chain k of the report's draft by measured speedup, with the τ and speedup at each k (a UserError
    naming the key when the report lacks them or holds them in the wrong form). Where the eval also served the head
    in vLLM (`eval --engine vllm|both`: the report's `vllm` section), vLLM's measurement is the one taken: it is the
    engine the exports are served by."""
    if isinstance(report.get("vllm"), dict):
        return _vllm_measured_k(report["vllm"], path)
    draft, overall = report.get("draft_method"), report.get("overall")
    if not isinstance(draft, str) or not isinstance(overall, dict):
        raise UserError(f"{path}: no draft_method / overall (is it an mtp-train eval report?)")
    by_k = {}
    for k, numbers in chain_results(overall, draft).items():
        where = f"overall.{draft}@k={k}"
        if not isinstance(numbers, dict):
            raise UserError(f"{path}: {where}: expected an object of numbers")
        by_k[k] = {key: _number(numbers, path, where, key) for key in ("tau", "speedup")}
    if not by_k:
        raise UserError(f"{path}: overall holds no chain of the draft ({draft}@k=<k>) to take a k from")
    best = measured_best_k({k: numbers["speedup"] for k, numbers in by_k.items()})
    return MeasuredK(report=path.resolve(), method=f"{draft}@k={best}", k=best, by_k=by_k)


def _vllm_measured_k(section: dict[str, Any], path: Path) -> MeasuredK:
    """The best k of an eval's vLLM section (`export.vllm_eval.evaluate_in_vllm`: methods "<kind>@k=<k>")."""
    methods = section.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise UserError(f"{path}: vllm.methods holds no measured k (is it an mtp-train eval report?)")
    by_k, names = {}, {}
    for name, numbers in methods.items():
        where = f"vllm.methods.{name}"
        if not isinstance(numbers, dict) or "@k=" not in name:
            raise UserError(f"{path}: {where}: expected '<kind>@k=<k>' with an object of numbers")
        k = int(_number(numbers, path, where, "k"))
        by_k[k] = {key: _number(numbers, path, where, key) for key in ("tau", "speedup")}
        names[k] = name
    best = measured_best_k({k: numbers["speedup"] for k, numbers in by_k.items()})
    return MeasuredK(report=path.resolve(), method=f"vllm {names[best]}", k=best, by_k=by_k)


def _number(entry: dict[str, Any], path: Path, where: str, key: str) -> float:
    value = entry.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UserError(f"{path}: {where}.{key}={value!r}; expected a number")
    return float(value)


def _older_than_weights(report_path: Path, head_dir: Path) -> bool:
    """Whether the report was written before the head's weights (a head trained again after its eval)."""
    weights = head_dir / "model.safetensors"
    return weights.is_file() and report_path.stat().st_mtime < weights.stat().st_mtime


def _not_this_head(report: dict[str, Any], head_dir: Path) -> str | None:
    """Why `report` is not a measurement of the head at `head_dir` (None when it is): its draft must be a head, at
    the same directory or a copy with the same recorded weights checksum."""
    kind, draft = report.get("draft_kind"), report.get("draft")
    if not isinstance(kind, str) or not isinstance(draft, str):
        return "no draft / draft_kind keys (not a report of mtp-train eval)"
    if not kind.startswith("head"):
        return f"it measured a {kind} ({draft}), not a head"
    draft_dir = Path(draft)
    try:
        if draft_dir.exists() and os.path.samefile(draft_dir, head_dir):
            return None
    except OSError:
        pass
    mine, theirs = _weights_sha256(head_dir), _weights_sha256(draft_dir)
    if mine is not None and mine == theirs:
        return None
    return f"it measured the head {draft}, not {head_dir}"


def _weights_sha256(head_dir: Path) -> str | None:
    """The weights checksum `save_head` records in head_config.json (None when there is none to read)."""
    try:
        recorded = read_json_object(head_dir / "head_config.json").get(WEIGHTS_SHA256_KEY)
    except UserError:
        return None
    return recorded if isinstance(recorded, str) else None


def describe(config: dict[str, Any], block_key: str) -> str | None:
    """One line for a person (the export command prints it): the k recorded in config.json's
    mtp_train.speculative and the speedups measured per k; None when the export records none."""
    block = (config.get(block_key) or {}).get(SPECULATIVE_KEY)
    if not isinstance(block, dict):
        return None
    measured = ", ".join(f"k={k} {numbers['speedup']:.2f}× (τ {numbers['tau']:.3f})"
                         for k, numbers in block["measured"].items())
    line = f"best k by measured speedup: {block['best_k']} ({block_key}.{SPECULATIVE_KEY} in config.json; {measured}"
    line += f"; from {block['eval_report']})"
    if max(numbers["speedup"] for numbers in block["measured"].values()) < 1.0:
        line += "; no k beat plain decoding on the machine measured"
    return line
