#!/usr/bin/env python
"""Decode cost profile per decode path and speculative decoding speed, SmolLM2 on the CPU, batch 1, greedy, one process.

Paths (each with its own target, weight copies and head):
- `torch`: our runtime without the decode path (fp32 weights, the model's own torch ops);
- `kernels-fp32`: the same model with the CPU decode kernels over fp32 weights (`apply_decode_path`);
- `auto`: the model as the pipeline loads it (`--dtype auto`: on an AVX2-only CPU fp32 weights, bf16 copies read
  by the kernels for forwards of up to `decode_max_rows` rows), the head as `eval` loads it (`precision.head_decode:
  auto`: int8 draft weights where the kernels serve it);
- `auto-kv-fp32`: `auto` with its K/V cache in fp32 (`precision.kv_cache: float32`; `auto` holds it in bf16
  when its decode weights are bf16): the cache's bytes, side by side;
- `int8`: the quantized serving target (`precision.decode: int8`: weight-only int8 copies read by the kernels),
  with an int8 head; its plain decode is timed beside `auto`'s in part 2.

1. Cost profile, per path, for a short (~200-token) and a long (~4k-token) prompt (MT-bench questions and the repo's
   README/docs in one user message; the token counts are printed): one target decode step (ms); the bytes it streams
   (the decoder layers' and lm_head's weights in the dtype that path's few-row forward reads, plus the K/V history:
   2 × layers × kv_len × kv_heads × head_dim × cache element size) over its time, as a fraction of the read bandwidth
   (a sum over a 256 MiB buffer, timed in the same interleaved rounds as the steps: a shared machine's read rate
   drifts within seconds, so a rate measured at another moment gives another fraction for the same decode step;
   docs/benchmarks.md); verify of n = 2, 4, 8 tokens relative to one decode step; one head draft step relative to
   one decode step (short prompt). Fractions and verify ratios are taken within each of 5 rounds (the same moment of
   the machine), their median reported; decode ms and the read rate are the best round's.
2. Speculative speed on MT-bench prompts (`auto` path; the slower paths would take too long): transformers
   `generate` and its prompt lookup (in the dtype of our decode weights), our plain decode on the `auto` and `torch`
   paths, our MTP speculative decode at each k and our prompt lookup; tokens/s, ratios and τ.
3. Trees (`--trees`, `auto` path): the head's draft trees (DEPTHxTOPKxNODES, +lookup for the hybrid tree) on the same
   prompts; tokens/s and τ of each against the best chain k, and the tree verify's cost (tree mask) beside a causal
   verify of the same size, relative to a decode step (short prompt).

Ends with one `RESULT` line: `decode_bw_frac`, `verify4_over_decode` (auto, short prompt), `speedup_best` (auto, best
MTP k over auto plain), `long_decode_over_short` (auto), per-path figures and the machine. `--quick`: 2 prompts, 48
new tokens, k = 1 and 3, fewer repeats (the full run: 6 prompts, 128 new tokens, k = 1..4); their wall times are in
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
PATHS = ("torch", "kernels-fp32", "auto", "auto-kv-fp32", "int8")
VERIFY_ROWS = (2, 4, 8)
READ_BUFFER_BYTES = 256 * 2**20  # the buffer whose sum measures the read bandwidth (far larger than the caches)
PROMPT_INSTRUCTION = "Summarize the text above in three sentences."


@dataclass
class DecodePath:
    """One way of running the decode phase: a target and a head over it, with their own weight copies."""

    name: str  # one of PATHS
    description: str
    target: object  # CausalLM
    head: object  # DraftHead


@dataclass
class StepProfile:
    """What one target forward of a few tokens costs on one path after one prompt, and what it reads."""

    path: str
    prompt: str  # "short" | "long"
    prompt_tokens: int
    step_rounds: dict[int, list[float]]  # {tokens in the forward: seconds per round}; 1 = a decode step, n > 1 a verify
    weight_bytes: int  # weights one decode step reads
    kv_bytes: int  # K/V history one decode step reads
    head_seconds: float | None  # one head draft step (short prompt only)
    read_rounds: list[float]  # seconds of one read of READ_BUFFER_BYTES, in the same rounds as the steps

    @property
    def step_seconds(self) -> dict[int, float]:
        """{tokens in the forward: its best round}."""
        return {n: min(times) for n, times in self.step_rounds.items()}

    @property
    def read_gbs(self) -> float:
        """The machine's read bandwidth: the best round of the read."""
        return READ_BUFFER_BYTES / min(self.read_rounds) / 1e9

    @property
    def decode_seconds(self) -> float:
        return self.step_seconds[1]

    @property
    def streamed_gbs(self) -> float:
        """Bytes one decode step reads over its time, GB/s."""
        return (self.weight_bytes + self.kv_bytes) / self.decode_seconds / 1e9

    @property
    def bandwidth_fraction(self) -> float:
        """Decode GB/s over read GB/s within each round (the same moment of the machine), the median over rounds."""
        step_bytes = self.weight_bytes + self.kv_bytes
        return statistics.median(step_bytes / one_s / (READ_BUFFER_BYTES / read_s)
                                 for one_s, read_s in zip(self.step_rounds[1], self.read_rounds))

    def verify_over_decode(self, n: int) -> float:
        """A verify of n tokens over a decode step within each round, the median over rounds."""
        return statistics.median(n_s / one_s for n_s, one_s in zip(self.step_rounds[n], self.step_rounds[1]))

    @property
    def head_over_decode(self) -> float | None:
        return None if self.head_seconds is None else self.head_seconds / self.decode_seconds


