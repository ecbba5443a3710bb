"""The tree proposer (EAGLE-2's dynamic draft trees): a draft head drafts a tree of N tokens instead of a chain of k,
the target verifies every node in one forward with a tree attention mask, and the longest accepted root-to-leaf path
is committed (`runtime/rejection.py`: greedy walk, or recursive rejection sampling over the siblings).

Drafting, per step and sequence (`DraftTree(head, TreeShape(depth, topk, nodes))`):

- the root is the last committed token; its head row is the catch-up's last one (as for the chain), whose logits
  give the root's children;
- depth j = 1..d: each expanded node gets `topk` children — greedy: its top-k draft tokens; sampling: k tokens drawn
  from the processed draft distribution without replacement — scored by the cumulative draft log-probability of
  their path; the `topk` best of the new depth are expanded next, i.e. the head runs once more over them (one head
  forward per depth for the whole batch, each row attending to the head's cached prefix and its own ancestors);
- greedy: the N best nodes of all drafted ones by cumulative log-probability are kept (EAGLE-2's reranking; an
  ancestor always ranks before its descendants). Sampling keeps the first N in drafting order (depth, rank of the
  parent, draw order): which children a node keeps must not depend on the values drawn for them, or the recursive
  rejection sampling would no longer be lossless;
- hybrid (`DraftTree(..., lookup=PromptLookup())`): the n-gram continuation of the context (prompt lookup, up to d
  tokens) is one more branch from the root, the head's tree gets the remaining nodes; greedy merges the branch into
  the head's tree where their tokens agree, sampling tests it first (one-hot draft distribution).

A static tree is the special case where no reranking happens (N = topk + (d - 1) topk², every drafted node kept);
`topk = 1` with N = d is the chain. After the verify the target's cache keeps only the accepted path: its entries
are copied into place after the prefix (their rotary positions already are prefix + depth) and the rest cut off; the
head's tree rows are cut back to the prefix and recomputed from the target's states, exactly as after a chain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.attention import BatchInfo, ancestor_mask
from mtp_train.runtime.host_sync import to_device
from mtp_train.runtime.sampler import SamplingParams, processed_probs
from mtp_train.runtime.spec.mtp_chain import MTPChainProposer
from mtp_train.runtime.spec.prompt_lookup import PromptLookup, ngram_next_token
from mtp_train.runtime.spec.proposer import Request

MAX_TREE_DEPTH = 8
MAX_TREE_TOPK = 8
MAX_TREE_NODES = 64


@dataclass(frozen=True)
class TreeShape:
    """depth d (most draft tokens on one path), topk (children per expanded node and nodes expanded per depth),
    nodes N (draft tokens verified per step, the root excluded)."""

    depth: int
    topk: int
    nodes: int

    def __post_init__(self) -> None:
        for name, value, limit in (("depth", self.depth, MAX_TREE_DEPTH), ("topk", self.topk, MAX_TREE_TOPK),
                                   ("nodes", self.nodes, MAX_TREE_NODES)):
            if not isinstance(value, int) or not 1 <= value <= limit:
                raise UserError(f"tree {name} must be an integer in 1..{limit}, got {value!r}")
        if self.nodes > self.max_nodes:
            raise UserError(f"tree {self.label}: depth {self.depth} with topk {self.topk} drafts at most "
                            f"{self.max_nodes} nodes, got nodes={self.nodes}")

    @property
    def max_nodes(self) -> int:
        """Nodes drafted before the reranking: topk children of the root, then topk² per further depth."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @property
    def label(self) -> str:
        return f"{self.depth}x{self.topk}x{self.nodes}"

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'DEPTHxTOPKxNODES', e.g. '4x2x8'."""
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
        if not match:
            raise UserError(f"tree shape {text!r}: expected DEPTHxTOPKxNODES, e.g. 4x2x8")
        return cls(*(int(g) for g in match.groups()))


HYBRID_SUFFIX = "+lookup"


def parse_tree_method(text: str) -> tuple[TreeShape, bool]:
    """'DEPTHxTOPKxNODES' -> (shape, False); 'DEPTHxTOPKxNODES+lookup' (a hybrid tree) -> (shape, True)."""
    text = str(text).strip()
    hybrid = text.endswith(HYBRID_SUFFIX)
    return TreeShape.parse(text[: -len(HYBRID_SUFFIX)] if hybrid else text), hybrid


@dataclass(frozen=True, eq=False)
class DraftTree:
    """The draft to pass to `speculative_generate` for tree drafting: a draft head (MTP, EAGLE-1 or EAGLE-3), the
    tree's shape and, for a hybrid tree, the prompt lookup whose continuation is one more branch."""

    head: object
    shape: TreeShape
    lookup: PromptLookup | None = None

    @property
    def label(self) -> str:
        return f"tree={self.shape.label}" + (HYBRID_SUFFIX if self.lookup is not None else "")


