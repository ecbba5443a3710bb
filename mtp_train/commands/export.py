"""`mtp-train export`: write a trained head in a serving engine's format (export/exporter.py, docs/export.md)."""

from __future__ import annotations

import argparse

from mtp_train.export import FORMAT_NAMES


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a trained head for a serving engine (native | deepseek-mtp | vllm-mtp | eagle | eagle3)",
        description="Convert a native head directory (model.safetensors + head_config.json) into one serving "
        "format. Formats: native (our runtime), deepseek-mtp (DeepSeek-V3 MTP layout; MTP heads; no engine loads it "
        "for a Llama-family block), vllm-mtp (vLLM's MiMo-MTP layout; MTP heads; verified in vLLM 0.32, writes "
        "SERVING.md and vllm_serve.json with the serving arguments), eagle (EAGLE-1 layout; EAGLE-1 heads; SGLang, "
        "and vLLM for a head without an fc bias: train with head.fc_bias: false), eagle3 (speculators eagle3, EAGLE-3 "
        "heads; verified in vLLM 0.32). A head a format cannot represent is refused with what would be lost. A "
        "reduced draft vocabulary is written by native and eagle3 (d2t/t2d) and eagle (SGLang "
        "--speculative-token-map file); deepseek-mtp and vllm-mtp, which have none, write such a head drafting over the full vocabulary. A head "
        "whose model.safetensors differs from the checksum recorded at save, or holds NaN/Inf weights, is refused. "
        "The export is written next to --out and renamed into place; config.json's mtp_train.checksums records "
        "each file's sha256 (checked by inspect). See docs/export.md.",
    )
    p.add_argument("--head", required=True, help="the head directory (a run's head/ or a save_head output)")
    p.add_argument("--format", required=True, help=f"one of: {', '.join(FORMAT_NAMES)}")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --overwrite)")
    p.add_argument("--target", default=None, help="the target model directory the head was trained for (required)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: the head's stored dtype")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k in the vLLM serving arguments written (vllm-mtp's SERVING.md / vllm_serve.json, eagle3's "
                   "speculators_config); default: the eval report's best k by measured speedup, else 3")
    report = p.add_mutually_exclusive_group()
    report.add_argument("--eval-report", default=None, metavar="FILE",
                        help="the head's `mtp-train eval` report.json (or its directory): its best chain k by "
                        "measured speedup (with the τ and speedup per k) goes into config.json's "
                        "mtp_train.speculative and is the serving k; default: <head>/../eval/report.json when it "
                        "measured this head")
    report.add_argument("--no-eval-report", action="store_true",
                        help="record no measured k, even if an eval report of the head exists")
    p.add_argument("--full-vocab", action="store_true",
                   help="export a head trained with a reduced draft vocabulary as a full-vocabulary head (it then "
                   "drafts over the whole vocabulary: τ changes, measure it with eval --head on the export) in a "
                   "format that could carry the draft vocabulary (native, eagle, eagle3); vllm-mtp and deepseek-mtp "
                   "always do, their engines have no draft vocabulary")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from mtp_train.export.best_k import describe
    from mtp_train.export.common import BLOCK_KEY, CONFIG_FILENAME
    from mtp_train.export.exporter import export_head
    from mtp_train.fileio import read_json_object

    out = export_head(args.head, args.format, args.out, args.target, dtype=args.dtype, overwrite=args.overwrite,
                      num_speculative_tokens=args.num_speculative_tokens, full_vocab=args.full_vocab,
                      eval_report=args.eval_report, use_eval_report=not args.no_eval_report)
    print(f"wrote {args.format} export to {out}")
    line = describe(read_json_object(out / CONFIG_FILENAME), BLOCK_KEY)
    if line is not None:
        print(line)
    return 0