# ---------------------------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------------------------


def prompt_sources(prompt_set: str) -> list[tuple[str, str]]:
    """[(label, text)]: the prompt set's questions (every turn; a built-in set's name or a JSONL path) and the repo's
    README and docs."""
    from mtp_train.evaluate.prompts import load_mt_bench

    questions = load_mt_bench(prompt_set)
    sources = [(f"{prompt_set} questions", "\n\n".join(turn for prompt in questions.prompts for turn in prompt.turns))]
    docs = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    text = "\n\n".join(path.read_text() for path in docs if path.is_file())
    if text:
        sources.append(("README/docs", text))
    return sources


def build_long_prompt(tokenizer, sources: list[tuple[str, str]], tokens: int) -> tuple[list[int], str]:
    """A chat prompt of about `tokens` tokens: the sources' opening tokens in equal shares (a short source leaves its
    share to the next ones) in one user message, then `PROMPT_INSTRUCTION`. Returns (ids, what it is made of)."""
    from mtp_train.runtime.chat import encode_chat

    overhead = len(encode_chat(tokenizer, [{"role": "user", "content": "\n\n" + PROMPT_INSTRUCTION}]))
    remaining, pieces, parts = max(tokens - overhead, 0), [], []
    for i, (label, text) in enumerate(sources):
        share = remaining // (len(sources) - i)
        ids = tokenizer.encode(text, add_special_tokens=False)[:share]
        remaining -= len(ids)
        pieces.append(tokenizer.decode(ids))
        parts.append(f"{label} {len(ids)}")
    ids = encode_chat(tokenizer, [{"role": "user", "content": "\n\n".join(pieces + [PROMPT_INSTRUCTION])}])
    return ids, f"{len(ids)} tokens ({', '.join(parts)}, chat template + instruction {overhead})"


# ---------------------------------------------------------------------------------------------------------------
# paths and bytes
# ---------------------------------------------------------------------------------------------------------------


