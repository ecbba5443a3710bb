"""What a refactoring must not change, as one JSON document: the greedy (and seeded sampled) outputs of every
decoding method on a trained head, their acceptance, and the sha256 of every file each export format writes.

Run it on the tree before a refactoring and after, and compare the two files (`cmp`, or `--compare OLD.json`):

    PYTHONPATH=../before .venv/bin/python scripts/behaviour_fingerprint.py --run runs/demo-host --out /tmp/before.json
    .venv/bin/python scripts/behaviour_fingerprint.py --run runs/demo-host --out /tmp/after.json --compare /tmp/before.json

The target and its precision come from the run's resolved recipe (as `mtp-train eval` loads them); the prompts are the
first `--prompts` held-out samples `prepare` wrote for it, cut to their first user turn (`--dtype auto`: the target in
the precision `auto` picks on this machine, whatever the run trained in). Methods: plain decoding,
the head's chain at k = 1..4 (batch 1 and batch 4), a draft tree, a hybrid tree, prompt lookup, and the chain
sampled at temperature 0.8 with a fixed seed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path


from mtp_train.errors import UserError
from mtp_train.evaluate.prompts import load_heldout
from mtp_train.evaluate.runner import first_turn_ids
from mtp_train.export import export_head
from mtp_train.export.load import load_draft
from mtp_train.export.registry import FORMATS
from mtp_train.recipe import load_recipe
from mtp_train.runtime.chat import stop_token_ids
from mtp_train.runtime.generate import generate
from mtp_train.runtime.loader import load_model, load_tokenizer, resolve_device
from mtp_train.runtime.precision import resolve_section
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.spec import DraftTree, PromptLookup, TreeShape, speculative_generate


def _digest(outputs: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def _run(target, draft, prompts, max_new_tokens, stops, k=1, sampling=SamplingParams(), batch_size=1) -> dict:
    outputs, drafted, accepted, steps = [], 0, 0, 0
    for start in range(0, len(prompts), batch_size):
        results, stats = speculative_generate(target, draft, prompts[start:start + batch_size], max_new_tokens,
                                              num_speculative_tokens=k, sampling=sampling, stop_token_ids=stops,
                                              seed=start)
        outputs += [r.token_ids for r in results]
        drafted, accepted, steps = drafted + stats.drafted_tokens, accepted + stats.accepted_tokens, \
            steps + stats.verify_sequence_steps
    return {"outputs": _digest(outputs), "tokens": sum(map(len, outputs)),
            "mean_acceptance_length": round((accepted + steps) / max(steps, 1), 6), "accepted": accepted, "drafted": drafted}


def fingerprint(run_dir: Path, num_prompts: int, max_new_tokens: int, exports_dir: Path,
                dtype: str | None = None) -> dict:
    recipe = load_recipe(run_dir / "recipe.resolved.yaml")
    device = resolve_device(recipe.target.device)
    section = recipe.precision.model_copy(update={"compute": dtype, "decode": "auto"}) if dtype else recipe.precision
    precision = resolve_section(section, device)
    target = load_model(recipe.target.path, device=device, precision=precision)
    tokenizer = load_tokenizer(recipe.target.path)
    head_dir = run_dir / "head"
    head = load_draft(target, tokenizer, precision, head=str(head_dir),
                      head_decode_dtype=recipe.precision.head_decode)
    prompts = [first_turn_ids(tokenizer, p) for p in load_heldout(recipe.prepared_dir, num_prompts).prompts]
    stops = stop_token_ids(tokenizer, target.config)
    plain = []
    for prompt in prompts:
        results, _ = generate(target, [prompt], max_new_tokens, stop_token_ids=stops)
        plain += [r.token_ids for r in results]
    methods = {"plain": {"outputs": _digest(plain), "tokens": sum(map(len, plain))}}
    for k in (1, 2, 3, 4):
        methods[f"chain k={k}"] = _run(target, head, prompts, max_new_tokens, stops, k)
    methods["chain k=3 batch=4"] = _run(target, head, prompts, max_new_tokens, stops, 3, batch_size=4)
    methods["tree 4x2x8"] = _run(target, DraftTree(head, TreeShape(4, 2, 8)), prompts, max_new_tokens, stops)
    methods["tree 3x2x6+lookup"] = _run(target, DraftTree(head, TreeShape(3, 2, 6), PromptLookup()), prompts,
                                        max_new_tokens, stops)
    methods["lookup k=3"] = _run(target, PromptLookup(), prompts, max_new_tokens, stops, 3)
    methods["chain k=3 t=0.8"] = _run(target, head, prompts, max_new_tokens, stops, 3, SamplingParams(temperature=0.8))
    methods["tree 4x2x8 t=0.8"] = _run(target, DraftTree(head, TreeShape(4, 2, 8)), prompts, max_new_tokens, stops,
                                       sampling=SamplingParams(temperature=0.8))
    exports = {}
    for name in sorted(FORMATS):
        out = exports_dir / name  # one path in every run: the serving files (and their checksums) name it
        try:
            export_head(str(head_dir), name, out, recipe.target.path, overwrite=True)
        except UserError as err:  # a format that refuses this head: its message is the fingerprint
            exports[name] = f"refused: {str(err).splitlines()[0][:120]}"
            continue
        exports[name] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16]
                         for p in sorted(out.iterdir()) if p.is_file()}
    return {"precision": precision.describe(), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "methods": methods, "exports": exports}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a trained run directory (head/, recipe.resolved.yaml)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", help="precision.compute instead of the run's (decode dtype then auto), e.g. auto")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--exports-dir", type=Path, default=Path(tempfile.gettempdir()) / "mtp-train-fingerprint",
                        help="where each format is exported (replaced on each run; keep it the same for runs compared)")
    parser.add_argument("--compare", type=Path, help="an earlier fingerprint: exit 1 and name what differs")
    args = parser.parse_args()
    result = fingerprint(args.run, args.prompts, args.max_new_tokens, args.exports_dir, args.dtype)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if args.compare:
        before = json.loads(args.compare.read_text())
        differ = [f"{section}/{key}" for section in ("methods", "exports")
                  for key in sorted(set(before[section]) | set(result[section]))
                  if before[section].get(key) != result[section].get(key)]
        print("RESULT identical=" + ("true" if not differ else "false differ=" + ",".join(differ)))
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
