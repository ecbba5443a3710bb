#!/usr/bin/env python
"""Peak resident memory of a training rank: the whole target loaded (the trainer before frozen-parts loading) vs only
its frozen parts read from the safetensors (runtime/frozen_parts.py, what the trainer does now).

For each model (the default SmolLM2-135M and Qwen2.5-Coder-1.5B when fetched: `mtp-train fetch-assets --model
qwen2.5-coder-1.5b`) the parent builds a small work dir once under `--workdir` (synthetic ShareGPT conversations from
a fixed word list — memory does not depend on the text — then `mtp-train prepare` and `mtp-train precompute` through
the CLI), then runs `mtp-train train`'s `run_training` (set-up, `--steps` optimizer steps, held-out validation, the
final checkpoint and head files) in one child process per load, one after the other:

    full    the trainer with its target load replaced by `runtime.loader.load_model` of the whole target (dtype and
            device as the trainer's), kept alive for the whole run as `TrainingRun.target` was: the old behaviour
    frozen  the trainer as it is: `load_frozen_parts` (embed_tokens + lm_head; last layer + final norm for
            head.init last_layer)

Each child reports its peak RSS (`VmHWM` from /proc/self/status; `ru_maxrss` as a check), the bytes of target
tensors it holds (all parameters, or the frozen parts: what a GPU rank holds in device memory), the RSS just before
and after the target load and the load's seconds. Runs on the CPU, one rank (ZeRO shards only the head's optimizer
state, so the target's share of a rank does not depend on the world size), once per compute dtype of `--dtypes`:
in the file's dtype (bf16) safetensors tensors stay memory-mapped, so target pages count in RSS only once read (a
full target's unused layers cost address space, not RSS, on the CPU; on a GPU they are copied to device memory); in
float32 every loaded tensor is converted, so RSS holds all of them. Ends with one `RESULT key=value ...` line per
`<model>_<dtype>`: `rss_full_mb_`, `rss_frozen_mb_` (peak RSS), `ratio_` (full / frozen), `target_full_mb_`,
`target_frozen_mb_` (target tensors held) and the loads' seconds. `--quick`: 1 step on 24 conversations (a work dir
built earlier is reused; `--fresh` rebuilds it). The Qwen runs use the recipe with a CPU-sized batch
(`micro_batch_tokens` 2048) and the generated ZeRO-1 config; both loads of a model run the same settings.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = {  # name in RESULT keys -> (recipe, target directory, bench overrides of that recipe)
    "smollm2_135m": ("recipes/smollm2-135m-mtp.yaml", "data/models/smollm2-135m-instruct", {}),
    "qwen2_5_coder_1_5b": ("recipes/qwen2.5-coder-1.5b-mtp.yaml", "data/models/qwen2.5-coder-1.5b", {
        "train.deepspeed_config": "null",  # the recipe's zero1.json is for GPUs; the generated config is the same
        "train.zero_stage": "1",           # stage, without the 200M-element communication buckets
        "train.micro_batch_tokens": "2048",  # the recipe's 32768 is an 8×H100 budget; both loads use the same
        "train.warmup_steps": "1",
    }),
}
SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
WORDS = ("the model drafts tokens and the target verifies them in one pass so generation is faster when drafts are "
         "accepted write a python function that sorts a list of numbers explain how a hash map works return value "
         "class method loop index error test data cache page head layer norm train loss step rank shard").split()


def _status_mb(field: str) -> float:
    """A /proc/self/status memory field (VmRSS, VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


# ---- child: one training run with one kind of target load ---------------------------------------------------------


def child(args) -> None:
    import mtp_train.runtime.frozen_parts as frozen_parts
    from mtp_train.recipe import load_recipe
    import mtp_train.train.trainer as trainer_module
    from mtp_train.train.trainer import run_training

    recipe = load_recipe(Path(args.recipe), args.set)
    measured: dict[str, float] = {}
    kept = []  # the full target, alive until the run ends (as the old TrainingRun.target was)
    load_parts = frozen_parts.load_frozen_parts

    def full_target(model_dir, dtype, device="cpu", last_layer=False, fingerprint=None, backend="auto"):
        """The trainer's target load before frozen-parts loading: the whole model, then its fingerprint."""
        from mtp_train.fingerprint import target_fingerprint
        from mtp_train.runtime.loader import load_model

        model = load_model(model_dir, dtype=dtype, device=device, backend=backend)
        kept.append(model)
        return frozen_parts.FrozenParts.of_model(model, fingerprint or target_fingerprint(model_dir))

    load = full_target if args.child == "full" else load_parts

    def measured_load(*load_args, **load_kwargs):
        measured["rss_before_load_mb"] = _status_mb("VmRSS")
        started = time.perf_counter()
        parts = load(*load_args, **load_kwargs)
        measured["load_s"] = time.perf_counter() - started
        measured["rss_after_load_mb"] = _status_mb("VmRSS")
        # The target tensors the rank holds (what a GPU rank would hold in device memory; on the CPU, tensors whose
        # dtype is the file's stay memory-mapped and count in RSS only once their pages are read).
        held = kept[0].parameters() if kept else [parts.embed_tokens.weight, parts.lm_head.weight,
                                                  *(parts.last_layer or {}).values(),
                                                  *([] if parts.final_norm is None else [parts.final_norm])]
        unique = {t.data_ptr(): t for t in held}.values()
        measured["target_mb"] = sum(t.numel() * t.element_size() for t in unique) / 2**20
        return parts

    trainer_module.load_frozen_parts = measured_load  # the name the trainer calls at set-up
    started = time.perf_counter()
    run_training(recipe, resume="never", show_progress=False)
    measured["run_s"] = time.perf_counter() - started
    measured["peak_rss_mb"] = _status_mb("VmHWM")
    measured["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary = json.loads((Path(recipe.run_dir) / "summary.json").read_text())
    measured["compute_dtype"] = summary["compute_dtype"]
    print("CHILD " + json.dumps(measured), flush=True)


# ---- parent: work dirs, then one child per load -------------------------------------------------------------------


def _run(command: list[str], what: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{what} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def synthetic_sharegpt(path: Path, conversations: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = []
    for i in range(conversations):
        turns = []
        for _ in range(rng.randint(1, 2)):
            turns.append({"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(8, 24)))})
            turns.append({"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(30, 70)))})
        rows.append({"id": f"bench-{i}", "conversations": turns})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def bench_overrides(name: str, workdir: Path, args) -> list[str]:
    _, target, extra = MODELS[name]
    overrides = {
        "name": f"bench-memory-{name}", "target.path": str(REPO / target), "target.device": "cpu",
        "data.sources": f"[{{path: '{workdir / 'sharegpt.jsonl'}', format: sharegpt}}]",
        "data.output_dir": str(workdir / "prepared"), "data.max_samples": "null", "data.max_seq_len": "256",
        "data.eval_fraction": "0.2", "precompute.output_dir": str(workdir / "features"),
        "precompute.tokens_per_batch": "2048", "train.max_steps": str(args.steps), "train.eval_every": "1000000",
        "train.save_every": "1000000", "tracking.wandb.mode": "disabled", **extra,
    }
    return [f"{key}={value}" for key, value in overrides.items()]


def prepare_workdir(name: str, workdir: Path, args) -> list[str]:
    """The model's prepared data and feature cache (built once; `--fresh` rebuilds); returns the recipe overrides."""
    recipe = str(REPO / MODELS[name][0])
    if args.fresh and workdir.exists():
        shutil.rmtree(workdir)
    overrides = bench_overrides(name, workdir, args)
    sets = [a for o in overrides for a in ("--set", o)]
    if not (workdir / "features" / "manifest.json").is_file():
        synthetic_sharegpt(workdir / "sharegpt.jsonl", args.conversations)
        # Precompute in float32 on CPUs without native bf16 (bf16 GEMMs are much slower there); the cache stores bf16
        # states either way, so the training runs read the same features whatever dtype they compute in.
        from mtp_train.runtime.hardware import cpu_facts

        precompute_dtype = [] if cpu_facts().native_bf16 else ["--set", "precision.compute=float32"]
        print(f"{name}: prepare + precompute {args.conversations} synthetic conversations in {workdir}", flush=True)
        _run([sys.executable, "-m", "mtp_train", "prepare", "--recipe", recipe, *sets, "--force"], f"{name} prepare")
        _run([sys.executable, "-m", "mtp_train", "precompute", "--recipe", recipe, *sets, *precompute_dtype,
              "--force"], f"{name} precompute")
    return overrides


def measure(name: str, mode: str, workdir: Path, overrides: list[str]) -> dict[str, float]:
    run_dir = workdir / f"run-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [a for o in overrides + [f"train.run_dir={run_dir}"] for a in ("--set", o)]
    out = _run([sys.executable, __file__, "--child", mode, "--recipe", str(REPO / MODELS[name][0]), *sets],
               f"{name} {mode} training")
    line = next(line for line in out.splitlines() if line.startswith("CHILD "))
    shutil.rmtree(run_dir, ignore_errors=True)
    return json.loads(line.removeprefix("CHILD "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None,
                        help=f"comma-separated, of {', '.join(MODELS)} (default: each of them that is fetched)")
    parser.add_argument("--workdir", default=str(REPO / "data" / "bench" / "train_memory"))
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per training run")
    parser.add_argument("--conversations", type=int, default=48, help="synthetic conversations per model")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="compute dtypes to train in, comma-separated (`recipe`: each recipe's own)")
    parser.add_argument("--quick", action="store_true", help="1 step, 24 conversations")
    parser.add_argument("--fresh", action="store_true", help="rebuild the work dirs' data and features")
    parser.add_argument("--child", choices=("full", "frozen"), help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.steps, args.conversations = 1, 24
    names = [n for n in (args.models or ",".join(MODELS)).split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    missing = [n for n in names if not (REPO / MODELS[n][1] / "config.json").is_file()]
    if missing and args.models is not None:  # named on the command line: measure them or fail
        sys.exit(f"not fetched: {', '.join(missing)} (mtp-train fetch-assets --model ...)")
    for name in missing:
        print(f"{name}: skipped, not fetched (mtp-train fetch-assets --model {MODELS[name][1].rsplit('/', 1)[1]})")
    names = [n for n in names if n not in missing]
    fields: list[str] = []
    for name in names:
        workdir = Path(args.workdir) / name
        overrides = prepare_workdir(name, workdir, args)
        for dtype in args.dtypes.split(","):
            dtype_sets = [] if dtype == "recipe" else [f"precision.compute={dtype}"]
            results = {mode: measure(name, mode, workdir, overrides + dtype_sets) for mode in ("full", "frozen")}
            full, frozen = results["full"], results["frozen"]
            key = f"{name}_{SHORT.get(frozen['compute_dtype'], frozen['compute_dtype'])}"
            print(f"{key}:")
            for mode, r in results.items():
                print(f"  {mode:6s} peak RSS {r['peak_rss_mb']:7.0f} MiB (ru_maxrss {r['ru_maxrss_mb']:.0f}); target "
                      f"tensors held {r['target_mb']:7.0f} MiB; RSS {r['rss_before_load_mb']:.0f} -> "
                      f"{r['rss_after_load_mb']:.0f} MiB over the load ({r['load_s']:.1f} s); run {r['run_s']:.0f} s",
                      flush=True)
            fields += [f"rss_full_mb_{key}={full['peak_rss_mb']:.0f}",
                       f"rss_frozen_mb_{key}={frozen['peak_rss_mb']:.0f}",
                       f"ratio_{key}={full['peak_rss_mb'] / frozen['peak_rss_mb']:.2f}",
                       f"target_full_mb_{key}={full['target_mb']:.0f}",
                       f"target_frozen_mb_{key}={frozen['target_mb']:.0f}",
                       f"load_s_full_{key}={full['load_s']:.1f}", f"load_s_frozen_{key}={frozen['load_s']:.1f}"]
    from mtp_train.runtime.hardware import machine_fields

    machine = machine_fields("per_model").replace(" compute_dtype=per_model", "")
    skipped = f" skipped={','.join(missing)}" if missing else ""
    print(f"RESULT {' '.join(fields)} steps={args.steps}{skipped} {machine}")


if __name__ == "__main__":
    main()