def load_paths(names, target_dir: Path, head_dir: str, precision) -> list[DecodePath]:
    """Each path's target and head, loaded separately (separate weight copies)."""
    from mtp_train.runtime.cpu_decode import KERNEL_MAX_ROWS
    from mtp_train.runtime.decode_runner import HeadRunner, KernelDecoderLayer, apply_decode_path, head_runner
    from mtp_train.runtime.loader import load_model
    from mtp_train.runtime.precision import resolve_precision

    paths = []
    for name in names:
        if name in ("auto", "auto-kv-fp32", "int8"):
            path_precision = {"auto": precision, "auto-kv-fp32": replace(precision, kv_cache_dtype="float32"),
                              "int8": resolve_precision("auto", "int8", "cpu")}[name]
            target = load_model(target_dir, device="cpu", precision=path_precision)
            head = head_runner(load_head(head_dir, target), path_precision, "auto")
            description = f"load_model(precision): {path_precision.describe()}; head draft weights {head.decode_weights}"
        elif name == "kernels-fp32":
            target = apply_decode_path(load_model(target_dir, device="cpu", dtype="float32"), torch.float32,
                                       KERNEL_MAX_ROWS)
            head = HeadRunner(load_head(head_dir, target), torch.float32, KERNEL_MAX_ROWS)
            description = f"fp32 weights, CPU decode kernels up to {KERNEL_MAX_ROWS} rows"
        else:
            target = load_model(target_dir, device="cpu", dtype="float32")
            head = load_head(head_dir, target)
            description = "fp32 weights, the model's own torch ops (no decode path)"
        kernels = sum(isinstance(layer, KernelDecoderLayer) for layer in target.model.layers)
        paths.append(DecodePath(name, f"{description}; {kernels}/{len(target.model.layers)} layers on kernels",
                                target, head))
    return paths


def load_head(head_dir: str, target):
    """The trained head at `head_dir` over `target` in its dtype, else an untrained one (same shapes and cost)."""
    from mtp_train.export.load import load_any_head
    from mtp_train.heads import DraftHead, HeadConfig

    if Path(head_dir).is_dir():
        return load_any_head(head_dir, target, dtype=target.dtype)
    return DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint, kind="mtp"))


def few_row_weight(linear) -> torch.Tensor:
    """The weight a linear's forward of one row reads: its decode copy (`decode_runner.DecodeLinear.small`) where it
    has one."""
    small = getattr(linear, "small", None)
    return small.weight if small is not None else linear.weight


def weight_bytes_per_step(target) -> int:
    """Weight bytes one decode step of `target` reads: every decoder layer's matrices in the dtype its few-row forward
    holds them in (the kernel's packed copies, else the q_proj's one-row weight; norm vectors: fp32 in the kernel, own
    dtype otherwise) plus the lm_head's one-row weight. The one embedding row is left out."""
    total = 0
    for layer in target.model.layers:
        kernel = getattr(layer, "kernel", None)  # a decode_runner.KernelDecoderLayer's
        matrix_size = kernel.qkv.element_size() if kernel is not None else \
            few_row_weight(layer.self_attn.q_proj).element_size()
        for p in layer.parameters():
            total += p.numel() * (matrix_size if p.dim() == 2 else 4 if kernel is not None else p.element_size())
    weight = few_row_weight(target.lm_head)
    return total + weight.numel() * weight.element_size()


def kv_bytes_per_step(target, kv_len: int) -> int:
    """K/V bytes one decode step reads over a history of `kv_len` tokens (K and V, every layer)."""
    c = target.config
    element = torch.empty((), dtype=target.kv_cache_dtype or target.dtype).element_size()
    return 2 * c.num_hidden_layers * kv_len * c.num_key_value_heads * c.head_dim * element


