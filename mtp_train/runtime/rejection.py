"""The speculative-decoding rejection sampler (Leviathan et al. 2023; Chen et al. 2023) for a batch of chains, and its
multi-candidate form for a batch of draft trees; each reads the batch's verdicts back in one device→host transfer.

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
from typing import Callable

import torch

from mtp_train.runtime.host_sync import to_device

# Below this total mass the residual max(0, p - q) is rounding noise (p == q up to float error); sample from p.
_RESIDUAL_EPS = 1e-8


@dataclass(frozen=True)
class RejectionResult:
    accepted_len: int  # how many leading draft tokens were accepted (0..k)
    token_ids: list[int]  # accepted drafts + one corrected (on rejection) or bonus (all accepted) token: length a+1
    drafted: tuple[int, ...] = ()  # every draft token, read back with the verdict

    @property
    def path(self) -> list[int]:
        """The accepted drafts as verify nodes (1..a), as a tree's verdict names them."""
        return list(range(1, self.accepted_len + 1))


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
    """Greedy verification of every chain of a verify batch, with one device→host transfer. `input_ids` [T]: each
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
    """The rule of the module docstring for every chain of a verify batch, with one device→host transfer: one uniform
    per draft and the accept tests of all sequences at once, then the corrected (or bonus) token of every sequence
    from one batched draw. A draft whose draft probability is 0 (float underflow) is accepted iff the target gives
    it positive probability; a token the target gives probability 0 is never emitted."""
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


@dataclass(frozen=True)
class _TreeLayout:
    """Host-built layout of a batch of trees in the verify's flat rows (tree b's node u is row starts[b] + u): one
    (parent row, child row) pair per draft node, in row order, and the pairs grouped by the child's rank among its
    siblings (rank i: every node's (i + 1)-th child, at most one per parent)."""

    starts: list[int]
    parent_rows: list[int]  # [P]
    child_rows: list[int]  # [P]
    pairs_by_rank: list[list[int]]  # per sibling rank, indices into the pairs
    depth: int  # the deepest node of the batch
    num_rows: int  # T

    @classmethod
    def of(cls, parents: list[list[int]]) -> "_TreeLayout":
        starts, parent_rows, child_rows, pairs_by_rank, depth, start = [], [], [], [], 0, 0
        for tree_parents in parents:
            starts.append(start)
            node_depth, num_children = [0], [0] * (len(tree_parents) + 1)
            for node, parent in enumerate(tree_parents, start=1):
                if not 0 <= parent < node:
                    raise ValueError(f"node {node}: its parent {parent} must be an earlier node")
                node_depth.append(node_depth[parent] + 1)
                rank = num_children[parent]
                num_children[parent] += 1
                if rank == len(pairs_by_rank):
                    pairs_by_rank.append([])
                pairs_by_rank[rank].append(len(parent_rows))
                parent_rows.append(start + parent)
                child_rows.append(start + node)
            depth = max(depth, *node_depth)
            start += len(tree_parents) + 1
        return cls(starts, parent_rows, child_rows, pairs_by_rank, depth, start)

    def verdicts(self, accepted_child: torch.Tensor, input_ids: torch.Tensor, last_token: Callable
                 ) -> list[TreeRejectionResult]:
        """Walk every tree from its root along `accepted_child` [T] (the accepted child row of each row, T for none),
        on the device; `last_token(last_rows [B]) -> [B]` gives the token emitted at
        each tree's last accepted node. Reads the paths, their tokens and the last tokens back in ONE transfer."""
        batch_size, none = len(self.starts), self.num_rows
        node = to_device(self.starts, torch.long, accepted_child.device)  # [B]
        path_rows = []
        for _ in range(self.depth):  # a path is at most `depth` nodes long
            node = torch.where(accepted_child[node] != none, accepted_child[node], node)
            path_rows.append(node)
        last = node
        path = torch.stack(path_rows, 1) if path_rows else node.new_zeros(batch_size, 0)  # [B, depth]
        host = torch.cat([path.flatten(), input_ids.long()[path].flatten(), last_token(last).long()]).tolist()
        size = path.numel()
        rows, tokens, ends = host[:size], host[size : 2 * size], host[2 * size :]
        results = []
        for b, start in enumerate(self.starts):
            walked = slice(b * self.depth, (b + 1) * self.depth)
            # the walk stays on the last node once it stops: keep the rows up to the first repeat
            nodes, node_tokens, previous = [], [], start
            for row, token in zip(rows[walked], tokens[walked]):
                if row == previous:
                    break
                nodes.append(row - start)
                node_tokens.append(token)
                previous = row
            results.append(TreeRejectionResult(nodes, node_tokens + [ends[b]]))
        return results


def greedy_accept_trees(input_ids: torch.Tensor, target_argmax: torch.Tensor, parents: list[list[int]]
                        ) -> list[TreeRejectionResult]:
    """Greedy verification of a batch of trees, with one device→host transfer. `input_ids` [T]: each tree's root then
    its nodes; `target_argmax` [T]: the target's argmax at each row; `parents[b][i]`: the parent of tree b's node
    i + 1. From the root, follow the child whose token is the target's argmax while there is one (the first such
    child in node order), then emit the argmax at the last accepted node: the longest path of argmax tokens + the
    bonus."""
    layout = _TreeLayout.of(parents)
    device, none = target_argmax.device, layout.num_rows
    accepted_child = torch.full((none,), none, dtype=torch.long, device=device)  # [T]
    if layout.parent_rows:
        parent_rows = to_device(layout.parent_rows, torch.long, device)  # [P]
        child_rows = to_device(layout.child_rows, torch.long, device)  # [P]
        matches = target_argmax[parent_rows] == input_ids[child_rows]  # [P]
        # the first matching child of each parent (children are numbered in test order)
        accepted_child.scatter_reduce_(0, parent_rows, torch.where(matches, child_rows, none), "amin")
    return layout.verdicts(accepted_child, input_ids, lambda last: target_argmax[last])


def rejection_sample_trees(
    input_ids: torch.Tensor,  # [T] int64: each tree's root, then its nodes
    draft_probs: list[torch.Tensor],  # per tree [n_b, vocab]: the distribution each node was drawn from
    target_probs: torch.Tensor,  # [T, vocab]: the target's distribution at each row
    parents: list[list[int]],  # per tree, the parent of node i + 1 (an earlier node; 0 = the root)
    generator: torch.Generator | None = None,
) -> list[TreeRejectionResult]:
    """Multi-candidate recursive rejection sampling over the siblings (SpecInfer; Jeon et al. 2024, recursive
    speculative decoding) for a batch of trees, with one device→host transfer. At node u with target distribution p,
    its children x_1..x_m are tested in order: x_i, drawn from q_i (`draft_probs`: the draft distribution given the
    earlier siblings, i.e. q with x_1..x_{i-1} removed and renormalized for sampling without replacement; one-hot for
    a deterministic candidate), is accepted with probability min(1, p(x_i) / q_i(x_i)); on rejection p becomes
    norm(max(0, p - q_i)) and the next sibling is tried. An accepted child becomes u (its own target row is the new
    p); when every child is rejected one token is sampled from the last p, after a leaf the bonus from p. Each test
    is the chain's lossless rule with draft q_i, so the emitted tokens are distributed as the target's own samples,
    provided each candidate was drawn from its q_i and the number of children of a node does not depend on the
    values drawn for them.

    Batched: the sibling tests of every node of every tree run on the device, one sibling rank at a time (each node
    with its own uniforms, whether or not the walk reaches it: a node's outcome depends only on its own draws, so
    deciding all of them ahead of the walk leaves the distribution of the walked path unchanged); the walk from the
    roots follows the accepted children on the device; the next token is drawn for all trees in one call."""
    layout = _TreeLayout.of(parents)
    device, vocab, none = target_probs.device, target_probs.shape[-1], layout.num_rows
    for b, (tree_parents, q) in enumerate(zip(parents, draft_probs)):
        if q.shape != (len(tree_parents), vocab):
            raise ValueError(f"tree {b}: expected draft_probs of shape [{len(tree_parents)}, {vocab}], "
                             f"got {tuple(q.shape)}")
    target_probs = target_probs.float()
    accepted_child = torch.full((none,), none, dtype=torch.long, device=device)  # [T]
    if not layout.parent_rows:  # no drafts: every tree's next token comes from its root's p
        return layout.verdicts(accepted_child, input_ids,
                               lambda last: torch.multinomial(target_probs[last], 1, generator=generator)[:, 0])
    # Only rows with children have their p replaced by residuals: they get a working copy (a leaf's p stays the
    # target's), row r at slot[r] (-1 for a leaf).
    tested_rows = sorted(set(layout.parent_rows))
    slot = [-1] * none
    for i, row in enumerate(tested_rows):
        slot[row] = i
    p = target_probs[to_device(tested_rows, torch.long, device)]  # [U, vocab]
    slot_of_row = to_device(slot, torch.long, device)  # [T]
    q = torch.cat(draft_probs).float()  # [P, vocab], pair order = row order
    parent_rows = to_device(layout.parent_rows, torch.long, device)  # [P]
    child_rows = to_device(layout.child_rows, torch.long, device)  # [P]
    for pairs in layout.pairs_by_rank:
        pair = to_device(pairs, torch.long, device)  # [m]: the rank's pairs, one per parent
        rows, children = parent_rows[pair], child_rows[pair]
        slots = slot_of_row[rows]
        tokens = input_ids[children].long()[:, None]  # [m, 1]
        p_rows, q_rows = p[slots], q[pair]  # [m, vocab]
        undecided = accepted_child[rows] == none  # [m]: no earlier sibling accepted
        uniforms = torch.rand(len(pairs), generator=generator, device=device)
        # u < p/q without dividing: q = 0 accepts iff p > 0; p = 0 never accepts (strict inequality).
        accepted = undecided & (uniforms * q_rows.gather(1, tokens)[:, 0] < p_rows.gather(1, tokens)[:, 0])
        accepted_child[rows] = torch.where(accepted, children, accepted_child[rows])
        residual = (p_rows - q_rows).clamp_(min=0)
        mass = residual.sum(-1, keepdim=True)  # [m, 1]
        replace = (undecided & ~accepted)[:, None] & (mass > _RESIDUAL_EPS)  # below: p == q up to rounding
        p[slots] = torch.where(replace, residual / mass.clamp(min=_RESIDUAL_EPS), p_rows)

    def next_token(last: torch.Tensor) -> torch.Tensor:
        last_slot = slot_of_row[last]  # [B]
        probs = torch.where((last_slot >= 0)[:, None], p[last_slot.clamp(min=0)], target_probs[last])
        return torch.multinomial(probs, 1, generator=generator)[:, 0]  # [B]

    return layout.verdicts(accepted_child, input_ids, next_token)
