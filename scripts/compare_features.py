#!/usr/bin/env python
"""Compare a feature cache against a reference cache of the same prepared data (e.g. `precompute --tp 2` against
TP = 1): samples matched by split and index, token ids and loss masks must be equal, hidden states compared as stored
(`mtp_train.features.compare`). Prints the figures and a final `RESULT` JSON line; exits 1 when the cache is not within
`--max-ulps` storage-dtype steps of the reference.

    python scripts/compare_features.py data/features/smollm2-tp2 data/features/smollm2-tp1
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    from mtp_train.features.compare import compare_caches

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("candidate", help="feature cache directory to check")
    parser.add_argument("reference", help="feature cache directory it should match")
    parser.add_argument("--max-ulps", type=float, default=1.0,
                        help="largest allowed |a - b| in storage-dtype spacings at |b| (default 1: one rounding step)")
    args = parser.parse_args()
    result = compare_caches(args.candidate, args.reference)
    hidden = result.hidden
    print(f"{result.samples} samples, {result.tokens} tokens")
    print(f"hidden: relative error max {hidden.max_rel:.3g}, mean {hidden.mean_rel:.3g}; per-token ||a-b||/||b|| max "
          f"{hidden.max_row_rel:.3g}, mean {hidden.mean_row_rel:.3g}; max |a-b| {hidden.max_abs:.3g}; "
          f"{hidden.elements_differing:.2%} of the values differ, by at most {hidden.max_ulps:g} storage step(s)")
    if result.argmax_agreement is not None:
        print(f"target argmax equal on {result.argmax_agreement:.4%} of the tokens")
    print("RESULT " + json.dumps(result.as_dict()))
    return 0 if hidden.max_ulps <= args.max_ulps else 1


if __name__ == "__main__":
    sys.exit(main())