def profile_path(path: DecodePath, prompt: str, ids: list[int], repeats: int, with_head: bool) -> StepProfile:
    from mtp_train.profile.costs import head_step_seconds, target_step_rounds

    buffer = torch.ones(READ_BUFFER_BYTES // 4, dtype=torch.float32)
    rounds = target_step_rounds(path.target, ids, [1, *VERIFY_ROWS], repeats=repeats, beside={"read": buffer.sum})
    read_rounds = rounds.pop("read")
    head = head_step_seconds(path.target, path.head, ids, repeats=3 * repeats) if with_head else None
    return StepProfile(path.name, prompt, len(ids), rounds, weight_bytes_per_step(path.target),
                       kv_bytes_per_step(path.target, len(ids) + 1), head, read_rounds)


def print_profiles(profiles: list[StepProfile]) -> None:
    print(f"\n{'path':13s} {'prompt':>6s} {'tokens':>6s} {'decode ms':>9s} {'weights MB':>10s} {'K/V MB':>7s} "
          f"{'GB/s':>5s} {'read':>5s} {'bw frac':>7s} " + " ".join(f"{f'verify{n}':>7s}" for n in VERIFY_ROWS)
          + f" {'head':>5s}")
    for p in profiles:
        head = f"{p.head_over_decode:5.2f}" if p.head_over_decode is not None else f"{'-':>5s}"
        print(f"{p.path:13s} {p.prompt:>6s} {p.prompt_tokens:6d} {p.decode_seconds * 1e3:9.1f} "
              f"{p.weight_bytes / 1e6:10.1f} {p.kv_bytes / 1e6:7.1f} {p.streamed_gbs:5.1f} {p.read_gbs:5.1f} "
              f"{p.bandwidth_fraction:7.2f} "
              + " ".join(f"{p.verify_over_decode(n):7.2f}" for n in VERIFY_ROWS) + f" {head}")
    print("(verifyN and head: seconds relative to one decode step of the same path and prompt; GB/s: (weights + K/V) "
          "/ decode time; read: the machine's read bandwidth (a sum over a 256 MiB fp32 buffer) timed in the same "
          "rounds as the steps (best round each); bw frac and verifyN: ratios within each of 5 rounds, the median)")


# ---------------------------------------------------------------------------------------------------------------
# speculative speed
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ContenderTotals:
    tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0  # per sequence (τ's denominator); 0 when not speculative
    spec_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tau(self) -> float:
        return self.spec_tokens / self.target_forwards if self.target_forwards else float("nan")


def run_contenders(contenders: dict, prompts: list[list[int]]) -> dict[str, ContenderTotals]:
    """Every contender on every prompt, interleaved prompt by prompt (noise hits every contender alike)."""
    for fn in contenders.values():  # warm-up
        fn(prompts[0][:12])
    totals = {name: ContenderTotals() for name in contenders}
    for ids in prompts:
        for name, fn in contenders.items():
            start = time.perf_counter()
            tokens, stats = fn(ids)
            totals[name].seconds += time.perf_counter() - start
            totals[name].tokens += tokens
            if stats is not None:
                totals[name].target_forwards += stats.target_sequence_forwards
                totals[name].spec_tokens += stats.new_tokens
    return totals


def _spec(outcome):
    results, stats = outcome
    return len(results[0].token_ids), stats


@dataclass
class AutoRun:
    """What the speculative benchmarks run on: the target on the `auto` path, its head, tokenizer and stop tokens."""

    precision: object
    target: object
    head: object
    head_weights: str  # the weights the head's draft steps read (`decode_runner.head_runner`)
    trained: bool  # False: `--head` was not found and the head is untrained (same shapes and cost)
    tokenizer: object
    stop_token_ids: tuple[int, ...]


def load_auto_run(args) -> AutoRun:
    """`--target` (default: the fetched SmolLM2) on the `auto` path and `--head` over it with its `auto` draft
    weights; prints what was loaded."""
    from mtp_train.assets import ensure_default_model
    from mtp_train.runtime.chat import stop_token_ids
    from mtp_train.runtime.loader import load_model, load_tokenizer
    from mtp_train.runtime.decode_runner import head_runner
    from mtp_train.runtime.precision import resolve_precision

    target_dir = Path(args.target) if args.target else ensure_default_model()
    precision = resolve_precision("auto", "auto", "cpu")
    target = load_model(target_dir, device="cpu", precision=precision)
    head = head_runner(load_head(args.head, target), precision, "auto")
    head_weights = head.decode_weights
    trained = Path(args.head).is_dir()
    print(f"target: {precision.describe()}; head draft weights {head_weights}"
          f"{'' if trained else ' (untrained head: ' + args.head + ' not found)'}")
    tokenizer = load_tokenizer(target_dir)
    return AutoRun(precision, target, head, head_weights, trained, tokenizer, stop_token_ids(tokenizer, target.config))


def add_run_arguments(parser: argparse.ArgumentParser, new_tokens: int) -> None:
    """The options the speculative benchmarks share: target, head, MT-bench-format prompts, how many, new tokens."""
    parser.add_argument("--target", default=None, help="model dir (default: fetched SmolLM2)")
    parser.add_argument("--head", default="runs/smollm2-135m-mtp/head", help="trained head (else an untrained one)")
    parser.add_argument("--prompts", default="mt_bench",
                        help="built-in prompt set (mt_bench, humaneval, gsm8k) or MT-bench-format JSONL file")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)


