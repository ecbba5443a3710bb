"""`make serve-check`: serve our exported heads in a real engine (vLLM, CPU) and compare it with our own evaluation.

For each case of CASES (head kind, export format, how vLLM is told to use it), on the demo's held-out prompts:
  1. export the head (`mtp_train.export.export_head`, float32) to exports/serve-check/<format>/export;
  2. our side: `mtp-train eval --head <export>` (the engine the project ships; greedy, fp32, k tokens, the same
     prompts and max new tokens), read from its report.json: mean acceptance length and acceptance per position;
  3. vLLM's side, one process at a time (`.venv-vllm/bin/python` running this file with --vllm-worker): the target
     alone (plain), then the target with the export as its speculative draft; CPU, fp32, greedy, enforce_eager, one
     OpenMP thread; vLLM's spec-decode counters from `LLM.get_metrics()` (vllm:spec_decode_num_drafts,
     _num_accepted_tokens, _num_accepted_tokens_per_pos);
  4. checks: vLLM's speculative output == its plain output on every prompt; vLLM's mean acceptance length (1 +
     accepted / drafts) and each position's acceptance (accepted at j / drafts) within TOLERANCE of ours (ours in
     the same terms: 1 + the sum of our per-position acceptance).
Prints a table and a last line `RESULT key=value ...`; exits 1 on any failed check.

The head: HEAD=<run dir or head dir> (environment or --head), else runs/smollm2-135m-mtp (what `make demo` trains),
else a short training run of the default recipe (SHORT_RUN overrides; see `train_short_head`). A head with a reduced
draft vocabulary is exported with --full-vocab for the MiMo-MTP layout (vLLM's MiMoMTP has none), and our side is
evaluated on that same export, so both engines run the same full-vocabulary head.

One more case is one line in CASES (a kind, a format, the vLLM speculative method, whether it needs --full-vocab).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
TOLERANCE = 0.02  # |vLLM - ours| for the mean acceptance length and for each position's acceptance
DEFAULT_RUN = REPO / "runs" / "smollm2-135m-mtp"
WORK = REPO / "exports" / "serve-check"  # exports, our eval reports, vLLM logs (git-ignored)
# One vLLM process at a time, one thread each: this machine is shared (2 cores).
VLLM_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
# The short run trained when no head exists (default recipe + these overrides; `make serve-check` on a fresh clone).
SHORT_RUN = ["name=serve-check", "data.max_samples=200", "train.epochs=1"]


@dataclass(frozen=True)
class Case:
    """One (head kind, export format) that vLLM serves: `method` is vLLM's speculative_config method; `full_vocab`:
    export a reduced draft vocabulary as the full one (the layout has none); `hf_overrides`: what the target's config
    needs for this method (`LLM(hf_overrides=...)`)."""

    kind: str
    format: str
    method: str
    full_vocab: bool
    hf_overrides: dict | None = None


CASES = [
    Case("mtp", "vllm-mtp", "mtp", full_vocab=True, hf_overrides={"num_nextn_predict_layers": 1}),
    # EAGLE-1 (`eagle`, method "eagle") needs a head trained with head.fc_bias: false; the demo trains an mtp head.
    Case("eagle3", "eagle3", "eagle3", full_vocab=False),  # the draft vocabulary kept (d2t)
]


# ---- the vLLM side (runs inside .venv-vllm) --------------------------------------------------------------------------


def vllm_worker(job_path: str, out_path: str) -> None:
    """Run one vLLM generation job (JSON: target, prompts, max_new_tokens, stop_token_ids, speculative_config or
    null) and write {outputs, metrics, vllm_version, seconds}."""
    job = json.loads(Path(job_path).read_text())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    kwargs = {}
    if job["speculative_config"]:
        kwargs["speculative_config"] = job["speculative_config"]
        kwargs["hf_overrides"] = job.get("hf_overrides") or None
    llm = LLM(model=job["target"], dtype="float32", enforce_eager=True, max_model_len=job["max_model_len"],
              disable_log_stats=False, seed=0, max_num_seqs=1, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"],
                            stop_token_ids=job["stop_token_ids"])
    outputs = []
    for ids in job["prompts"]:  # one at a time, batch 1, as our eval
        result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        outputs.append(list(result.outputs[0].token_ids))
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = list(metric.values) if hasattr(metric, "values") else metric.value
    Path(out_path).write_text(json.dumps({"outputs": outputs, "metrics": metrics, "vllm_version": vllm.__version__,
                                          "seconds": round(time.perf_counter() - started, 1)}))


def run_vllm(job: dict, work: Path, label: str) -> dict:
    """One vLLM process (the worker above, in .venv-vllm) for `job`; its log goes to work/<label>.log."""
    job_path, out_path, log_path = work / f"{label}.job.json", work / f"{label}.out.json", work / f"{label}.log"
    job_path.write_text(json.dumps(job))
    env = {**os.environ, **VLLM_ENV}
    with log_path.open("w") as log:
        proc = subprocess.run([str(VLLM_PYTHON), __file__, "--vllm-worker", str(job_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    if proc.returncode != 0 or not out_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        raise RuntimeError(f"vLLM ({label}) failed with exit code {proc.returncode}; {log_path}:\n" + "\n".join(tail))
    return json.loads(out_path.read_text())


def vllm_acceptance(metrics: dict, k: int) -> tuple[float, list[float]]:
    """(mean acceptance length, acceptance per position) from vLLM's spec-decode counters."""
    drafts = float(metrics.get("vllm:spec_decode_num_drafts") or 0)
    accepted = float(metrics.get("vllm:spec_decode_num_accepted_tokens") or 0)
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * k
    if not drafts:
        return 0.0, [0.0] * k
    return 1.0 + accepted / drafts, [float(a) / drafts for a in per_pos]


