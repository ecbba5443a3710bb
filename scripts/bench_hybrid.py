#!/usr/bin/env python
"""The hybrid drafter against its parts, per prompt set and category: the head's chain, prompt lookup, and the hybrid
(per step and sequence the head's chain or a copy from the context, runtime/spec/hybrid.py), each at every k, through
`mtp-train eval`'s own runner (the same prompts, turns, settings and timing; greedy, batch 1).

For each set (the demo's held-out split and the built-in MT-bench, GSM8K and HumanEval): each method's τ and speedup
over plain decoding at its best k, overall and per category, and whether the hybrid's best speedup is above both of
its parts'. `--variant NAME:key=value,...` adds hybrids with other rules (HybridDraft's fields), e.g.
`--variant min1:min_ngram=1 --variant cap1:head_tokens=1`. The last line is `RESULT key=value ...`
(`<set>_<method>_best`, `<set>_hybrid_wins`, the machine).

    python scripts/bench_hybrid.py                       # 16 prompts per set, 96 new tokens, k = 1, 2, 3
    python scripts/bench_hybrid.py --quick               # 4 prompts per set, 48 new tokens
    python scripts/bench_hybrid.py --sets mt_bench --limit 40 --variant min1:min_ngram=1
    python scripts/bench_hybrid.py --sets mt_bench --per-category 2 --ks 2,3,4   # every MT-bench category
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

SETS = ("heldout", "mt_bench", "gsm8k", "humaneval")


def parse_variant(spec: str) -> tuple[str, dict]:
    """`name:key=value,...` -> (name, HybridDraft keyword arguments with int/float/None values)."""
    name, _, settings = spec.partition(":")
    if not name or not settings:
        raise SystemExit(f"--variant {spec!r}: expected NAME:key=value[,key=value]")
    kwargs = {}
    for item in settings.split(","):
        key, _, value = item.partition("=")
        kwargs[key.strip()] = None if value == "None" else (float(value) if "." in value else int(value))
    return name, kwargs


def first_per_category(prompts: list, per_category: int) -> list:
    """The first `per_category` prompts of each category, in the set's order."""
    taken: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        if taken.get(prompt.category, 0) < per_category:
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            kept.append(prompt)
    return kept


def best_by_method(summaries: dict[str, dict], names: list[str]) -> dict[str, tuple[float, int, float]]:
    """{method name: (best speedup, its k, its τ)} over the "<name>@k=<k>" summaries."""
    best = {}
    for method, summary in summaries.items():
        name, _, k = method.partition("@k=")
        if name in names and "speedup" in summary:
            if name not in best or summary["speedup"] > best[name][0]:
                best[name] = (summary["speedup"], int(k), summary["tau"])
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2-135m-mtp.yaml"),
                        help="its prepared data gives the held-out split (default: the demo's recipe)")
    parser.add_argument("--head", default=None, help="trained head (default: the recipe's runs/<name>/head)")
    parser.add_argument("--target", default=None, help="model dir (default: fetched SmolLM2)")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)} or files")
    parser.add_argument("--limit", type=int, default=16, help="prompts per set")
    parser.add_argument("--per-category", type=int, default=None, metavar="N",
                        help="the first N prompts of each category instead of a set's first --limit prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--ks", default="1,2,3", help="draft lengths, comma-separated")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...",
                        help="another hybrid with these HybridDraft fields (repeatable)")
    parser.add_argument("--quick", action="store_true", help="4 prompts per set, 48 new tokens")
    args = parser.parse_args()
    if args.quick:
        args.limit, args.max_new_tokens = 4, 48

    from bench_spec import load_auto_run

    from mtp_train.evaluate.prompts import load_heldout, load_mt_bench
    from mtp_train.evaluate.runner import PLAIN, run_methods
    from mtp_train.recipe import load_recipe
    from mtp_train.runtime.hardware import machine_fields
    from mtp_train.runtime.sampler import SamplingParams
    from mtp_train.runtime.spec import HybridDraft, PromptLookup

    recipe = load_recipe(args.recipe, [])
    args.head = args.head or str(recipe.run_dir / "head")
    if not Path(args.head).is_dir():
        raise SystemExit(f"{args.head}: no trained head (run `make demo`, or pass --head DIR)")
    run = load_auto_run(args)
    drafts = {"head": run.head, "lookup": PromptLookup(), "hybrid": HybridDraft(run.head)}
    for spec in args.variant:
        name, kwargs = parse_variant(spec)
        drafts[f"hybrid_{name}"] = HybridDraft(run.head, **kwargs)
    ks = [int(k) for k in args.ks.split(",")]
    fields = []
    for set_name in args.sets.split(","):
        limit = None if args.per_category else args.limit
        prompt_set = (load_heldout(recipe.prepared_dir, limit) if set_name == "heldout"
                      else load_mt_bench(set_name, limit))
        if args.per_category:
            prompt_set.prompts[:] = first_per_category(prompt_set.prompts, args.per_category)
        totals = run_methods(run.target, run.tokenizer, prompt_set.prompts, drafts, ks, args.max_new_tokens,
                             SamplingParams(), run.stop_token_ids, show_progress=False)
        categories = sorted(c for c in totals[PLAIN] if c != "all")
        print(f"\n## {set_name}: {len(prompt_set.prompts)} prompts, ≤ {args.max_new_tokens} new tokens, "
              f"k in {ks}, greedy, batch 1")
        header = f"{'category':14s}" + "".join(f"{name:>22s}" for name in drafts)
        print(header + "   hybrid above both")
        for category in ["all", *categories]:
            plain = totals[PLAIN].get(category)
            summaries = {method: by_category[category].summary(plain)
                         for method, by_category in totals.items() if method != PLAIN and category in by_category}
            best = best_by_method(summaries, list(drafts))
            cells = "".join(f"{f'{best[n][0]:.3f}× (k{best[n][1]}, τ{best[n][2]:.2f})':>22s}" for n in drafts)
            wins = best["hybrid"][0] > max(best["head"][0], best["lookup"][0])
            print(f"{category:14s}{cells}   {'yes' if wins else 'no'}")
            if category == "all":
                fields += [f"{set_name}_{name}_best={best[name][0]:.3f}" for name in drafts]
                fields.append(f"{set_name}_hybrid_wins={str(wins).lower()}")
                mismatched = [m for m, s in summaries.items() if not s["greedy_match"]]
                if mismatched:
                    print(f"  greedy output differs from plain for {', '.join(mismatched)} (near-ties: see "
                          "max_divergence_logit_gap in an eval report)")
    print(f"RESULT {' '.join(fields)} limit={args.limit} per_category={args.per_category} "
          f"new_tokens={args.max_new_tokens} "
          f"head_weights={run.head_weights} {machine_fields(run.precision.dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