@dataclass
class TreeProposal:
    """One sequence's draft tree in verify order: node i + 1 of the verify is draft i (node 0 is the root); the
    siblings of a node are tested in node order (`rejection.greedy_accept_trees` / `rejection_sample_trees`)."""

    tokens: list[int]  # [n] draft tokens (target ids)
    parents: list[int]  # [n] parent node of each (0 = the root), always an earlier node
    depths: list[int]  # [n] 1..d
    draft_probs: torch.Tensor | None  # sampling: [n, vocab] the distribution each node was drawn from

    @property
    def size(self) -> int:
        return len(self.tokens)

    def verify_mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool: each node (the root included) attends to its ancestors and itself."""
        return ancestor_mask([-1, *self.parents])


@dataclass
class _Node:
    token: int  # target id
    parent: int  # creation id of the parent (0: the root)
    depth: int
    score: float  # cumulative draft log-probability of the path
    probs_row: torch.Tensor | None = None  # sampling: [vocab] the distribution this node was drawn from
    source: str = "head"


def _draw_without_replacement(probs: torch.Tensor, count: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `probs` [m, V], `count` distinct ids drawn one after another without replacement (Gumbel top-k:
    the order of the keys is the order of the draws): (ids [m, count], drawn [m, count] bool). A row with fewer than
    `count` ids of positive probability draws only those: the rest of its row is marked not drawn."""
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device).clamp_(min=1e-20)
    keys = probs.log() - (-uniform.log()).log()  # log p + Gumbel(0, 1); -inf where p = 0
    top = torch.topk(keys, min(count, probs.shape[-1]), dim=-1)
    return top.indices, top.values > float("-inf")


