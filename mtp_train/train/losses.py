"""Training losses of a draft head: feature regression and logit distillation, over a k-step unroll.

Notation (docs/design.md): H_i is the target's final hidden state (after its final norm) at position i. The head's row
reading (H_i, t_{i+1}) is trained to produce H_{i+1} (feature loss: smooth-L1) and the target's next-token
distribution p = softmax(lm_head(H_{i+1})) (KL(p || q) with q = softmax(lm_head(out))). Both distributions are
recomputed from hidden states with the target's frozen lm_head.

Vocabulary-sized logits are the memory peak ([rows, vocab] fp32, several times over), so `distill_sums` computes them
`chunk_size` rows at a time inside one autograd.Function that never keeps more than one chunk's logits alive: it writes
each chunk's gradient dKL/d(out) = (q - p) @ W while the chunk's logits exist, and accuracy metrics come out of the same
pass. `chunk_size=None` is the plain full-logits autograd reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.cpu import CPU_BLOCK_BYTES


@dataclass
class DistillSums:
    """Sums over rows (divide by the row count for means; sums add up across micro-batches and ranks).

    With a reduced draft vocabulary the KL is taken against the target distribution restricted to the draft vocabulary
    and renormalized, over the rows whose target argmax lies inside it (`inside`); top1/top3/alpha always compare with
    the full-vocabulary target distribution, over all rows (a row whose argmax is outside counts as a miss)."""

    kl: torch.Tensor  # [] fp32: Σ_inside-rows KL(p || q); differentiable w.r.t. the draft hidden states
    top1: torch.Tensor  # [] fp32: rows where the draft's argmax is the target's argmax
    top3: torch.Tensor  # [] fp32: rows where the target's argmax is in the draft's top 3
    alpha: torch.Tensor  # [] fp32: Σ_rows Σ_v min(p_v, q_v) (expected acceptance of a sampled draft token)
    inside: torch.Tensor  # [] fp32: rows whose target argmax is in the draft vocabulary (all rows when full)


def _chunk_metrics(
    draft_logp: torch.Tensor,  # [c, N] over the draft vocabulary
    target_logits: torch.Tensor,  # [c, V] fp32, full vocabulary
    draft_ids: torch.Tensor | None,  # [N] target id of each draft id; None = full vocabulary
    target_in_draft: torch.Tensor | None,  # [V] bool (t2d); None = full vocabulary
    target_top: torch.Tensor | None = None,  # [c] the target's argmax when known (then target_logits are [c, N])
) -> tuple[torch.Tensor, ...]:
    """Per-chunk sums (kl, top1, top3, alpha, inside) and the restricted target log-probs [c, N] used for the KL, and
    the inside mask [c] (None when full)."""
    draft_top3 = draft_logp.topk(min(3, draft_logp.shape[-1]), dim=-1).indices  # [c, 3] draft ids
    if target_top is not None:  # stored argmax: `target_logits` are the draft-vocabulary logits only [c, N]
        target_logp = target_logits.log_softmax(-1)  # [c, N] restricted and renormalized
        alpha_logp = target_logp  # α within the draft vocabulary (an upper bound)
    else:
        target_top = target_logits.argmax(-1)  # [c] target ids
        full_logp = target_logits.log_softmax(-1)  # [c, V]
        if draft_ids is None:
            target_logp = alpha_logp = full_logp
        else:
            alpha_logp = full_logp[:, draft_ids]  # [c, N] log p over the draft ids (q = 0 outside them)
            target_logp = target_logits[:, draft_ids].log_softmax(-1)  # [c, N] restricted and renormalized
    kl_rows = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)
    if draft_ids is None:
        inside_rows = None
        inside = torch.tensor(float(target_top.numel()), device=target_logits.device)
    else:
        draft_top3 = draft_ids[draft_top3]  # [c, 3] target ids
        inside_rows = target_in_draft[target_top]  # [c] bool
        kl_rows = kl_rows * inside_rows
        inside = inside_rows.sum()
    alpha = torch.minimum(draft_logp, alpha_logp).exp().sum()  # min(p, q) = exp(min(log p, log q))
    top1 = (draft_top3[:, 0] == target_top).sum()
    top3 = (draft_top3 == target_top[:, None]).any(-1).sum()
    sums = tuple(value.float() for value in (kl_rows.sum(), top1, top3, alpha, inside))
    return sums, target_logp, inside_rows


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[c, d] -> [c, rows of weight] fp32 logits of the frozen lm_head (matmul in the lm_head's dtype, like the
    runtime's `compute_logits`)."""
    return F.linear(hidden.to(weight.dtype), weight).float()