def mt_bench_chat_prompts(tokenizer, prompt_set: str, limit: int) -> list[list[int]]:
    """The first turns of the prompt set's first `limit` questions (a built-in set's name or an MT-bench-format JSONL
    path) as chat-templated prompt ids."""
    from mtp_train.evaluate.prompts import load_mt_bench
    from mtp_train.runtime.chat import encode_chat

    return [encode_chat(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
            for prompt in load_mt_bench(prompt_set, limit).prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, new_tokens=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--short-tokens", type=int, default=200, help="short profile prompt, tokens")
    parser.add_argument("--long-tokens", type=int, default=4000, help="long profile prompt, tokens")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                        help="paths to profile (`auto` always)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="the `auto` path's dtype: auto | float32 | bfloat16")
    parser.add_argument("--quick", action="store_true", help="2 prompts, 48 tokens, k = 1 and 3, fewer repeats")
    parser.add_argument("--trees", nargs="*", default=["4x2x8", "5x3x16", "4x2x8+lookup"], metavar="DxKxN[+lookup]",
                        help="tree shapes run beside the chain (none: skip the trees)")
    args = parser.parse_args()
    repeats_short, repeats_long = 8, 2  # calls per round of `target_step_rounds` (5 rounds, 3 warm-up calls)
    if args.quick:
        args.num_prompts, args.new_tokens, args.ks = 2, 48, [1, 3]
        repeats_short, repeats_long = 3, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [name for name in PATHS if name in args.paths or name == "auto"]
    from mtp_train.runtime.kernels import cpu_kernels, unavailable_reason

    if "int8" in names and cpu_kernels() is None:  # int8 decode weights run through the CPU decode kernels only
        print(f"int8 path skipped: the CPU decode kernels are unavailable ({unavailable_reason()})")
        names.remove("int8")

    from transformers import AutoModelForCausalLM

    from mtp_train.assets import ensure_default_model
    from mtp_train.runtime.chat import stop_token_ids
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.hardware import machine_fields
    from mtp_train.runtime.loader import load_tokenizer
    from mtp_train.runtime.precision import resolve_precision
    from mtp_train.runtime.spec import PromptLookup, speculative_generate

    run_started = time.perf_counter()
    target_dir = Path(args.target) if args.target else ensure_default_model()
    precision = resolve_precision(args.dtype, "auto", "cpu")
    tokenizer = load_tokenizer(target_dir)
    started = time.perf_counter()
    paths = load_paths(names, target_dir, args.head, precision)
    by_name = {path.name: path for path in paths}
    auto = by_name["auto"]
    head_label = args.head if Path(args.head).is_dir() else "untrained random-init head (no --head found)"
    print(f"{len(paths)} paths loaded in {time.perf_counter() - started:.1f} s; {torch.get_num_threads()} threads; "
          f"head: {head_label}")
    for path in paths:
        print(f"  {path.name:13s} {path.description}")

    # 1. cost profile
    sources = prompt_sources(args.prompts)
    short_ids, short_what = build_long_prompt(tokenizer, sources, args.short_tokens)
    long_ids, long_what = build_long_prompt(tokenizer, sources, args.long_tokens)
    print(f"profile prompts: short {short_what}; long {long_what}")
    profiles: dict[tuple[str, str], StepProfile] = {}
    for path in paths:
        started = time.perf_counter()
        profiles[path.name, "short"] = profile_path(path, "short", short_ids, repeats_short, with_head=True)
        profiles[path.name, "long"] = profile_path(path, "long", long_ids, repeats_long, with_head=False)
        print(f"  {path.name} profiled in {time.perf_counter() - started:.1f} s")
    print_profiles(list(profiles.values()))

    # 2. speculative speed, MT-bench prompts
    prompts = mt_bench_chat_prompts(tokenizer, args.prompts, args.num_prompts)
    stops = stop_token_ids(tokenizer, auto.target.config)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=precision.decode_torch_dtype).eval()

    def hf_run(ids, lookup: bool):
        kwargs = {"max_new_tokens": args.new_tokens, "do_sample": False, "eos_token_id": list(stops)}
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = 10
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), **kwargs)
        return out.shape[1] - len(ids), None

    def plain(target):
        return lambda ids: (len(generate(target, [ids], args.new_tokens, stop_token_ids=stops)[0][0].token_ids), None)

    contenders = {"hf_generate": lambda ids: hf_run(ids, False), "hf_prompt_lookup": lambda ids: hf_run(ids, True)}
    if "torch" in by_name:
        contenders["torch_plain"] = plain(by_name["torch"].target)
    contenders["auto_plain"] = plain(auto.target)
    if "int8" in by_name:
        contenders["int8_plain"] = plain(by_name["int8"].target)
    for k in args.ks:
        contenders[f"auto_mtp_k{k}"] = lambda ids, k=k: _spec(speculative_generate(
            auto.target, auto.head, [ids], args.new_tokens, k, stop_token_ids=stops))
    contenders["auto_lookup_k3"] = lambda ids: _spec(speculative_generate(
        auto.target, PromptLookup(), [ids], args.new_tokens, 3, stop_token_ids=stops))
    from mtp_train.runtime.spec import DraftTree
    from mtp_train.runtime.spec.tree import parse_tree_method

    trees = {}
    for spec in args.trees:
        shape, hybrid = parse_tree_method(spec)
        trees[f"auto_tree_{spec}"] = DraftTree(auto.head, shape, PromptLookup() if hybrid else None)
    for name, tree in trees.items():
        contenders[name] = lambda ids, tree=tree: _spec(speculative_generate(
            auto.target, tree, [ids], args.new_tokens, stop_token_ids=stops))
    started = time.perf_counter()
    totals = run_contenders(contenders, prompts)
    print(f"\n{len(contenders)} contenders run in {time.perf_counter() - started:.1f} s")
    hf_tps, plain_tps = totals["hf_generate"].tokens_per_second, totals["auto_plain"].tokens_per_second
    print(f"{len(prompts)} MT-bench prompts, <= {args.new_tokens} new tokens, batch 1, greedy; transformers in "
          f"{precision.decode_dtype}")
    print(f"{'contender':18s} {'tok/s':>8s} {'vs HF':>6s} {'vs auto plain':>13s} {'tau':>6s}")
    for name, total in totals.items():
        tps = total.tokens_per_second
        print(f"{name:18s} {tps:8.1f} {tps / hf_tps:6.2f} {tps / plain_tps:13.2f} {total.tau:6.2f}")
    if "torch_plain" in totals:
        print(f"auto plain vs torch plain: {plain_tps / totals['torch_plain'].tokens_per_second:.2f}×")

    best = max((name for name in totals if name.startswith("auto_mtp")), key=lambda n: totals[n].tokens_per_second)
    tree_fields = {}
    if trees:
        from mtp_train.profile.costs import measure_tree_costs

        shapes = list({tree.shape.label: tree.shape for tree in trees.values()}.values())
        costs = measure_tree_costs(auto.target, short_ids, shapes, profiles["auto", "short"].decode_seconds,
                                   repeats_short)
        chain_tps, chain_tau = totals[best].tokens_per_second, totals[best].tau
        print(f"\ntrees against the best chain ({best}: {chain_tps:.1f} tok/s, τ {chain_tau:.2f}); verify costs after "
              f"the short prompt, relative to one decode step")
        print(f"{'tree':22s} {'tok/s':>8s} {'vs chain':>8s} {'tau':>6s} {'tau/chain':>9s} {'verify':>7s} "
              f"{'causal':>7s} {'mask':>6s}")
        for name, tree in trees.items():
            total, cost = totals[name], costs[tree.shape.label]
            print(f"{name:22s} {total.tokens_per_second:8.1f} {total.tokens_per_second / chain_tps:8.2f} "
                  f"{total.tau:6.2f} {total.tau / chain_tau:9.2f} {cost.verify_over_decode:7.2f} "
                  f"{cost.causal_verify_over_decode:7.2f} {cost.mask_cost:6.2f}")
        best_tree = max(trees, key=lambda n: totals[n].tokens_per_second)
        tree_fields = {
            "best_tree": best_tree.removeprefix("auto_tree_"),
            "tree_speedup_best": f"{totals[best_tree].tokens_per_second / plain_tps:.3f}",
            "tree_vs_chain_speedup": f"{totals[best_tree].tokens_per_second / chain_tps:.3f}",
            "tree_tau": f"{totals[best_tree].tau:.3f}",
            "tree_tau_over_chain_tau": f"{totals[best_tree].tau / chain_tau:.3f}",
            "tree_verify_over_decode": f"{costs[trees[best_tree].shape.label].verify_over_decode:.3f}",
            "tree_mask_cost": f"{costs[trees[best_tree].shape.label].mask_cost:.3f}",
        }

    # 3. RESULT
    short, long = profiles["auto", "short"], profiles["auto", "long"]
    fields = {
        "decode_bw_frac": f"{short.bandwidth_fraction:.3f}",
        "verify4_over_decode": f"{short.verify_over_decode(4):.3f}",
        "speedup_best": f"{totals[best].tokens_per_second / plain_tps:.3f}",
        "long_decode_over_short": f"{long.decode_seconds / short.decode_seconds:.3f}",
        "auto_decode_ms": f"{short.decode_seconds * 1e3:.2f}",
        "auto_long_decode_ms": f"{long.decode_seconds * 1e3:.2f}",
        "auto_long_bw_frac": f"{long.bandwidth_fraction:.3f}",
        "auto_verify2_over_decode": f"{short.verify_over_decode(2):.3f}",
        "auto_verify8_over_decode": f"{short.verify_over_decode(8):.3f}",
        "auto_long_verify4_over_decode": f"{long.verify_over_decode(4):.3f}",
        "head_step_over_decode": f"{short.head_over_decode:.3f}",
    }
    for name in ("torch", "kernels-fp32", "auto-kv-fp32", "int8"):
        if name in by_name:
            key, p = name.replace("-", "_"), profiles[name, "short"]
            fields[f"{key}_decode_ms"] = f"{p.decode_seconds * 1e3:.2f}"
            fields[f"{key}_long_decode_ms"] = f"{profiles[name, 'long'].decode_seconds * 1e3:.2f}"
            fields[f"{key}_decode_bw_frac"] = f"{p.bandwidth_fraction:.3f}"
            fields[f"{key}_verify4_over_decode"] = f"{p.verify_over_decode(4):.3f}"
            fields[f"{key}_long_verify4_over_decode"] = f"{profiles[name, 'long'].verify_over_decode(4):.3f}"
    fields |= {
        "best_mtp_k": best.removeprefix("auto_mtp_k"),
        "best_mtp_tau": f"{totals[best].tau:.3f}",
        "lookup_speedup": f"{totals['auto_lookup_k3'].tokens_per_second / plain_tps:.3f}",
        "lookup_tau": f"{totals['auto_lookup_k3'].tau:.3f}",
        "auto_plain_tok_s": f"{plain_tps:.2f}",
        "hf_tok_s": f"{hf_tps:.2f}",
        "plain_vs_hf": f"{plain_tps / hf_tps:.3f}",
        "hf_lookup_vs_hf": f"{totals['hf_prompt_lookup'].tokens_per_second / hf_tps:.3f}",
    }
    fields |= tree_fields
    if "torch_plain" in totals:
        fields["auto_plain_vs_torch_plain"] = f"{plain_tps / totals['torch_plain'].tokens_per_second:.3f}"
    if "int8_plain" in totals:
        fields["int8_plain_vs_auto_plain"] = f"{totals['int8_plain'].tokens_per_second / plain_tps:.3f}"
    fields |= {f"mtp_k{k}_speedup": f"{totals[f'auto_mtp_k{k}'].tokens_per_second / plain_tps:.3f}" for k in args.ks}
    fields |= {
        "short_prompt_tokens": str(short.prompt_tokens),
        "long_prompt_tokens": str(long.prompt_tokens),
        "bandwidth_gbs": f"{short.read_gbs:.2f}",
        "long_bandwidth_gbs": f"{long.read_gbs:.2f}",
        "wall_s": f"{time.perf_counter() - run_started:.0f}",
        "threads": str(torch.get_num_threads()),
        "decode_dtype": precision.decode_dtype,
        "kv_cache_dtype": precision.kv_cache_dtype or precision.dtype,
        "decode_max_rows": str(precision.decode_max_rows),
    }
    fields_text = " ".join(f"{key}={value}" for key, value in fields.items())
    print(f"RESULT {fields_text} {machine_fields(precision.dtype)}")


if __name__ == "__main__":
    main()
