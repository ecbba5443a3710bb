"""The speculative-decoding rejection sampler (Leviathan et al. 2023; Chen et al. 2023), per sequence and for a batch
of chains at once.

Given k draft tokens `d_1..d_k`, the draft distributions `q_j` they were sampled from and the target distributions
`p_0..p_k` at the same positions (`p_j` predicts the token after `d_j`, `p_0` the one after the last committed
token), all after the same temperature / top-k / top-p processing (`sampler.processed_probs`):

- draft j is accepted with probability `min(1, p_{j-1}(d_j) / q_j(d_j))`, in order;
- on the first rejection, one token is sampled from `norm(max(0, p_{j-1} - q_j))` and the step ends;
- if all k are accepted, a bonus token is sampled from `p_k`.

The emitted tokens are then distributed exactly as if sampled from the target one by one (the method is lossless).
Greedy mode is the deterministic special case: accept while the draft equals `argmax p`, then emit the argmax.

Indexing in code is 0-based: `draft_token_ids[j]` is checked against `target_probs[j]`, and `target_probs[k]` is the
bonus distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_train.runtime.host_sync import to_device

# Below this total mass the residual max(0, p - q) is rounding noise (p == q up to float error); sample from p.
_RESIDUAL_EPS = 1e-8


@dataclass(frozen=True)
class RejectionResult:
    accepted_len: int  # how many leading draft tokens were accepted (0..k)
    token_ids: list[int]  # accepted drafts + one corrected (on rejection) or bonus (all accepted) token: length a+1
    drafted: tuple[int, ...] = ()  # every draft token, read back with the verdict (batched verdicts only)

    @property
    def path(self) -> list[int]:
        """The accepted drafts as verify nodes (1..a), as a tree's verdict names them."""
        return list(range(1, self.accepted_len + 1))


def greedy_accept(draft_token_ids: torch.Tensor, target_argmax: torch.Tensor) -> RejectionResult:
    """Greedy verification. `draft_token_ids`: [k]; `target_argmax`: [k+1], the target's argmax at each position.
    Accepts the longest prefix where the draft equals the target's choice, then emits the target's next choice."""
    k = int(draft_token_ids.shape[0])
    if target_argmax.shape[0] != k + 1:
        raise ValueError(f"expected {k + 1} target positions for {k} drafts, got {target_argmax.shape[0]}")
    drafts = draft_token_ids.tolist()
    choices = target_argmax.tolist()
    accepted_len = 0
    while accepted_len < k and drafts[accepted_len] == choices[accepted_len]:
        accepted_len += 1
    return RejectionResult(accepted_len, drafts[:accepted_len] + [choices[accepted_len]])


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [k] int64, sampled from draft_probs
    draft_probs: torch.Tensor | None,  # [k, vocab] fp32 (None only when greedy)
    target_probs: torch.Tensor,  # [k + 1, vocab] fp32
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> RejectionResult:
    """Verify one sequence's drafts against the target; see the module docstring. With `greedy=True` no random numbers
    are drawn and `draft_probs` is ignored (the target's argmax decides). A draft whose draft probability is 0 (it
    cannot have been sampled from `q`, e.g. float underflow) is accepted iff the target gives it positive
    probability; a token the target gives probability 0 is never emitted."""
    k = int(draft_token_ids.shape[0])
    if target_probs.shape[0] != k + 1:
        shape = tuple(target_probs.shape)
        raise ValueError(f"expected target_probs of shape [{k + 1}, vocab] for {k} drafts, got {shape}")
    if greedy:
        return greedy_accept(draft_token_ids, target_probs.argmax(-1))
    if draft_probs is None or draft_probs.shape != (k, target_probs.shape[1]):
        shape = None if draft_probs is None else tuple(draft_probs.shape)
        raise ValueError(f"expected draft_probs of shape [{k}, {target_probs.shape[1]}], got {shape}")

    target_probs = target_probs.float()
    draft_probs = draft_probs.float()
    positions = torch.arange(k, device=target_probs.device)
    target_p = target_probs[positions, draft_token_ids]  # [k]: p_j(d_j)
    draft_q = draft_probs[positions, draft_token_ids]  # [k]: q_j(d_j)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device)  # [k]
    # u < p/q without dividing: q = 0 accepts iff p > 0; p = 0 never accepts (strict inequality).
    accepted = (uniforms * draft_q < target_p).tolist()
    accepted_len = accepted.index(False) if False in accepted else k

    drafts = draft_token_ids.tolist()[:accepted_len]
    if accepted_len == k:
        next_probs = target_probs[k]  # bonus token
    else:
        residual = (target_probs[accepted_len] - draft_probs[accepted_len]).clamp_(min=0)  # [vocab]
        mass = residual.sum()
        next_probs = residual / mass if mass > _RESIDUAL_EPS else target_probs[accepted_len]
    next_token = int(torch.multinomial(next_probs, 1, generator=generator))
    return RejectionResult(accepted_len, drafts + [next_token])