class _ChunkedDistill(torch.autograd.Function):
    """Σ_rows KL(p || q), `chunk_size` rows at a time. While a chunk's logits exist, forward also computes that
    chunk's gradient dKL/d(out) = (q - p) @ W (the fused linear-cross-entropy trick): only [N, d] is kept, never
    [N, V], and backward recomputes nothing; it scales by the incoming gradient. With a draft vocabulary, q and its
    gradient live on the draft rows W[draft_ids] only; the target's full logits are still computed (forward only) for
    its argmax and the full-vocabulary metrics."""

    @staticmethod
    def forward(ctx, draft_hidden, target_hidden, weight, chunk_size: int, draft_ids, target_in_draft, target_top):
        needs_grad = ctx.needs_input_grad[0]
        grad = torch.empty(draft_hidden.shape, dtype=torch.float32, device=draft_hidden.device) if needs_grad else None
        draft_weight = weight if draft_ids is None else weight.index_select(0, draft_ids)  # [N, d]
        # With a known target argmax only the draft rows of the target's logits are needed.
        target_weight = draft_weight if target_top is not None else weight
        sums = torch.zeros(5, dtype=torch.float32, device=draft_hidden.device)  # kl, top1, top3, alpha, inside
        for start in range(0, draft_hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            draft_logp = _logits(draft_hidden[rows], draft_weight).log_softmax(-1)  # [c, N]
            chunk_sums, target_logp, inside_rows = _chunk_metrics(
                draft_logp, _logits(target_hidden[rows], target_weight), draft_ids, target_in_draft,
                None if target_top is None else target_top[rows],
            )
            sums += torch.stack(chunk_sums)
            if needs_grad:  # d KL(p || q) / d draft_logits = q - p per counted row (the KL is summed over rows)
                q_minus_p = draft_logp.exp_().sub_(target_logp.exp_())  # [c, N], in place
                if inside_rows is not None:
                    q_minus_p.mul_(inside_rows[:, None])
                grad[rows] = (q_minus_p.to(draft_weight.dtype) @ draft_weight).float()
        ctx.save_for_backward(grad)
        ctx.grad_dtype = draft_hidden.dtype
        kl, top1, top3, alpha, inside = (value.clone() for value in sums.unbind())  # independent outputs, not views
        ctx.mark_non_differentiable(top1, top3, alpha, inside)
        return kl, top1, top3, alpha, inside

    @staticmethod
    def backward(ctx, grad_kl, *_unused):
        (grad,) = ctx.saved_tensors
        return (grad * grad_kl).to(ctx.grad_dtype), None, None, None, None, None, None


def distill_sums(
    draft_hidden: torch.Tensor,  # [N, d] the head's outputs (counted rows only)
    target_next_hidden: torch.Tensor,  # [N, d] H_{i+1} for those rows
    lm_head_weight: torch.Tensor,  # [V, d] the target's frozen lm_head
    chunk_size: int | None = 1024,
    draft_ids: torch.Tensor | None = None,  # [N_draft] target ids of the draft vocabulary; None = full
    target_top: torch.Tensor | None = None,  # [N] the target's stored argmax per row (used with draft_ids only)
) -> DistillSums:
    """KL(p_target || q_head) and accuracy metrics, summed over rows (see `DistillSums`). `chunk_size=None` computes
    the full logits with plain autograd (reference for tests and benchmarks). Gradient flows to `draft_hidden` only.

    With `draft_ids` and a known `target_top` (the feature cache's `target_argmax`), the target's logits are computed
    over the draft vocabulary only: the KL, top-1/top-3 and the masking are the same, α is then measured within the
    draft vocabulary (an upper bound of the full-vocabulary α), and the full [rows, V] matmul is skipped."""
    if draft_ids is None:
        target_top = None
    weight = lm_head_weight.detach()
    target_next_hidden = target_next_hidden.detach()
    target_in_draft = None
    if draft_ids is not None:
        draft_ids = draft_ids.to(device=weight.device, dtype=torch.long)
        target_in_draft = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
        target_in_draft[draft_ids] = True
    if target_top is not None:
        target_top = target_top.to(device=weight.device, dtype=torch.long)
    if chunk_size is None:
        draft_weight = weight if draft_ids is None else weight[draft_ids]
        sums, _, _ = _chunk_metrics(
            _logits(draft_hidden, draft_weight).log_softmax(-1),
            _logits(target_next_hidden, draft_weight if target_top is not None else weight),
            draft_ids, target_in_draft, target_top,
        )
        return DistillSums(*sums)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if draft_hidden.device.type == "cpu":  # keep each [rows, width] fp32 block below glibc's mmap threshold
        # The widest block: [rows, N] when the stored argmax spares the full-vocabulary target logits, else [rows, V].
        width = draft_ids.numel() if target_top is not None else weight.shape[0]
        chunk_size = max(1, min(chunk_size, CPU_BLOCK_BYTES // (4 * width)))
    return DistillSums(
        *_ChunkedDistill.apply(draft_hidden, target_next_hidden, weight, chunk_size, draft_ids, target_in_draft,
                               target_top)
    )


def feature_loss_sum(draft_hidden: torch.Tensor, target_next_hidden: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """Σ_rows mean_d smooth-L1(out, H_{i+1}) in fp32 (EAGLE's feature loss before the row average)."""
    target = target_next_hidden.detach().float()
    return F.smooth_l1_loss(draft_hidden.float(), target, beta=beta, reduction="none").mean(-1).sum()


# The metrics of each unroll step k, logged as `step{k}/<name>` (training: `train/step{k}/...`, validation: `val/...`).
# Each is a mean over the step's counted rows, except the KL: a mean over the counted rows whose target argmax lies in
# the draft vocabulary (all of them with the full vocabulary); `metric_sums`/`metric_means` keep that one meaning when
# batches, micro-batches and ranks are combined.
STEP_METRICS = ("feature", "kl", "top1", "top3", "alpha", "coverage")


@dataclass
class StepLosses:
    """One unroll step's losses, averaged over its counted rows (0 when none)."""

    feature: torch.Tensor  # [] differentiable
    kl: torch.Tensor  # [] differentiable (mean over the counted rows whose target argmax is in the draft vocabulary)
    top1: torch.Tensor  # [] detached, in [0, 1], against the full-vocabulary target argmax
    top3: torch.Tensor  # [] detached
    alpha: torch.Tensor  # [] detached
    coverage: torch.Tensor  # [] detached: share of counted rows whose target argmax is in the draft vocabulary
    rows: int  # counted rows
    inside: torch.Tensor  # [] detached: counted rows whose target argmax is in the draft vocabulary (the KL's)

    def metrics(self, k: int) -> dict[str, torch.Tensor | int]:
        """`step{k}/<name>` for every STEP_METRICS name (detached) and `step{k}/rows`."""
        out: dict[str, torch.Tensor | int] = {f"step{k}/{name}": getattr(self, name).detach() for name in STEP_METRICS}
        out[f"step{k}/rows"] = self.rows
        out[f"step{k}/inside"] = self.inside
        return out


def metric_sums(metrics: dict[str, Any]) -> dict[str, float]:
    """The per-step means in `metrics` (from `unrolled_losses` or `StepLosses.metrics`) as sums that add up across
    batches and ranks: `step{k}/<name>` times the rows it is a mean over, plus `step{k}/rows` and `step{k}/inside`
    (counted rows inside the draft vocabulary: the KL's rows)."""
    sums: dict[str, float] = {}
    steps = sorted({key.split("/")[0] for key in metrics if key.startswith("step") and key.endswith("/rows")})
    for step in steps:
        rows = int(metrics[f"{step}/rows"])
        inside = float(metrics[f"{step}/inside"])
        sums[f"{step}/rows"] = float(rows)
        sums[f"{step}/inside"] = inside
        for name in STEP_METRICS:
            sums[f"{step}/{name}"] = float(metrics[f"{step}/{name}"]) * (inside if name == "kl" else rows)
    return sums


def add_sums(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    for key, value in more.items():
        total[key] = total.get(key, 0.0) + value
    return total


def metric_means(sums: dict[str, float]) -> dict[str, float | int]:
    """`step{k}/<name>` means from `metric_sums` totals (NaN where a step had no rows) and `step{k}/rows` counts."""
    means: dict[str, float | int] = {}
    steps = sorted({key.split("/")[0] for key in sums if key.endswith("/rows")}, key=lambda s: int(s[4:]))
    for step in steps:
        rows, inside = sums[f"{step}/rows"], sums[f"{step}/inside"]
        for name in STEP_METRICS:
            count = inside if name == "kl" else rows
            means[f"{step}/{name}"] = sums[f"{step}/{name}"] / count if count else float("nan")
        means[f"{step}/rows"] = int(rows)
    return means


def step_losses(
    draft_hidden: torch.Tensor,  # [T, d] head output for every row of the step
    target_next_hidden: torch.Tensor,  # [T, d] the target state each row should produce
    row_mask: torch.Tensor,  # [T] bool: rows that count
    lm_head_weight: torch.Tensor,  # [V, d]
    chunk_size: int | None = 1024,
    feature_beta: float = 1.0,
    draft_ids: torch.Tensor | None = None,  # [N] the draft vocabulary's target ids; None = full
    target_top: torch.Tensor | None = None,  # [T] the target's stored argmax per row (with draft_ids)
) -> StepLosses:
    """Feature and KL losses (means over counted rows; the KL over those inside the draft vocabulary) and accuracy
    metrics for one step."""
    counted = row_mask.nonzero().squeeze(1)  # [N]
    rows = int(counted.numel())
    if rows == 0:  # keep the graph connected so backward still runs
        zero = draft_hidden.sum().float() * 0.0
        return StepLosses(zero, zero, zero.detach(), zero.detach(), zero.detach(), zero.detach(), 0,
                          zero.detach())
    draft, target = draft_hidden[counted], target_next_hidden[counted]  # [N, d]
    sums = distill_sums(draft, target, lm_head_weight, chunk_size, draft_ids,
                        None if target_top is None else target_top[counted])
    return StepLosses(
        feature=feature_loss_sum(draft, target, feature_beta) / rows,
        kl=sums.kl / sums.inside.clamp(min=1.0),
        top1=sums.top1.detach() / rows,
        top3=sums.top3.detach() / rows,
        alpha=sums.alpha.detach() / rows,
        coverage=sums.inside.detach() / rows,
        rows=rows,
        inside=sums.inside.detach(),
    )


@dataclass
class _StepRows:
    """Which packed rows take part in unroll step k (every index is into the packed [T] arrays unless noted)."""

    lengths: list[int]  # rows per sequence at this step: max(n - k, 0)
    local: torch.Tensor  # [R] i: row index within its sequence
    read: torch.Tensor  # [R] o + i + k: token t_{i+k} read, target H_{i+k} produced
    counted: torch.Tensor  # [R] bool: i + k + 1 < n and loss_mask[o + i + k + 1]


def _row_starts(lengths: list[int], step_lengths: list[int], device: torch.device) -> torch.Tensor:
    """[R]: for each of the step's rows (step_lengths[b] rows for sequence b), where sequence b starts in an array
    packed with `lengths`."""
    sizes = torch.tensor(lengths, device=device, dtype=torch.long)
    return (sizes.cumsum(0) - sizes).repeat_interleave(torch.tensor(step_lengths, device=device, dtype=torch.long))


def _step_rows(lengths: list[int], loss_mask: torch.Tensor, k: int) -> _StepRows:
    device = loss_mask.device
    step_lengths = [max(n - k, 0) for n in lengths]
    counts = torch.tensor(step_lengths, device=device, dtype=torch.long)
    local = torch.cat([torch.arange(m, device=device) for m in [0, *step_lengths]])  # [R]
    seq_start = _row_starts(lengths, step_lengths, device)  # [R]
    seq_len = torch.tensor(lengths, device=device, dtype=torch.long).repeat_interleave(counts)  # [R]
    read = seq_start + local + k
    in_range = local + k + 1 < seq_len
    next_index = torch.where(in_range, read + 1, torch.zeros_like(read))
    counted = in_range & loss_mask[next_index].bool()
    return _StepRows(step_lengths, local, read, counted)


def unrolled_losses(
    head: torch.nn.Module,
    token_ids: torch.Tensor,  # [T] packed sequences
    target_hidden: torch.Tensor,  # [T, d] H (post-norm final states of the target)
    loss_mask: torch.Tensor,  # [T] 1 where the token is an assistant token
    lengths: list[int],  # tokens per packed sequence (sum = T)
    unroll_steps: int = 2,
    step_weight_decay: float = 0.8,
    feature_weight: float = 0.1,
    kl_weight: float = 1.0,
    chunk_size: int | None = 1024,
    feature_beta: float = 1.0,
    target_argmax: torch.Tensor | None = None,  # [T] the cache's argmax of lm_head(H_t), if stored
    first_inputs: torch.Tensor | None = None,  # [T, w] what step 1 reads at each position (default: target_hidden)
    input_noise: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | int]]:
    """Total loss Σ_k w_k (feature_weight · feature_k + kl_weight · kl_k), w_k = step_weight_decay^(k-1); metrics.

    Within each sequence (length n, no attention across sequences), step k has rows i = 0 .. n-1-k: row i reads
    (step-(k-1) output of row i, or H_i for k = 1; token t_{i+k}) at position i+k-1, is trained towards H_{i+k} and
    p(. | H_{i+k}), and counts where i+k+1 < n and loss_mask[i+k+1] == 1 (the token it helps predict, t_{i+k+1},
    is an assistant token). `head` is called as `head(token_ids, hidden, batch)` and must expose `lm_head_weight`;
    the losses read `head.readout(out)` when the head has one (an eagle3 head's final norm; its raw output is what the
    next step reads). `first_inputs` replaces H_i as step 1's input (an eagle3 head: the target's aux layer states
    [T, 3d], which it fuses itself); the targets stay H. `input_noise` σ > 0 adds σ · rms(row) · N(0, 1) to what step 1
    reads (torch's global generator: the trainer seeds it and checkpoints its state).

    Metrics (detached 0-dim tensors, left on the device; `rows` are ints): `loss`, and per step k `step{k}/feature`,
    `/kl`, `/top1`, `/top3`, `/alpha`, `/coverage` (means over counted rows), `/rows`. A head with a reduced draft
    vocabulary exposes `draft_ids` ([N] target ids): its KL is restricted to it (see `distill_sums`); with
    `target_argmax` (stored by precompute) it is computed without full-vocabulary logits.
    """
    if sum(lengths) != token_ids.shape[0] or any(n < 0 for n in lengths):
        raise ValueError(f"lengths {lengths} do not partition the {token_ids.shape[0]} packed tokens")
    device = token_ids.device
    total: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor | int | float] = {}
    flops = 0.0
    previous_out: torch.Tensor | None = None  # [R_{k-1}, d]
    readout = getattr(head, "readout", None) or (lambda out: out)  # a DeepSpeed engine passes it on from the head
    previous_lengths: list[int] = []
    for k in range(1, unroll_steps + 1):
        rows = _step_rows(lengths, loss_mask, k)
        if rows.local.numel() == 0:
            break
        if previous_out is None:
            hidden = (target_hidden if first_inputs is None else first_inputs)[rows.read - k]  # [R, w] H_i
            if input_noise:
                states = hidden.float()  # [R, w]
                rms = states.pow(2).mean(-1, keepdim=True).sqrt()  # [R, 1]
                hidden = (states + input_noise * rms * torch.randn_like(states)).to(hidden.dtype)
        else:  # row i of each sequence at step k-1 is also row i at step k (the last row drops out)
            hidden = previous_out[_row_starts(previous_lengths, rows.lengths, device) + rows.local]  # [R, d]
        # A packed no-cache batch over the sequences that still have rows, at the rows' rotary positions.
        batch = BatchInfo.without_cache([m for m in rows.lengths if m > 0], device)
        batch.positions = rows.local + (k - 1)
        out = head(token_ids[rows.read], hidden, batch)  # [R, d]
        losses = step_losses(
            readout(out), target_hidden[rows.read], rows.counted, head.lm_head_weight, chunk_size, feature_beta,
            getattr(head, "draft_ids", None), None if target_argmax is None else target_argmax[rows.read],
        )
        step_loss = step_weight_decay ** (k - 1) * (feature_weight * losses.feature + kl_weight * losses.kl)
        total = step_loss if total is None else total + step_loss
        metrics.update(losses.metrics(k))
        flops += _step_flops(head, rows.lengths, losses.rows, target_argmax is not None)
        previous_out, previous_lengths = out, rows.lengths
    if total is None:  # every sequence shorter than 2 tokens: nothing to learn
        total = torch.zeros((), device=device, requires_grad=True)
    metrics["loss"] = total.detach()
    metrics["flops"] = flops
    return total, metrics


def _step_flops(head, step_lengths: list[int], counted_rows: int, argmax_known: bool) -> float:
    """Matmul FLOPs (2 per multiply-add) of one unroll step, forward and backward: the head's linear layers over every
    row (×3: forward, input and weight gradients), causal attention over each sequence (×3), and over the counted rows
    the draft logits, the target logits (draft rows only when the argmax is stored) and the logit gradient (q − p) @ W;
    what a fraction of the matmul peak is computed from."""
    module = getattr(head, "module", head)  # a DeepSpeed engine wraps the head
    if not hasattr(module, "config") or not hasattr(module, "layers"):
        return 0.0  # not a DraftHead (a test double): no FLOP count
    linear_params = sum(p.numel() for p in module.parameters() if p.dim() == 2)
    rows = sum(step_lengths)
    pairs = sum(n * (n + 1) // 2 for n in step_lengths)
    config = module.config
    attention = 4 * config.num_attention_heads * config.head_dim * pairs * len(module.layers)
    d = config.hidden_size
    draft_rows = module.draft_vocab_size
    target_rows = draft_rows if argmax_known else config.vocab_size
    logits = 2 * counted_rows * d * (2 * draft_rows + target_rows)
    return float(3 * (2 * linear_params * rows + attention) + logits)
