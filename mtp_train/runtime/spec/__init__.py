"""Speculative decoding through the paged runtime: `engine.py` (the step loop), `proposer.py` (what proposers share),
one module per proposer (`mtp_chain.py`, `target_draft.py`, `prompt_lookup.py`, `tree.py`, `hybrid.py`), `stats.py`
(the counters); the rejection sampler is `runtime/rejection.py`. A new proposer is one new module, imported here to
register it."""

from mtp_train.runtime.spec import hybrid, mtp_chain, prompt_lookup, target_draft, tree  # noqa: F401  (registers them)
from mtp_train.runtime.spec.engine import MAX_SPECULATIVE_TOKENS, speculative_generate
from mtp_train.runtime.spec.hybrid import HybridDraft
from mtp_train.runtime.spec.prompt_lookup import PromptLookup
from mtp_train.runtime.spec.stats import SpecStats
from mtp_train.runtime.spec.tree import DraftTree, TreeShape

__all__ = ["MAX_SPECULATIVE_TOKENS", "DraftTree", "HybridDraft", "PromptLookup", "SpecStats", "TreeShape",
           "speculative_generate"]