# ---- a batch of chains at once (the speculative step) --------------------------------------------------------------
#
# The step verifies every sequence's chain in one target forward over the flat rows [T] (sequence b: its root, then
# its k_b drafts; `verify_lens[b]` = k_b + 1). The verdicts of all sequences are computed on the device and read back
# in ONE transfer, the only time the step waits for the device.


def _chain_layout(verify_lens: list[int]) -> tuple[list[int], int, list[list[int]], list[list[bool]]]:
    """Host-built gather layout of a batch of chains: (each sequence's first row, K = the most drafts, per sequence
    the flat row of each padded position 0..K (its root and drafts, then its last row repeated), and whether
    position j < K is one of its drafts)."""
    starts, start = [], 0
    for n in verify_lens:
        starts.append(start)
        start += n
    most = max(verify_lens, default=1) - 1
    rows = [[s + min(j, n - 1) for j in range(most + 1)] for s, n in zip(starts, verify_lens)]
    drafted = [[j < n - 1 for j in range(most)] for n in verify_lens]
    return starts, most, rows, drafted


def greedy_accept_chains(input_ids: torch.Tensor, target_argmax: torch.Tensor, verify_lens: list[int]
                         ) -> list[RejectionResult]:
    """`greedy_accept` for every sequence of a verify batch, with one device→host transfer. `input_ids` [T]: each
    sequence's root then drafts; `target_argmax` [T]: the target's argmax at each of those rows. A draft is accepted
    while it equals the argmax of the row before it; the emitted tokens are then the argmax of the root and of each
    accepted draft's row (an accepted draft IS the argmax before it)."""
    starts, most, rows, drafted = _chain_layout(verify_lens)
    device = target_argmax.device
    if most == 0:
        accepted_len = torch.zeros(len(verify_lens), dtype=torch.long, device=device)
    else:
        # matches[i]: row i's argmax equals the next row's input (row i + 1's draft); a padded position reads False
        matches = torch.cat([target_argmax[:-1] == input_ids[1:], target_argmax.new_zeros(1, dtype=torch.bool)])
        no_match = matches.shape[0] - 1
        index = [[r if ok else no_match for r, ok in zip(seq_rows[:most], seq_drafted)]
                 for seq_rows, seq_drafted in zip(rows, drafted)]
        accepted = matches[to_device(index, torch.long, device)]  # [B, K]
        accepted_len = accepted.long().cumprod(1).sum(1)  # [B]: leading run of accepted drafts
    batch_size = len(verify_lens)
    host = torch.cat([accepted_len, target_argmax.long(), input_ids.long()]).tolist()  # the step's one transfer
    num_rows = input_ids.shape[0]
    lengths, choices, ids = host[:batch_size], host[batch_size : batch_size + num_rows], host[batch_size + num_rows :]
    return [RejectionResult(a, choices[s : s + a + 1], tuple(ids[s + 1 : s + n]))
            for a, s, n in zip(lengths, starts, verify_lens)]


def rejection_sample_chains(
    input_ids: torch.Tensor,  # [T] int64: each sequence's root, then its drafts
    draft_probs: list[torch.Tensor],  # per sequence [k_b, vocab] fp32: what its drafts were sampled from
    target_probs: torch.Tensor,  # [T, vocab] fp32: the target's distribution at each row
    verify_lens: list[int],  # k_b + 1 per sequence
    generator: torch.Generator | None = None,
) -> list[RejectionResult]:
    """`rejection_sample` for every sequence of a verify batch, with one device→host transfer: one uniform per draft
    and the accept tests of all sequences in one batch, then the corrected (or bonus) token of every sequence from
    one batched draw. The same rule per sequence as `rejection_sample`, so the emitted tokens are distributed as the
    target's own samples (the random stream is consumed in another order, so a seed gives other samples)."""
    starts, most, rows, drafted = _chain_layout(verify_lens)
    device, vocab = target_probs.device, target_probs.shape[-1]
    batch_size = len(verify_lens)
    for b, (n, q) in enumerate(zip(verify_lens, draft_probs)):
        if q.shape != (n - 1, vocab):
            raise ValueError(f"sequence {b}: expected draft_probs of shape [{n - 1}, {vocab}], got {tuple(q.shape)}")
    target_probs = target_probs.float()
    row_index = to_device(rows, torch.long, device)  # [B, K + 1]
    p = target_probs[row_index]  # [B, K + 1, vocab]: p_j, padded with the sequence's last row
    # q_j [B, K + 1, vocab], zero past a sequence's drafts (the bonus position: residual max(0, p - 0) = p)
    q = torch.stack([torch.cat([probs.float(), probs.new_zeros(most + 1 - probs.shape[0], vocab)])
                     for probs in draft_probs])
    num_drafts = to_device([n - 1 for n in verify_lens], torch.long, device)  # [B]
    if most > 0:
        draft_tokens = input_ids[row_index[:, 1:]]  # [B, K] (padding: the last row's token, never accepted)
        target_p = p[:, :-1].gather(-1, draft_tokens[..., None])[..., 0]  # [B, K]: p_j(d_j)
        draft_q = q[:, :-1].gather(-1, draft_tokens[..., None])[..., 0]  # [B, K]: q_j(d_j)
        uniforms = torch.rand(batch_size, most, generator=generator, device=device)  # [B, K]
        # u < p/q without dividing: q = 0 accepts iff p > 0; p = 0 never accepts (strict inequality).
        accepted = (uniforms * draft_q < target_p) & to_device(drafted, torch.bool, device)
        accepted_len = accepted.long().cumprod(1).sum(1)  # [B]
    else:
        accepted_len = torch.zeros(batch_size, dtype=torch.long, device=device)
    at = torch.arange(batch_size, device=device)
    p_next, q_next = p[at, accepted_len], q[at, accepted_len]  # [B, vocab]
    residual = (p_next - q_next).clamp_(min=0)
    mass = residual.sum(-1, keepdim=True)  # [B, 1]
    from_p = (accepted_len == num_drafts)[:, None] | (mass <= _RESIDUAL_EPS)  # the bonus, or p == q up to rounding
    next_probs = torch.where(from_p, p_next, residual / mass.clamp(min=_RESIDUAL_EPS))
    next_token = torch.multinomial(next_probs, 1, generator=generator)[:, 0]  # [B]
    host = torch.cat([accepted_len, next_token, input_ids.long()]).tolist()  # the step's one transfer
    lengths, tokens, ids = host[:batch_size], host[batch_size : 2 * batch_size], host[2 * batch_size :]
    return [RejectionResult(a, ids[s + 1 : s + 1 + a] + [t], tuple(ids[s + 1 : s + n]))
            for a, t, s, n in zip(lengths, tokens, starts, verify_lens)]


