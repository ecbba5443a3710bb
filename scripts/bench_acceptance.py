#!/usr/bin/env python
"""How good a draft head must be on this machine: speculative speedup over plain decoding as a function of the
drafts' acceptance rate, through the real loop with the real head's cost.

The speedup of a head is τ over the price of a speculative step; τ comes from training, the price from the machine
(the verify of k + 1 rows, the head's forwards, the loop's Python; the prefill dilutes it). This separates the two.
Each prompt is first answered by plain greedy decoding (the reference). Then the head drafts as usual — every forward
it runs is real — but before the verify each draft token is replaced: at generated position p it becomes the
reference token there if u(prompt, p) < a (u a fixed pseudo-random number in [0, 1)), else a token that is certainly
wrong (the head's own draft when that is already wrong, else the reference token + 1). So every draft position is
accepted with probability a independently of the others, τ(k) ≈ 1 + a + … + a^k, and the output, verified by the
target, still equals the reference token for token (checked on every run: the loop stays lossless whatever it is
fed). `natural` is the head unchanged (its own acceptance).

Methods are alternated prompt by prompt over `--rounds` rounds so machine noise hits all alike. Per acceptance level:
τ, the speedup over plain on whole generations (prefill included, as `mtp-train eval` measures) and on the decode loop
alone (prefill excluded). The acceptance at which the whole-generation speedup crosses each `--goals` value is
interpolated between the levels measured.

Prompts: the held-out split of a prepared dataset (`--heldout data/prepared/<name>`: the prompts `make demo`'s eval
answers) or MT-bench first turns (`--prompts`). Ends with a `RESULT` line: `natural_accept` (the head's own first-draft
acceptance), `natural_speedup`, `speedup_a<a>` and `decode_speedup_a<a>` per level, `accept_for_<goal>` per goal
(`nan` where no level measured reaches it), `step_over_plain` (a speculative step's wall time over a plain step's,
decode loops only, averaged over the levels). `--quick`: 2 prompts, 48 tokens, 1 round, levels 0.4 and 0.8.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch


def position_draws(prompt_index: int, positions: int, seed: int) -> list[float]:
    """u(prompt, p) for p < positions: fixed uniform draws, the same for every acceptance level (so a higher level
    accepts a superset of a lower one's positions)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + prompt_index)
    return torch.rand(positions, generator=generator, dtype=torch.float64).tolist()


class ControlledDrafts:
    """Wraps a proposer's `propose`: the real drafting runs, then each draft token is set right or wrong by the rule in
    the module docstring. `start(reference, draws, prompt_len, level)` arms it for one generation; level None leaves
    the drafts alone."""

    def __init__(self, proposer_class, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.reference: list[int] = []
        self.draws: list[float] = []
        self.prompt_len = 0
        self.level: float | None = None
        self.proposer_class = proposer_class
        self.original = original = proposer_class.propose
        controller = self

        def propose(proposer, requests, num_drafts, sampling, generator):
            proposals = original(proposer, requests, num_drafts, sampling, generator)
            if controller.level is not None:
                for request, proposal in zip(requests, proposals):
                    controller.rewrite(len(request.token_ids) - controller.prompt_len, proposal.draft_token_ids)
            return proposals

        proposer_class.propose = propose

    def close(self) -> None:
        """Puts the proposer class's own `propose` back."""
        self.proposer_class.propose = self.original

    def start(self, reference: list[int], draws: list[float], prompt_len: int, level: float | None) -> None:
        self.reference, self.draws, self.prompt_len, self.level = reference, draws, prompt_len, level

    def rewrite(self, generated: int, draft_ids: torch.Tensor) -> None:
        """`draft_ids` [k] (in place): draft j stands at generated position `generated + j`."""
        for j in range(draft_ids.shape[0]):
            position = generated + j
            if position >= len(self.reference):
                return
            right = self.reference[position]
            if self.draws[position] < self.level:
                draft_ids[j] = right
            elif int(draft_ids[j]) == right:
                draft_ids[j] = (right + 1) % self.vocab_size


def crossing(levels: list[float], speedups: list[float], goal: float) -> float:
    """The acceptance at which the speedup reaches `goal`, linearly between the two measured levels around it; nan
    when no measured level reaches it; the lowest level when every one does."""
    pairs = sorted(zip(levels, speedups))
    for (a0, s0), (a1, s1) in zip(pairs, pairs[1:]):
        if s0 < goal <= s1:
            return a0 + (goal - s0) * (a1 - a0) / (s1 - s0)
    if pairs and pairs[0][1] >= goal:
        return pairs[0][0]
    return math.nan


def heldout_prompts(tokenizer, data_dir: Path, limit: int) -> list[list[int]]:
    """The first turns of the held-out split `prepare` wrote (the prompts `mtp-train eval` answers by default)."""
    from mtp_train.evaluate.prompts import load_heldout
    from mtp_train.evaluate.runner import first_turn_ids

    return [first_turn_ids(tokenizer, prompt) for prompt in load_heldout(str(data_dir), limit).prompts]


def main() -> None:
    from bench_spec import add_run_arguments, load_auto_run, mt_bench_chat_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, new_tokens=96)
    parser.add_argument("--heldout", type=Path, default=None,
                        help="prepared dataset dir: answer its held-out split instead of --prompts (MT-bench)")
    parser.add_argument("--k", type=int, default=1, help="speculative tokens per step")
    parser.add_argument("--levels", type=float, nargs="+", default=[0.3, 0.4, 0.5, 0.6, 0.8, 1.0],
                        help="acceptance rates to impose (besides the head's own)")
    parser.add_argument("--goals", type=float, nargs="+", default=[1.1, 1.25, 1.5])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="2 prompts, 48 tokens, 1 round, levels 0.4 and 0.8")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.new_tokens, args.rounds, args.levels = 2, 48, 1, [0.4, 0.8]
    if not all(0.0 <= level <= 1.0 for level in args.levels):
        raise SystemExit(f"--levels must lie in [0, 1], got {args.levels}")
    if args.threads:
        torch.set_num_threads(args.threads)

    from mtp_train.evaluate.margins import explain_divergence
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.hardware import machine_fields
    from mtp_train.runtime.spec import speculative_generate
    from mtp_train.runtime.spec.mtp_chain import MTPChainProposer

    run = load_auto_run(args)  # an untrained head (--head not found) accepts ~nothing of its own
    precision, target, head, head_weights = run.precision, run.target, run.head, run.head_weights
    tokenizer, stops, trained = run.tokenizer, run.stop_token_ids, run.trained
    if args.heldout is not None:
        prompts, source = heldout_prompts(tokenizer, args.heldout, args.num_prompts), f"held-out split of {args.heldout}"
    else:
        prompts, source = mt_bench_chat_prompts(tokenizer, args.prompts, args.num_prompts), str(args.prompts)
    if not prompts:
        raise SystemExit(f"no prompts in {source}")
    controlled = ControlledDrafts(MTPChainProposer, target.config.vocab_size)

    generate(target, [prompts[0]], 4, stop_token_ids=stops)  # first-call set-up outside the timings
    references = [generate(target, [ids], args.new_tokens, stop_token_ids=stops)[0][0].token_ids for ids in prompts]
    draws = [position_draws(i, args.new_tokens, args.seed) for i in range(len(prompts))]
    names = ["plain", "natural", *(f"a{level:g}" for level in args.levels)]
    level_of = {"natural": None, **{f"a{level:g}": level for level in args.levels}}
    totals = {name: {"wall": 0.0, "decode": 0.0, "tokens": 0, "steps": 0, "drafted": 0, "accepted": 0}
              for name in names}
    ties: list[str] = []  # runs whose output parted from plain greedy decoding at a near-tie
    for _ in range(args.rounds):
        for index, ids in enumerate(prompts):
            for name in names:
                total = totals[name]
                start = time.perf_counter()
                if name == "plain":
                    results, stats = generate(target, [ids], args.new_tokens, stop_token_ids=stops)
                else:
                    controlled.start(references[index], draws[index], len(ids), level_of[name])
                    results, stats = speculative_generate(target, head, [ids], args.new_tokens, args.k,
                                                          stop_token_ids=stops)
                    controlled.start([], [], 0, None)
                    total["drafted"] += stats.drafted_per_position[0]
                    total["accepted"] += stats.accepted_per_position[0]
                total["wall"] += time.perf_counter() - start
                total["decode"] += stats.decode_seconds
                divergence = explain_divergence(target, ids, references[index], results[0].token_ids)
                if divergence is not None and not divergence.is_tie:
                    raise SystemExit(f"{name}: prompt {index}: the output differs from plain greedy decoding: "
                                     f"{divergence.describe()}")
                if divergence is not None:  # a verify's rounding tipped a near-tie: the output is still the target's
                    ties.append(f"{name} prompt {index} {divergence.describe()}")
                total["tokens"] += len(results[0].token_ids)
                total["steps"] += stats.target_forwards - 1  # the prefill's forward excluded

    plain = totals["plain"]
    plain_step = plain["decode"] / max(plain["steps"], 1)
    print(f"\n{len(prompts)} prompts ({source}) × ≤ {args.new_tokens} tokens × {args.rounds} rounds, k = {args.k}, "
          f"greedy, batch 1; output identical to plain greedy on every run"
          + (f" but {len(ties)}, which parted at near-ties (margin within 2× the verify's rounding):\n  "
             + "\n  ".join(ties) if ties else ""))
    print(f"{'drafts':>8s} {'accept@1':>9s} {'tau':>6s} {'tok/s':>7s} {'speedup':>8s} {'decode only':>12s} "
          f"{'step/plain step':>16s}")
    print(f"{'plain':>8s} {'':>9s} {1.0:6.3f} {plain['tokens'] / plain['wall']:7.1f} {1.0:8.3f} {1.0:12.3f} "
          f"{1.0:16.3f}")
    fields, levels, speedups, step_ratios = [], [], [], []
    for name in names[1:]:
        total = totals[name]
        accept = total["accepted"] / max(total["drafted"], 1)
        tau = total["tokens"] / max(total["steps"] + len(prompts) * args.rounds, 1)  # prefill's token counted
        speedup = plain["wall"] / total["wall"]
        decode_speedup = plain["decode"] / total["decode"]
        step_ratio = total["decode"] / max(total["steps"], 1) / plain_step
        step_ratios.append(step_ratio)
        print(f"{name:>8s} {accept:9.3f} {tau:6.3f} {total['tokens'] / total['wall']:7.1f} {speedup:8.3f} "
              f"{decode_speedup:12.3f} {step_ratio:16.3f}")
        if name == "natural":
            fields += [f"natural_accept={accept:.3f}", f"natural_tau={tau:.3f}", f"natural_speedup={speedup:.3f}",
                       f"natural_decode_speedup={decode_speedup:.3f}"]
            if trained:  # an untrained head's point (acceptance ~0) is no level a head reaches
                levels.append(accept)
                speedups.append(speedup)
        else:
            fields += [f"speedup_{name}={speedup:.3f}", f"decode_speedup_{name}={decode_speedup:.3f}"]
            levels.append(accept)
            speedups.append(speedup)
    print()
    for goal in args.goals:
        needed = crossing(levels, speedups, goal)
        print(f"first-draft acceptance for {goal:g}× over plain (whole generations): "
              f"{'not reached by any level measured' if math.isnan(needed) else f'{needed:.3f}'}")
        fields.append(f"accept_for_{goal:g}={needed:.3f}")
    fields.append(f"step_over_plain={sum(step_ratios) / len(step_ratios):.3f}")
    print(f"RESULT {' '.join(fields)} k={args.k} prompts={len(prompts)} new_tokens={args.new_tokens} "
          f"near_ties={len(ties)} head_weights={head_weights} threads={torch.get_num_threads()} {machine_fields(precision.dtype)}")


if __name__ == "__main__":
    main()
