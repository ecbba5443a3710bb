"""A reduced draft vocabulary: the N target tokens a head may propose, and its two encodings.

A head with a draft vocabulary of N tokens predicts logits over draft ids 0..N-1; draft id i stands for target id
`draft_ids[i]` (strictly increasing). Serving engines store that map in two tensors, the EAGLE-3 convention that vLLM,
SGLang and speculators read:

    d2t: int64 [N]  offsets, target id = i + d2t[i]
    t2d: bool  [V]  True where a target id is in the draft vocabulary

`select_draft_vocab` picks the N most frequent target tokens from counts (ties: the lower id first).
"""

from __future__ import annotations

import torch

from mtp_train.errors import UserError


def d2t_from_ids(draft_ids: torch.Tensor) -> torch.Tensor:
    """[N] increasing target ids -> [N] int64 offsets (target id = i + d2t[i])."""
    draft_ids = draft_ids.to(torch.long)
    return draft_ids - torch.arange(draft_ids.numel(), device=draft_ids.device)


def ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """[N] int64 offsets -> [N] target ids."""
    return d2t.to(torch.long) + torch.arange(d2t.numel(), device=d2t.device)


def t2d_from_ids(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool membership mask of the draft vocabulary."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=draft_ids.device)
    t2d[draft_ids.to(torch.long)] = True
    return t2d


def check_draft_ids(draft_ids: torch.Tensor, vocab_size: int, source: str = "draft vocabulary") -> None:
    """A UserError unless `draft_ids` are strictly increasing target ids in [0, vocab_size)."""
    if draft_ids.dim() != 1 or draft_ids.numel() == 0:
        raise UserError(f"{source}: expected a non-empty 1-D list of target ids, got shape {tuple(draft_ids.shape)}")
    if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= vocab_size:
        raise UserError(
            f"{source}: target ids must lie in [0, {vocab_size}), got {int(draft_ids.min())}..{int(draft_ids.max())}"
        )
    if draft_ids.numel() > 1 and not bool((draft_ids[1:] > draft_ids[:-1]).all()):
        raise UserError(f"{source}: target ids must be strictly increasing (d2t offsets non-decreasing)")


def check_d2t_t2d(d2t: torch.Tensor, t2d: torch.Tensor, source: str = "head") -> torch.Tensor:
    """Validate a (d2t, t2d) pair against each other; returns the draft ids."""
    draft_ids = ids_from_d2t(d2t)
    check_draft_ids(draft_ids, t2d.numel(), f"{source}: d2t")
    if t2d.dtype != torch.bool or not torch.equal(t2d_from_ids(draft_ids, t2d.numel()), t2d.to(draft_ids.device)):
        raise UserError(f"{source}: t2d does not mark exactly the target ids that d2t maps to")
    return draft_ids


def select_draft_vocab(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target ids, ties broken by the lower id, returned in increasing order. `token_counts`
    is [V] (how often each target id is the next token)."""
    vocab_size = token_counts.numel()
    if not 1 <= size <= vocab_size:
        raise UserError(f"draft vocabulary size must be between 1 and {vocab_size}, got {size}")
    # A stable sort on -count keeps ids in increasing order among equal counts.
    order = torch.sort(-token_counts.to(torch.long), stable=True).indices
    return torch.sort(order[:size]).values


def coverage(token_counts: torch.Tensor, draft_ids: torch.Tensor) -> float:
    """Share of counted next tokens that fall inside the draft vocabulary."""
    total = int(token_counts.sum())
    return float(token_counts[draft_ids.to(torch.long)].sum()) / total if total else 0.0