class TreeProposer(MTPChainProposer):
    """Drafts a tree per sequence with a head (the chain's catch-up and head state; tree steps instead of a chain)."""

    schedule = "tree"
    draft_description = ""

    @classmethod
    def accepts(cls, draft) -> bool:
        return isinstance(draft, DraftTree)

    def __init__(self, target, draft: DraftTree, allocator):
        super().__init__(target, draft.head, allocator)
        self.shape, self.lookup = draft.shape, draft.lookup
        self.schedule = "tree_hybrid" if draft.lookup is not None else "tree"
        self.vocab_size = target.config.vocab_size

    # ---- drafting -------------------------------------------------------------------------------------------------

    def _children(self, logits: torch.Tensor, sampling: SamplingParams, generator, count: int
                  ) -> list[tuple[list[int], list[float], list[torch.Tensor] | None]]:
        """For each row of draft logits [m, N]: up to `count` child tokens (target ids), their draft log-probs and
        (sampling) the distribution each was drawn from, [vocab] rows in the target's vocabulary. One device→host
        transfer for all rows (the tree's shape is decided on the host)."""
        if sampling.greedy:
            top = torch.topk(logits.float().log_softmax(-1), min(count, logits.shape[-1]), dim=-1)  # [m, count]
            ids, logq, drawn, q_rows = top.indices, top.values, torch.ones_like(top.indices, dtype=torch.bool), None
        else:
            probs = processed_probs(logits, sampling).float()  # [m, N]
            ids, drawn = _draw_without_replacement(probs, count, generator)  # [m, count] each
            logq = probs.gather(-1, ids).log()
            q_rows, remaining = [], probs.clone()  # q_rows[i] [m, vocab]: what the i-th draw of each row came from
            for i in range(ids.shape[1]):
                q_rows.append(self._to_vocab(remaining / remaining.sum(-1, keepdim=True).clamp(min=1e-30)))
                remaining.scatter_(-1, ids[:, i : i + 1], 0.0)
        if self.draft_ids is not None:
            ids = self.draft_ids[ids]
        # ids (< 2^53) travel exactly as float64, with the log-probs and the drawn flags: one transfer
        host = torch.stack([ids.double(), logq.double(), drawn.double()]).tolist()  # [3, m, count]
        out = []
        for r, (row_ids, row_logq, row_drawn) in enumerate(zip(*host)):
            n = int(sum(row_drawn))  # a row's drawn ids come first (sorted keys)
            rows = [q[r] for q in q_rows[:n]] if q_rows is not None else None
            out.append(([int(t) for t in row_ids[:n]], row_logq[:n], rows))
        return out

    def _to_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary probabilities [..., N] -> [..., V] (zero outside the draft vocabulary)."""
        if self.draft_ids is None:
            return probs
        return probs.new_zeros(*probs.shape[:-1], self.target_vocab_size).index_copy_(-1, self.draft_ids, probs)

    def _lookup_branch(self, req: Request, depth: int) -> list[int]:
        """The n-gram continuation of the sequence: up to `depth` tokens, stopping where no n-gram matches."""
        context, branch = list(req.token_ids), []
        while len(branch) < depth:
            token = ngram_next_token(context, self.lookup.max_ngram, self.lookup.min_ngram)
            if token is None:
                break
            branch.append(token)
            context.append(token)
        return branch

    def _head_rows(self, requests: list[Request], rows: list[list[int]], nodes: list[list[_Node]],
                   head_slots: list[dict[int, int]], hidden: list[dict[int, torch.Tensor]]) -> torch.Tensor:
        """One head forward over the nodes `rows[b]` of each request (creation ids): each reads its parent's head
        output and its own token at position (prefix + depth - 1), attending to the head's cached prefix and the
        rows of its ancestors. Returns the logits [sum rows, N]; records each row's output in `hidden`."""
        active = [b for b in range(len(requests)) if rows[b]]
        token_ids, carried, positions, masks = [], [], [], []
        for b in active:
            req, tree, slots = requests[b], nodes[b], head_slots[b]
            for node_id in rows[b]:
                slots[node_id] = len(slots)
            width = len(slots)
            mask = torch.zeros(len(rows[b]), width, dtype=torch.bool)
            base = len(req.token_ids) - 2  # the root's head row
            row_positions = []
            for r, node_id in enumerate(rows[b]):
                node = tree[node_id]
                token_ids.append(node.token)
                carried.append(hidden[b][node.parent])
                row_positions.append(base + node.depth)
                ancestor = node_id
                while ancestor != 0:
                    mask[r, slots[ancestor]] = True
                    ancestor = tree[ancestor].parent
            positions.append(row_positions)
            masks.append(mask)
        batch = BatchInfo.for_tree([requests[b].draft.view for b in active], positions, masks, self.allocator,
                                   self.device)
        out = self.head(to_device(token_ids, torch.long, self.device), torch.stack(carried), batch, self.kv_cache)
        self.forwards += 1
        r = 0
        for b in active:
            for node_id in rows[b]:
                hidden[b][node_id] = out[r]
                r += 1
        return self.head.logits(out)

    def propose(self, requests: list[Request], depths: list[int], sampling: SamplingParams,
                generator: torch.Generator) -> list[TreeProposal]:
        """The pending catch-up, then a draft tree of at most `shape.nodes` nodes and depth `depths[b]` (0: an empty
        tree) per request."""
        self._run_catch_up(requests)
        topk, budget = self.shape.topk, self.shape.nodes
        batch_size = len(requests)
        branches = [self._lookup_branch(req, d) if self.lookup is not None and d > 0 else []
                    for req, d in zip(requests, depths)]
        nodes: list[list[_Node]] = [[_Node(req.token_ids[-1], -1, 0, 0.0)] for req in requests]  # creation order
        hidden = [{0: req.draft.head_hidden} for req in requests]
        head_slots: list[dict[int, int]] = [{} for _ in requests]
        lookup_ids: list[list[int]] = [[] for _ in requests]
        if not sampling.greedy:  # the lookup branch first: its root child is the first one tested
            for b, branch in enumerate(branches):
                parent = 0
                for j, token in enumerate(branch):
                    one_hot = torch.zeros(self.vocab_size, device=self.device)
                    one_hot[token] = 1.0
                    nodes[b].append(_Node(token, parent, j + 1, 0.0, one_hot, source="lookup"))
                    parent = len(nodes[b]) - 1
                    lookup_ids[b].append(parent)
        frontier = [[0] if depths[b] > 0 else [] for b in range(batch_size)]
        logits_of = {(b, 0): req.draft.next_logits for b, req in enumerate(requests)}
        for depth in range(1, max(depths, default=0) + 1):
            expand = [(b, u) for b in range(batch_size) for u in frontier[b]]
            if not expand:
                break
            children = self._children(torch.stack([logits_of[key] for key in expand]), sampling, generator, topk)
            new_by_request: list[list[int]] = [[] for _ in range(batch_size)]
            for (b, u), (tokens, logq, rows) in zip(expand, children):
                for i, (token, value) in enumerate(zip(tokens, logq)):
                    nodes[b].append(_Node(token, u, depth, nodes[b][u].score + value,
                                          rows[i] if rows is not None else None))
                    new_by_request[b].append(len(nodes[b]) - 1)
            logits_of.clear()
            next_frontier = [[] for _ in range(batch_size)]
            for b in range(batch_size):
                if depth < depths[b] and new_by_request[b]:
                    ranked = sorted(new_by_request[b], key=lambda i: (-nodes[b][i].score, i))
                    next_frontier[b] = ranked[:topk]
            if any(next_frontier):
                logits = self._head_rows(requests, next_frontier, nodes, head_slots, hidden)
                r = 0
                for b in range(batch_size):
                    for node_id in next_frontier[b]:
                        logits_of[(b, node_id)] = logits[r]
                        r += 1
            frontier = next_frontier
        proposals = []
        for b in range(batch_size):
            proposals.append(self._select(nodes[b], lookup_ids[b], branches[b], budget, sampling))
        return proposals

    def _select(self, tree: list[_Node], lookup_ids: list[int], branch: list[int], budget: int,
                sampling: SamplingParams) -> TreeProposal:
        """Keep `budget` nodes (see the module docstring) and number them in creation order (parents first)."""
        head_ids = [i for i in range(1, len(tree)) if tree[i].source == "head"]
        head_budget = max(budget - len(branch), 0)
        if sampling.greedy:
            kept = sorted(head_ids, key=lambda i: (-tree[i].score, i))[:head_budget]
        else:
            kept = head_ids[:head_budget]
        kept = sorted(set(kept) | set(lookup_ids))
        number = {0: 0}
        for i in kept:
            number[i] = len(number)
        tokens = [tree[i].token for i in kept]
        parents = [number[tree[i].parent] for i in kept]
        depths = [tree[i].depth for i in kept]
        if sampling.greedy and branch:  # merge the lookup branch into the head's tree
            node = 0
            for j, token in enumerate(branch):
                match = next((c for c, p in enumerate(parents, start=1) if p == node and tokens[c - 1] == token), None)
                if match is None:
                    tokens.append(token)
                    parents.append(node)
                    depths.append(j + 1)
                    match = len(tokens)
                node = match
        draft_probs = None
        if not sampling.greedy:
            empty = torch.zeros(0, self.vocab_size, device=self.device)
            draft_probs = torch.stack([tree[i].probs_row for i in kept]) if kept else empty
        return TreeProposal(tokens, parents, depths, draft_probs)


def representative_tree(shape: TreeShape) -> tuple[list[int], list[int]]:
    """(parents, depths) of a tree of `shape` in verify numbering, as the drafting builds it before the reranking
    when the best-scored node of each depth comes first: topk children of the root, then the first topk nodes of
    each depth expanded into topk children each, the first `nodes` kept. What cost measurements verify."""
    parents, depths, frontier = [], [], [0]
    for depth in range(1, shape.depth + 1):
        new = []
        for parent in frontier:
            for _ in range(shape.topk):
                parents.append(parent)
                depths.append(depth)
                new.append(len(parents))
        frontier = new[: shape.topk]
    return parents[: shape.nodes], depths[: shape.nodes]


__all__ = ["DraftTree", "TreeProposal", "TreeProposer", "TreeShape", "parse_tree_method", "representative_tree"]
