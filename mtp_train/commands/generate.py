"""`mtp-train generate`: chat with a target model through the runtime (streams text; `--json` for machines).

With `--head DIR` (a trained draft head: a trainer's head/ or any export format; MTP chain schedule) or `--draft DIR`
(a smaller model with the target's tokenizer, target–draft schedule) it decodes speculatively; the output is the same
as without (token-identical in greedy mode) and `--json` adds the acceptance statistics.

Several prompts (`--prompt` repeated, or `--prompts-file`) are decoded `--batch-size` at a time, plain or
speculatively: each sequence accepts its own number of drafts, and a finished one leaves the batch and frees its
pages. Replies print in prompt order (`--json`: one JSON object per line)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from mtp_train.cli_options import add_recipe_options, defaults_from_args

# The recipe's precision keys `generate` takes as options (it reads no recipe: the schema's defaults, then these).
PRECISION_OPTIONS = ("precision.compute", "precision.decode", "precision.kv_cache", "precision.head_decode")
RUNTIME_OPTIONS = ("target.attention",)  # --attention


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate a reply through the inference runtime",
        description="Apply the target's chat template to PROMPT and decode with our paged runtime.",
    )
    p.add_argument("--target", default=None, help="HF model directory (default: the fetched SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", default=None,
                   help="user message (repeat for several prompts, decoded in batches of --batch-size)")
    p.add_argument("--prompts-file", default=None, metavar="FILE",
                   help="one user message per line (plain text), or JSONL rows with a `prompt` string or MT-bench "
                        "`turns` (the first turn is used); or a built-in prompt set's name: mt_bench, humaneval, "
                        "gsm8k")
    p.add_argument("--batch-size", type=int, default=16, metavar="N",
                   help="prompts decoded together when there are several (default 16)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="P",
                   help="divide the logits of tokens the prompt or reply already holds by P (> 1 discourages "
                        "repeats, as transformers' and vLLM's repetition_penalty; 1 = off, the default, so greedy "
                        "output stays the model's own). Speculative decoding gives the same output with it")
    p.add_argument("--seed", type=int, default=0)
    add_recipe_options(p, PRECISION_OPTIONS + RUNTIME_OPTIONS)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--head", default=None, metavar="DIR",
                       help="decode speculatively with this draft head (MTP chain): a trainer's head/ or any `export` "
                       "format")
    draft.add_argument("--draft", default=None, metavar="DIR",
                       help="decode speculatively with this smaller model (same tokenizer)")
    p.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K",
                   help="draft tokens per step with --head/--draft (1..8, default 3)")
    p.set_defaults(func=run_generate)


def _default_target() -> str:
    from mtp_train.assets import DEFAULT_MODEL, model_dir

    return str(model_dir(DEFAULT_MODEL))


def check_generate_args(args: argparse.Namespace) -> None:
    """Refuse degenerate `generate` arguments by name before any model is loaded (raises UserError)."""
    from mtp_train.errors import UserError
    from mtp_train.runtime.spec.engine import MAX_SPECULATIVE_TOKENS

    if not args.prompt and not args.prompts_file:
        raise UserError("give the user message with --prompt TEXT (repeatable) or --prompts-file FILE")
    for prompt in args.prompt or []:
        if not prompt.strip():
            raise UserError(f"--prompt is empty{' (only whitespace)' if prompt else ''}: give the user message")
    if not 1 <= args.batch_size <= MAX_GENERATE_BATCH:
        raise UserError(f"--batch-size must be in 1..{MAX_GENERATE_BATCH}, got {args.batch_size}")
    if args.system is not None and not args.system.strip():
        raise UserError("--system is empty: give the system message, or leave --system out for none")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    for option, value in (("--temperature", args.temperature), ("--top-p", args.top_p),
                          ("--repetition-penalty", args.repetition_penalty)):
        if not math.isfinite(value):
            raise UserError(f"{option} must be a finite number, got {value}")
    if args.repetition_penalty <= 0:
        raise UserError(f"--repetition-penalty must be > 0 (1 = off; 1.1-1.3 against loops), got "
                        f"{args.repetition_penalty}")
    if not -(2**63) <= args.seed < 2**64:  # what torch.Generator.manual_seed takes
        raise UserError(f"--seed must be in -2**63 .. 2**64-1, got {args.seed}")
    if (args.head or args.draft) and not 1 <= args.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise UserError(f"--num-speculative-tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                        f"got {args.num_speculative_tokens}")


MAX_GENERATE_BATCH = 256


def read_prompts_file(path: str) -> list[str]:
    """The user messages of `--prompts-file` (a file, or a built-in prompt set's name): plain-text lines, or JSONL
    rows with `prompt` or `turns` (first turn). Blank lines are skipped; a row without a message is a UserError naming
    the file and line."""
    from mtp_train.errors import UserError
    from mtp_train.evaluate.prompts import prompts_file

    try:
        file = prompts_file(path)
    except UserError as err:
        raise UserError(f"--prompts-file {err}") from None
    prompts = []
    for line_number, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{line_number}: invalid JSON ({err})") from None
        message = row.get("prompt") if isinstance(row.get("prompt"), str) else (
            row["turns"][0] if isinstance(row.get("turns"), list) and row["turns"] and isinstance(row["turns"][0], str)
            else None)
        if message is None or not message.strip():
            raise UserError(f"{path}:{line_number}: no user message: expected a non-empty `prompt` string or `turns`")
        prompts.append(message)
    if not prompts:
        raise UserError(f"--prompts-file {path}: no prompts in it")
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    from mtp_train.errors import UserError
    from mtp_train.runtime.chat import encode_chat, stop_token_ids
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.loader import load_model, load_tokenizer, resolve_device
    from mtp_train.runtime.precision import resolve_section
    from mtp_train.runtime.sampler import SamplingParams

    check_generate_args(args)
    options = defaults_from_args(args)
    section = options.precision
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    except ValueError as err:
        raise UserError(str(err)) from None
    target = args.target or _default_target()
    device = resolve_device(args.device)
    precision = resolve_section(section, device)
    if not args.json:
        print(f"[{precision.describe()}]", file=sys.stderr)
    model = load_model(target, device=device, precision=precision, backend=options.target.attention)
    tokenizer = load_tokenizer(target)
    user_messages = list(args.prompt or []) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    prompt_ids = [encode_chat(tokenizer, system + [{"role": "user", "content": m}], target) for m in user_messages]
    stops = stop_token_ids(tokenizer, model.config)

    draft = None
    if args.head or args.draft:
        from mtp_train.export.load import load_draft

        draft = load_draft(model, tokenizer, precision, head=args.head, draft_model=args.draft,
                           head_decode_dtype=section.head_decode)

    def decode(batch_ids: list[list[int]], on_tokens):
        options = dict(stop_token_ids=stops, seed=args.seed, on_tokens=on_tokens)
        if draft is None:
            return generate(model, batch_ids, args.max_new_tokens, sampling, **options)
        from mtp_train.runtime.spec import speculative_generate

        return speculative_generate(model, draft, batch_ids, args.max_new_tokens, args.num_speculative_tokens,
                                    sampling, **options)

    def reply_text(token_ids: list[int]) -> tuple[list[int], str]:
        if token_ids and token_ids[-1] in stops:
            token_ids = token_ids[:-1]
        return token_ids, tokenizer.decode(token_ids, skip_special_tokens=True)

    if len(prompt_ids) == 1:  # one prompt: stream its text
        streamer = None if args.json else TextStreamer(tokenizer)
        results, stats = decode(prompt_ids, (lambda _i, ids: streamer.push(ids)) if streamer else None)
        token_ids, text = reply_text(results[0].token_ids)
        if args.json:
            print(json.dumps({
                "text": text, "token_ids": token_ids, "num_tokens": len(token_ids),
                "finish_reason": results[0].finish_reason, "tokens_per_s": round(stats.tokens_per_s, 2),
                "prompt_tokens": len(prompt_ids[0]), **({"stats": stats.to_dict()} if draft is not None else {}),
            }))
        else:
            streamer.finish()
            spec = f", tau {stats.tau:.2f}, alpha {stats.alpha:.2f}" if draft is not None else ""
            print(f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s{spec}, {results[0].finish_reason}]",
                  file=sys.stderr)
        return 0

    from tqdm import tqdm

    progress = tqdm(total=len(prompt_ids), desc="generate", unit="prompt", file=sys.stderr, disable=None)
    for first in range(0, len(prompt_ids), args.batch_size):
        batch_ids = prompt_ids[first : first + args.batch_size]
        results, stats = decode(batch_ids, None)
        spec = f", tau {stats.tau:.2f}, alpha {stats.alpha:.2f}" if draft is not None else ""
        progress.write(f"[batch of {len(batch_ids)}: {stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s"
                       f"{spec}]", file=sys.stderr)
        for offset, (ids, result) in enumerate(zip(batch_ids, results)):
            index = first + offset
            token_ids, text = reply_text(result.token_ids)
            if args.json:
                print(json.dumps({"index": index, "prompt": user_messages[index], "text": text, "token_ids": token_ids,
                                  "num_tokens": len(token_ids), "finish_reason": result.finish_reason,
                                  "prompt_tokens": len(ids)}), flush=True)
            else:
                print(f"### [{index}] {user_messages[index]}\n{text}\n", flush=True)
        progress.update(len(batch_ids))
    progress.close()
    return 0


class TextStreamer:
    """Prints decoded text as tokens arrive (re-decoding the tail so multi-byte characters come out whole)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def push(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        sys.stdout.write(text[self.printed :])
        sys.stdout.flush()
        self.printed = len(text)

    def finish(self) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()
