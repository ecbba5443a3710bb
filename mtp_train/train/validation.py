"""Held-out validation of a head through the inference implementation.

Step 1 runs the head exactly as the speculative engine does: through a paged KV cache (`BatchInfo.for_sequences`,
the runtime's attention backend), over every held-out sample's rows (H_i, t_{i+1}); its logits are compared with
the target's next-token distribution recomputed from H_{i+1}. Steps 2..k (the head fed its own outputs) come from
the training unroll under no_grad. Metrics are means over the counted rows (loss positions).
"""

from __future__ import annotations

import torch

from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.train.losses import add_sums, metric_means, metric_sums, step_losses, unrolled_losses


def first_step_inputs(batch, device: torch.device) -> torch.Tensor | None:
    """What a head's first step reads besides H: an eagle3 head's aux layer states [T, n_aux * d] (the reader gave
    exactly the head's layers, in its order), or None (mtp/eagle1: H itself)."""
    if batch.aux_hidden is None:
        return None
    return batch.aux_hidden.flatten(1).to(device)


@torch.no_grad()
def validate(head, reader, loss_kwargs: dict, device: torch.device, page_size: int = 16) -> dict[str, float | int]:
    """`step{k}/<name>` means over the held-out split (train/losses.py STEP_METRICS, the same meaning as in
    training) and `step{k}/rows`."""
    was_training = head.training
    head.eval()
    sums: dict[str, float] = {}
    for positions in reader.epoch_batches(0):
        batch = reader.load(positions)
        token_ids, hidden = batch.input_ids.to(device), batch.hidden.to(device)
        loss_mask = batch.loss_mask.to(device)
        # With the cache's stored argmax, validation computes the same quantities as training does (target logits
        # over the draft vocabulary only, α within it): the same meaning under the same name, and no full-vocabulary
        # logits (those made validation cost as much as ~10 training steps).
        target_argmax = None if batch.target_argmax is None else batch.target_argmax.to(device)
        first_inputs = first_step_inputs(batch, device)  # eagle3: the aux layer states; else None (H)
        inputs = hidden if first_inputs is None else first_inputs
        # Step 1 through the paged draft path: rows i = 0..n-2 of each sample read (H_i, t_{i+1}).
        row_counts = [n - 1 for n in batch.lengths if n >= 2]
        starts = torch.tensor([0, *batch.lengths[:-1]], device=device).cumsum(0)
        read = torch.cat([torch.arange(1, n, device=device) + s for n, s in zip(batch.lengths, starts.tolist()) if n >= 2])
        counted = torch.cat([
            torch.cat([loss_mask[s + 2 : s + n].bool(), torch.zeros(1, dtype=torch.bool, device=device)])
            for n, s in zip(batch.lengths, starts.tolist()) if n >= 2
        ])
        allocator = PageAllocator(sum(-(-c // page_size) for c in row_counts), page_size)
        cache = head.new_kv_cache(allocator)
        sequences = [Sequence(i) for i in range(len(row_counts))]
        info = BatchInfo.for_sequences(sequences, row_counts, allocator, device)
        out = head(token_ids[read], inputs[read - 1], info, kv_cache=cache)  # [R, d]
        step1 = step_losses(
            head.readout(out), hidden[read], counted, head.lm_head_weight, loss_kwargs.get("chunk_size"),
            draft_ids=getattr(head, "draft_ids", None), target_top=None if target_argmax is None else target_argmax[read],
        )
        for seq in sequences:
            seq.release(allocator)
        add_sums(sums, metric_sums(step1.metrics(1)))
        # Steps 2..k from the unroll (training forward, no cache).
        if loss_kwargs.get("unroll_steps", 1) > 1:
            _, metrics = unrolled_losses(head, token_ids, hidden, loss_mask, batch.lengths, **loss_kwargs,
                                         target_argmax=target_argmax, first_inputs=first_inputs)
            later = {key: value for key, value in metrics.items() if key.startswith("step") and not key.startswith("step1/")}
            add_sums(sums, metric_sums(later))
    head.train(was_training)
    return metric_means(sums)