# ---- draft trees (runtime/spec/tree.py) ---------------------------------------------------------------------------
#
# A tree of n + 1 nodes: node 0 is the root (the last committed token), node i > 0 a draft token whose parent is an
# earlier node; `children[u]` lists u's children in the order they are tested. `target_probs[u]` predicts the token
# after node u (the target's verify row of node u).


@dataclass(frozen=True)
class TreeRejectionResult:
    path: list[int]  # the accepted nodes, root excluded, root to leaf (their number is the accepted length)
    token_ids: list[int]  # their tokens + one corrected (on rejection) or bonus (after a leaf) token


def greedy_accept_tree(node_tokens: list[int], children: list[list[int]], target_argmax: list[int]
                       ) -> TreeRejectionResult:
    """Greedy tree verification: from the root, follow the child whose token is the target's argmax while there is
    one; then emit the target's argmax at the last accepted node (the longest path of argmax tokens + the bonus)."""
    node, path = 0, []
    while True:
        choice = target_argmax[node]
        nxt = next((c for c in children[node] if node_tokens[c] == choice), None)
        if nxt is None:
            return TreeRejectionResult(path, [node_tokens[c] for c in path] + [choice])
        path.append(nxt)
        node = nxt


def tree_rejection_sample(
    node_tokens: list[int],
    children: list[list[int]],
    candidate_probs: dict[int, torch.Tensor],  # node u -> [len(children[u]), vocab]: what each child was drawn from
    target_probs: torch.Tensor,  # [n + 1, vocab] fp32
    generator: torch.Generator | None = None,
) -> TreeRejectionResult:
    """Multi-candidate recursive rejection sampling over the siblings (SpecInfer; Jeon et al. 2024, recursive
    speculative decoding). At node u with target distribution p, its children x_1..x_m are tested in order: x_i,
    drawn from q_i (`candidate_probs[u][i]`, the draft distribution given the earlier siblings: q with x_1..x_{i-1}
    removed and renormalized for sampling without replacement, one-hot for a deterministic candidate), is accepted
    with probability min(1, p(x_i) / q_i(x_i)); on rejection p becomes norm(max(0, p - q_i)) and the next sibling is
    tried. An accepted child becomes u (its own target row is the new p); when every child is rejected one token is
    sampled from the last p, after a leaf the bonus from p. Each step is the chain's lossless rule with draft q_i, so
    the emitted tokens are distributed as the target's own samples, provided each candidate was drawn from its q_i
    and the number of children of a node does not depend on the values drawn for those children."""
    node, path = 0, []
    while True:
        p = target_probs[node].float()
        accepted = None
        for i, child in enumerate(children[node]):
            q = candidate_probs[node][i].float()
            token = node_tokens[child]
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * float(q[token]) < float(p[token]):  # u < p/q without dividing (q = 0: accept iff p > 0)
                accepted = child
                break
            residual = (p - q).clamp_(min=0)
            mass = residual.sum()
            p = residual / mass if mass > _RESIDUAL_EPS else p
        if accepted is None:
            next_token = int(torch.multinomial(p, 1, generator=generator))
            return TreeRejectionResult(path, [node_tokens[c] for c in path] + [next_token])
        path.append(accepted)
        node = accepted
