"""Losses: chunked distillation == full-logits reference, metrics, masking, unroll indexing, packing isolation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.heads import DraftHead, HeadConfig
from mtp_train.runtime.config import ModelConfig
from mtp_train.runtime.model import CausalLM
from mtp_train.train.losses import distill_sums, step_losses, unrolled_losses

VOCAB, D = 50, 16


@pytest.fixture
def lm_head_weight():
    return torch.randn(VOCAB, D, generator=torch.Generator().manual_seed(0))


def rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 20, 64])
def test_chunked_equals_full_logits(lm_head_weight, chunk_size):
    target = rand(20, D, seed=2)
    results, grads = [], []
    for chunk in (None, chunk_size):
        out = rand(20, D, seed=3).requires_grad_(True)
        sums = distill_sums(out, target, lm_head_weight, chunk_size=chunk)
        (2.5 * sums.kl).backward()
        results.append(sums)
        grads.append(out.grad)
    full, chunked = results
    assert torch.allclose(full.kl, chunked.kl, atol=1e-5, rtol=1e-6)
    assert torch.allclose(grads[0], grads[1], atol=1e-5)
    assert full.top1 == chunked.top1 and full.top3 == chunked.top3
    assert torch.allclose(full.alpha, chunked.alpha, atol=1e-5)
    # The metrics themselves, from explicit probabilities.
    p, q = F.softmax(target @ lm_head_weight.T, -1), F.softmax(rand(20, D, seed=3) @ lm_head_weight.T, -1)
    assert torch.allclose(chunked.kl, (p * (p.log() - q.log())).sum(), atol=1e-4)
    assert torch.allclose(chunked.alpha, torch.minimum(p, q).sum(), atol=1e-5)
    assert chunked.top1 == (p.argmax(-1) == q.argmax(-1)).sum()
    assert chunked.top3 == (q.topk(3, -1).indices == p.argmax(-1, keepdim=True)).any(-1).sum()
    assert chunked.top1 <= chunked.top3
    with torch.no_grad():  # evaluation: no gradient buffer, same values
        assert torch.equal(distill_sums(rand(20, D, seed=3), target, lm_head_weight, chunk_size).kl, chunked.kl)


def test_no_gradient_into_lm_head(lm_head_weight):
    weight = lm_head_weight.clone().requires_grad_(True)
    out = rand(6, D).requires_grad_(True)
    distill_sums(out, rand(6, D, seed=4), weight, chunk_size=4).kl.backward()
    assert weight.grad is None and out.grad is not None


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_identical_states_give_zero_kl_and_full_acceptance(lm_head_weight, chunk_size):
    target = rand(9, D)
    out = target.clone().requires_grad_(True)
    losses = step_losses(out, target, torch.ones(9, dtype=torch.bool), lm_head_weight, chunk_size)
    assert abs(losses.kl.item()) < 1e-6 and losses.feature.item() == 0.0
    assert losses.top1.item() == 1.0 and losses.top3.item() == 1.0
    assert abs(losses.alpha.item() - 1.0) < 1e-5
    assert losses.rows == 9


def test_masked_rows_contribute_nothing(lm_head_weight):
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    target = rand(8, D, seed=5)
    out = rand(8, D, seed=6).requires_grad_(True)
    base = step_losses(out, target, mask, lm_head_weight, chunk_size=3)
    (base.kl + base.feature).backward()
    assert torch.equal(out.grad[~mask], torch.zeros(3, D)) and out.grad[mask].abs().sum() > 0
    changed_out, changed_target = out.detach().clone(), target.clone()
    changed_out[~mask] += 100.0
    changed_target[~mask] = rand(3, D, seed=7)
    changed = step_losses(changed_out, changed_target, mask, lm_head_weight, chunk_size=3)
    for name in ("feature", "kl", "top1", "top3", "alpha"):
        assert torch.equal(getattr(changed, name), getattr(base, name)), name
    assert base.rows == 5
    # Means over counted rows: the same as computing on the counted rows alone.
    alone = step_losses(out.detach()[mask], target[mask], torch.ones(5, dtype=torch.bool), lm_head_weight, None)
    assert torch.allclose(alone.kl, base.kl, atol=1e-6) and torch.allclose(alone.feature, base.feature)


class IdentityHead(nn.Module):
    """Returns its input hidden state unchanged and records what each call read."""

    def __init__(self, lm_head_weight: torch.Tensor):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.lm_head_weight = lm_head_weight
        self.calls: list[dict] = []

    def forward(self, token_ids, hidden, batch):
        self.calls.append(
            dict(
                tokens=token_ids.tolist(),
                hidden=hidden[:, 0].tolist(),  # every H_i is a constant vector: its first entry names it
                positions=batch.positions.tolist(),
                q_lens=batch.q_lens,
            )
        )
        return hidden * self.scale


def test_unroll_indexing_by_hand(lm_head_weight):
    """Two packed sequences (lengths 5 and 4). H_i is the constant vector c_i, so with an identity head the feature
    loss of a row is smooth_l1(c_read - c_target) and shows which target rows are compared."""
    lengths = [5, 4]
    tokens = torch.tensor([10, 11, 12, 13, 14, 20, 21, 22, 23])
    c = torch.tensor([0.0, 0.5, 2.5, 3.0, 7.0, 100.0, 100.25, 101.0, 104.0])
    hidden = c[:, None].expand(9, D).contiguous()
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 0, 1])
    head = IdentityHead(lm_head_weight)
    weights = dict(step_weight_decay=0.5, feature_weight=1.0, kl_weight=0.0)
    total, metrics = unrolled_losses(head, tokens, hidden, loss_mask, lengths, unroll_steps=3, **weights)

    step1, step2, step3 = head.calls
    # Step 1: row i reads (H_i, t_{i+1}) at position i; n-1 rows per sequence.
    assert step1 == dict(
        tokens=[11, 12, 13, 14, 21, 22, 23],
        hidden=[0.0, 0.5, 2.5, 3.0, 100.0, 100.25, 101.0],
        positions=[0, 1, 2, 3, 0, 1, 2],
        q_lens=[4, 3],
    )
    # Step 2: row i reads (its step-1 output, t_{i+2}) at position i+1; n-2 rows per sequence.
    assert step2 == dict(
        tokens=[12, 13, 14, 22, 23], hidden=[0.0, 0.5, 2.5, 100.0, 100.25], positions=[1, 2, 3, 1, 2], q_lens=[3, 2]
    )
    assert step3 == dict(tokens=[13, 14, 23], hidden=[0.0, 0.5, 100.0], positions=[2, 3, 2], q_lens=[2, 1])

    def sl1(x: float) -> float:
        return 0.5 * x * x if abs(x) < 1 else abs(x) - 0.5

    # Step 1, seq A: row i compares c_i with c_{i+1}, counted if mask[i+2] (i+2 < 5): rows 0, 1, 2.
    # seq B: rows 0 (mask[2] = 0 -> no), 1 (mask[3] = 1 -> yes); row 2 has i+2 = 4 = n -> no.
    expected1 = [sl1(0.0 - 0.5), sl1(0.5 - 2.5), sl1(2.5 - 3.0), sl1(100.25 - 101.0)]
    # Step 2 compares c_i with c_{i+2}, counted if mask[i+3], i+3 < n: A rows 0, 1; B row 0 (mask[3] = 1).
    expected2 = [sl1(0.0 - 2.5), sl1(0.5 - 3.0), sl1(100.0 - 101.0)]
    # Step 3 compares c_i with c_{i+3}, counted if mask[i+4], i+4 < n: A row 0 only.
    expected3 = [sl1(0.0 - 3.0)]
    for k, expected in enumerate((expected1, expected2, expected3), start=1):
        assert metrics[f"step{k}/rows"] == len(expected)
        assert metrics[f"step{k}/feature"].item() == pytest.approx(sum(expected) / len(expected))
    want = sum(0.5 ** (k - 1) * sum(e) / len(e) for k, e in enumerate((expected1, expected2, expected3), start=1))
    assert total.item() == pytest.approx(want)
    total.backward()
    assert head.scale.grad is not None


def tiny_target(sliding_window: int | None = None) -> CausalLM:
    config = ModelConfig(
        model_type="mistral" if sliding_window else "llama",
        sliding_window=sliding_window, vocab_size=VOCAB, hidden_size=D, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6, max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    target = CausalLM(config)
    for p in target.parameters():
        nn.init.normal_(p, std=0.3)
    return target.requires_grad_(False)


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_packed_sequences_do_not_leak(sliding_window):
    """Sequence A's losses at every step are the same whether B is packed next to it (with any content, masked
    out) or A runs alone; so nothing crosses sequence boundaries through attention or the unroll indexing."""
    target = tiny_target(sliding_window)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, init="random"))
    gen = torch.Generator().manual_seed(3)
    len_a, len_b = 9, 7
    tokens_a, hidden_a = torch.randint(0, VOCAB, (len_a,), generator=gen), torch.randn(len_a, D, generator=gen)
    mask_a = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 1])
    kwargs = dict(unroll_steps=3, step_weight_decay=0.8, feature_weight=0.3, kl_weight=1.0, chunk_size=4)
    _, alone = unrolled_losses(head, tokens_a, hidden_a, mask_a, [len_a], **kwargs)
    for seed in (4, 5):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.cat([tokens_a, torch.randint(0, VOCAB, (len_b,), generator=g)])
        hidden = torch.cat([hidden_a, torch.randn(len_b, D, generator=g)])
        mask = torch.cat([mask_a, torch.zeros(len_b, dtype=torch.long)])
        _, packed = unrolled_losses(head, tokens, hidden, mask, [len_a, len_b], **kwargs)
        for key, value in alone.items():
            if key == "flops":  # a cost figure: B's rows cost FLOPs too
                assert packed[key] > value
            elif key.endswith("/rows"):
                assert packed[key] == value, key
            else:
                assert torch.allclose(packed[key], value, atol=1e-6), key


def test_unrolled_losses_chunked_equals_full_and_trains():
    target = tiny_target()
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="eagle1", init="random"))
    gen = torch.Generator().manual_seed(6)
    lengths = [8, 1, 6]
    tokens, hidden = torch.randint(0, VOCAB, (15,), generator=gen), torch.randn(15, D, generator=gen)
    mask = torch.ones(15, dtype=torch.long)
    grads = []
    for chunk in (None, 5):
        head.zero_grad()
        total, metrics = unrolled_losses(head, tokens, hidden, mask, lengths, unroll_steps=2, chunk_size=chunk)
        total.backward()
        grads.append(torch.cat([p.grad.flatten() for p in head.parameters()]))
        assert metrics["step1/rows"] == 10 and metrics["step2/rows"] == 8  # (8-2) + 0 + (6-2), then (8-3) + (6-3)
    assert torch.allclose(grads[0], grads[1], atol=1e-5) and grads[0].abs().sum() > 0


def test_loss_rows_all_counts_the_user_turns_rows_too():
    """`train.loss_rows`: "assistant" counts the rows whose next token is an assistant token, "all" every row in range
    (the user and system turns of the same cached features)."""
    from mtp_train.train.trainer import counted_rows

    target = tiny_target()
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, init="random"))
    lengths = [8, 6]
    tokens, hidden = torch.randint(0, VOCAB, (14,)), torch.randn(14, D)
    assistant = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1], dtype=torch.uint8)
    rows = {}
    for loss_rows in ("assistant", "all"):
        mask = counted_rows(assistant, loss_rows)
        _, metrics = unrolled_losses(head, tokens, hidden, mask, lengths, unroll_steps=1, chunk_size=4)
        rows[loss_rows] = metrics["step1/rows"]
    # Step 1, row i reads position i and counts when token i+2 exists (and is an assistant token).
    assert rows == {"assistant": 4 + 3, "all": (8 - 2) + (6 - 2)}
    assert torch.equal(counted_rows(assistant, "assistant"), assistant)


def test_unrolled_losses_count_their_matmul_flops():
    """metrics["flops"]: per unroll step, the head's linear layers and attention forward and backward (×3) over every
    row, and draft logits, target logits and the logit gradient over the counted rows; 0 for a head that is not a
    DraftHead."""
    target = tiny_target()
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, init="random"))
    lengths = [8, 6]
    tokens, hidden = torch.randint(0, VOCAB, (14,)), torch.randn(14, D)
    mask = torch.ones(14, dtype=torch.long)
    _, metrics = unrolled_losses(head, tokens, hidden, mask, lengths, unroll_steps=2, chunk_size=4)
    linear = sum(p.numel() for p in head.parameters() if p.dim() == 2)
    config = target.config
    expected = 0.0
    for k in (1, 2):
        step_lengths = [n - k for n in lengths]
        pairs = sum(n * (n + 1) // 2 for n in step_lengths)
        attention = 4 * config.num_attention_heads * config.head_dim * pairs * len(head.layers)
        counted = metrics[f"step{k}/rows"]
        expected += 3 * (2 * linear * sum(step_lengths) + attention) + 2 * counted * D * 3 * VOCAB
    assert metrics["flops"] == pytest.approx(expected)


def test_metric_sums_combine_batches_with_one_meaning_per_name():
    """Training and validation combine micro-batches, batches and ranks through the same sums: the KL is a mean over
    the rows inside the draft vocabulary, every other metric over all counted rows, whatever the batch split."""
    from mtp_train.train.losses import STEP_METRICS, add_sums, metric_means, metric_sums

    def batch(rows, inside, kl_sum, top1_sum):
        means = {f"step1/{name}": torch.tensor(0.5) for name in STEP_METRICS}
        means["step1/kl"] = torch.tensor(kl_sum / inside)
        means["step1/top1"] = torch.tensor(top1_sum / rows)
        means["step1/coverage"] = torch.tensor(inside / rows)
        means["step1/rows"] = rows
        means["step1/inside"] = inside
        return means

    total = add_sums({}, metric_sums(batch(rows=10, inside=5, kl_sum=10.0, top1_sum=4.0)))
    add_sums(total, metric_sums(batch(rows=30, inside=30, kl_sum=30.0, top1_sum=6.0)))
    means = metric_means(total)
    assert means["step1/rows"] == 40
    assert means["step1/kl"] == pytest.approx(40.0 / 35)  # Σ KL / Σ inside rows, not a row-weighted mean of means
    assert means["step1/top1"] == pytest.approx(10.0 / 40)
    assert means["step1/coverage"] == pytest.approx(35 / 40)
    empty = metric_means(metric_sums({**{f"step2/{n}": torch.tensor(0.0) for n in STEP_METRICS}, "step2/rows": 0,
                                     "step2/inside": 0}))
    assert empty["step2/rows"] == 0 and math.isnan(empty["step2/kl"])
