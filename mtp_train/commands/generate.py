"""`mtp-train generate`: chat with a target model through the runtime (streams text; `--json` for machines).

With `--head DIR` (a trained draft head: a trainer's head/ or any export format; MTP chain schedule) or `--draft DIR`
(a smaller model with the target's tokenizer, target–draft schedule) it decodes speculatively; the output is the same
as without (token-identical in greedy mode) and `--json` adds the acceptance statistics."""

from __future__ import annotations

import argparse
import json
import math
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate a reply through the inference runtime",
        description="Apply the target's chat template to PROMPT and decode with our paged runtime.",
    )
    p.add_argument("--target", default=None, help="HF model directory (default: the fetched SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", required=True, help="user message")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (auto: the fastest this device has; `mtp-train env` shows the choice)")
    p.add_argument("--decode-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights of the few-row decode/verify matmuls (auto: --dtype when set, else timed)")
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

    if not args.prompt.strip():
        raise UserError(f"--prompt is empty{' (only whitespace)' if args.prompt else ''}: give the user message")
    if args.system is not None and not args.system.strip():
        raise UserError("--system is empty: give the system message, or leave --system out for none")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    for option, value in (("--temperature", args.temperature), ("--top-p", args.top_p)):
        if not math.isfinite(value):
            raise UserError(f"{option} must be a finite number, got {value}")
    if not -(2**63) <= args.seed < 2**64:  # what torch.Generator.manual_seed takes
        raise UserError(f"--seed must be in -2**63 .. 2**64-1, got {args.seed}")
    if (args.head or args.draft) and not 1 <= args.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise UserError(f"--num-speculative-tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                        f"got {args.num_speculative_tokens}")


def run_generate(args: argparse.Namespace) -> int:
    from mtp_train.errors import UserError
    from mtp_train.runtime.chat import encode_chat, stop_token_ids
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.loader import load_model, load_tokenizer, resolve_device
    from mtp_train.runtime.precision import resolve_precision
    from mtp_train.runtime.sampler import SamplingParams

    check_generate_args(args)
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        raise UserError(str(err)) from None
    target = args.target or _default_target()
    device = resolve_device(args.device)
    precision = resolve_precision(args.dtype, args.decode_dtype, device)
    if not args.json:
        print(f"[{precision.describe()}]", file=sys.stderr)
    model = load_model(target, device=device, precision=precision)
    tokenizer = load_tokenizer(target)
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": args.prompt}
    ]
    prompt_ids = encode_chat(tokenizer, messages, target)
    stops = stop_token_ids(tokenizer, model.config)

    draft = None
    if args.head or args.draft:
        from mtp_train.export.load import load_draft

        draft = load_draft(model, tokenizer, precision, head=args.head, draft_model=args.draft)

    streamer = None if args.json else TextStreamer(tokenizer)
    on_tokens = (lambda _i, ids: streamer.push(ids)) if streamer else None
    options = dict(stop_token_ids=stops, seed=args.seed, on_tokens=on_tokens)
    if draft is None:
        results, stats = generate(model, [prompt_ids], args.max_new_tokens, sampling, **options)
    else:
        from mtp_train.runtime.spec import speculative_generate

        results, stats = speculative_generate(
            model, draft, [prompt_ids], args.max_new_tokens, args.num_speculative_tokens, sampling, **options
        )
    token_ids = results[0].token_ids
    if token_ids and token_ids[-1] in stops:
        token_ids = token_ids[:-1]
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "text": text, "token_ids": token_ids, "num_tokens": len(token_ids),
            "finish_reason": results[0].finish_reason, "tokens_per_s": round(stats.tokens_per_s, 2),
            "prompt_tokens": len(prompt_ids), **({"stats": stats.to_dict()} if draft is not None else {}),
        }))
    else:
        streamer.finish()
        spec = f", tau {stats.tau:.2f}, alpha {stats.alpha:.2f}" if draft is not None else ""
        print(f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s{spec}, {results[0].finish_reason}]",
              file=sys.stderr)
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