# ---- our side (runs in .venv) ----------------------------------------------------------------------------------------


def find_run(head: str | None) -> tuple[Path, Path, Path]:
    """(run dir, head dir, recipe file) for HEAD (a run dir or its head/), the demo's run, or a short new run."""
    if head:
        path = Path(head).resolve()
        run_dir = path.parent if (path / "head_config.json").is_file() else path
        head_dir = path if (path / "head_config.json").is_file() else path / "head"
    elif (DEFAULT_RUN / "head" / "head_config.json").is_file():
        run_dir, head_dir = DEFAULT_RUN, DEFAULT_RUN / "head"
    else:
        run_dir = train_short_head()
        head_dir = run_dir / "head"
    recipe = run_dir / "recipe.resolved.yaml"
    for needed in (head_dir / "head_config.json", recipe):
        if not needed.is_file():
            sys.exit(f"check_serving: {needed} not found (HEAD must be a run directory or its head/)")
    return run_dir, head_dir, recipe


def mtp_train(*args: str, cwd: Path = REPO) -> None:
    cmd = [sys.executable, "-m", "mtp_train", *args]
    print("$ mtp-train " + " ".join(args), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def train_short_head() -> Path:
    """Train a short default-recipe head (SHORT_RUN overrides) in runs/serve-check; about 10 minutes on 2 cores."""
    sets = [arg for item in SHORT_RUN for arg in ("--set", item)]
    mtp_train("fetch-assets", "--dataset", "sharegpt")
    for stage in ("prepare", "precompute", "train"):
        mtp_train(stage, *sets)
    return REPO / "runs" / "serve-check"


def resolve_paths(recipe_path: Path, run_dir: Path) -> list[str]:
    """--set overrides that make the run's relative recipe paths (target, prepared data) absolute: relative to the
    current directory if they exist there, else to the repository the run was made in (<repo>/runs/<name>)."""
    import yaml

    recipe = yaml.safe_load(recipe_path.read_text())
    bases = [Path.cwd(), run_dir.parent.parent]
    sets = []
    for key, value in (("target.path", recipe["target"]["path"]), ("data.output_dir", recipe["data"]["output_dir"])):
        found = next((base / value for base in bases if (base / value).exists()), None)
        if found is None:
            sys.exit(f"check_serving: {key}={value} not found under {', '.join(map(str, bases))}")
        sets.append(f"{key}={found.resolve()}")
    return sets


def our_eval(recipe: Path, sets: list[str], export_dir: Path, out: Path, k: int, limit: int, max_new: int) -> dict:
    """`mtp-train eval --head EXPORT` (fp32 decode, greedy), returning its report's mtp@k=K entry."""
    args = ["eval", "--recipe", str(recipe), "--head", str(export_dir), "--out", str(out), "--no-prompt-lookup",
            "--num-speculative-tokens", str(k), "--limit", str(limit), "--max-new-tokens", str(max_new)]
    for item in [*sets, "target.dtype=float32", "target.decode_dtype=float32", "target.device=cpu",
                 "eval.temperature=0.0", "eval.cost_curve=false"]:
        args += ["--set", item]
    mtp_train(*args)
    report = json.loads((out / "report.json").read_text())
    key = next(name for name in report["overall"] if name.endswith(f"@k={k}") and name != f"lookup@k={k}")
    return report["overall"][key]


def check_case(case: Case, head_dir: Path, run_dir: Path, recipe: Path, sets: list[str], args) -> dict:
    from mtp_train.export import export_head
    from mtp_train.runtime.loader import load_tokenizer
    from mtp_train.evaluate.prompts import load_heldout
    from mtp_train.runtime.chat import stop_token_ids
    from mtp_train.runtime.config import load_config

    work = WORK / case.format
    work.mkdir(parents=True, exist_ok=True)
    target_dir = Path(sets[0].split("=", 1)[1])
    prepared_dir = Path(sets[1].split("=", 1)[1])
    export_dir = work / "export"
    export_head(head_dir, case.format, export_dir, target_dir, dtype="float32", overwrite=True,
                num_speculative_tokens=args.k, full_vocab=case.full_vocab)

    started = time.perf_counter()
    ours = our_eval(recipe, sets, export_dir, work / "ours", args.k, args.limit, args.max_new_tokens)
    ours_seconds = time.perf_counter() - started

    prompts = [p.prompt_ids for p in load_heldout(prepared_dir, args.limit).prompts]
    stops = list(stop_token_ids(load_tokenizer(str(target_dir)), load_config(target_dir)))
    longest = max(len(p) for p in prompts) + args.max_new_tokens + args.k + 8
    job = {"target": str(target_dir), "prompts": prompts, "max_new_tokens": args.max_new_tokens,
           "stop_token_ids": stops, "max_model_len": longest, "speculative_config": None}
    plain = run_vllm(job, work, "vllm-plain")
    spec_config = {"method": case.method, "model": str(export_dir), "num_speculative_tokens": args.k}
    spec = run_vllm({**job, "speculative_config": spec_config, "hf_overrides": case.hf_overrides}, work, "vllm-spec")

    mal, per_pos = vllm_acceptance(spec["metrics"], args.k)
    identical = sum(a == b for a, b in zip(plain["outputs"], spec["outputs"]))
    # vLLM's mean acceptance length is 1 + accepted drafts / drafts, counted before the output is cut at
    # max_tokens; ours in the same terms is 1 + the sum of the per-position acceptance (report.json's
    # mean_acceptance_length counts the committed tokens after that cut, so it is lower by the last step's excess).
    ours_pos = ours["acceptance_per_position"]
    ours_mal = round(1.0 + sum(ours_pos), 4)
    pos_diff = max(abs(a - b) for a, b in zip(per_pos, ours_pos))
    result = {
        "case": f"{case.kind}/{case.format}", "prompts": len(prompts), "identical": identical,
        "ours_mal": ours_mal, "vllm_mal": round(mal, 4), "ours_pos": ours_pos, "vllm_pos": [round(a, 4) for a in per_pos],
        "ours_tau": ours.get("tau"), "ours_greedy_match": ours.get("greedy_match"),
        "vllm_version": spec["vllm_version"], "seconds": {"ours": round(ours_seconds, 1),
                                                          "vllm_plain": plain["seconds"], "vllm_spec": spec["seconds"]},
    }
    result["ok"] = (identical == len(prompts) and abs(mal - ours_mal) <= TOLERANCE and pos_diff <= TOLERANCE)
    (work / "result.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--head", default=os.environ.get("HEAD") or None,
                        help="a run directory or its head/ (default: $HEAD, else runs/smollm2-135m-mtp, else train one)")
    parser.add_argument("--k", type=int, default=3, help="speculative tokens (default 3)")
    parser.add_argument("--limit", type=int, default=10, help="held-out prompts (default 10, as the demo's eval)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--cases", default=None, help="comma-separated formats to check (default: all in CASES)")
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return 0
    if not VLLM_PYTHON.is_file():
        sys.exit(f"check_serving: {VLLM_PYTHON} not found; run `make serve-check` (it builds .venv-vllm)")

    run_dir, head_dir, recipe = find_run(args.head)
    sets = resolve_paths(recipe, run_dir)
    from mtp_train.heads.io import read_head_config

    kind = read_head_config(head_dir).kind
    wanted = set(args.cases.split(",")) if args.cases else None
    cases = [c for c in CASES if c.kind == kind and (wanted is None or c.format in wanted)]
    if not cases:
        sys.exit(f"check_serving: no case in CASES for a {kind} head ({head_dir})")
    print(f"check_serving: head {head_dir} ({kind}); cases: {', '.join(c.format for c in cases)}", flush=True)
    results = []
    for case in cases:
        try:
            results.append(check_case(case, head_dir, run_dir, recipe, sets, args))
        except (RuntimeError, subprocess.CalledProcessError) as err:
            results.append({"case": f"{case.kind}/{case.format}", "ok": False, "error": str(err)})
            print(err, file=sys.stderr)

    print("\n| case | prompts | vLLM spec == plain | mean acc. length ours / vLLM | per position ours / vLLM | ok |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | - | - | - | error: {r['error'].splitlines()[0]} | FAIL |")
            continue
        pos = ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(r["ours_pos"], r["vllm_pos"]))
        print(f"| {r['case']} | {r['prompts']} | {r['identical']}/{r['prompts']} | {r['ours_mal']:.3f} / "
              f"{r['vllm_mal']:.3f} | {pos} | {'ok' if r['ok'] else 'FAIL'} |")
    fields = []
    for r in results:
        name = r["case"].replace("/", "_")
        if "error" in r:
            fields.append(f"{name}=error")
            continue
        fields += [f"{name}_acceptance_ours={r['ours_mal']:.3f}", f"{name}_acceptance_vllm={r['vllm_mal']:.3f}",
                   f"{name}_identical_outputs={r['identical']}/{r['prompts']}"]
    version = next((r["vllm_version"] for r in results if "vllm_version" in r), "unknown")
    ok = all(r["ok"] for r in results)
    print(f"RESULT ok={str(ok).lower()} {' '.join(fields)} vllm={version} tolerance={TOLERANCE}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
