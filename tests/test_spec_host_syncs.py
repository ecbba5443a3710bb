"""How often a speculative step makes the host wait for the device (`runtime/host_sync.py`).

On CUDA every read of a device tensor and every blocking host→device copy drains the queue of kernels. The step
reads ONE small tensor back per step (the accepted lengths and tokens of the whole batch); everything else it
builds on the host and copies without waiting. These tests count, on the CPU, the calls that would wait on CUDA,
per step (between two verify forwards of the target: the verdicts of one step, the draft's catch-up and drafts, the
next verify's batch).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from mtp_train.heads import DraftHead, HeadConfig
from mtp_train.runtime.host_sync import count_host_syncs, to_device
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.spec import PromptLookup, speculative_generate
from mtp_train.runtime.spec.tree import DraftTree, TreeShape
from tests.spec_helpers import make_prompts

# `RotaryEmbedding.forward` sizes its table with `int(positions.max())` on the CPU only (on another device it computes
# the rows directly): one count per forward here that CUDA does not have.
CPU_ONLY = "RotaryEmbedding.forward"
VERDICT = "runtime/rejection.py"  # the step's one transfer: the batch's verdicts


def syncs_per_step(target, draft, sampling: SamplingParams, k: int = 3) -> list[Counter]:
    """The counted sites of each full step (between consecutive verify forwards), CPU-only ones left out."""
    marks: list[Counter] = []
    forward = target.forward
    with count_host_syncs() as syncs:
        def marked_forward(*args, **kwargs):
            marks.append(syncs.sites.copy())
            return forward(*args, **kwargs)

        target.forward = marked_forward  # an instance attribute over the class's forward, deleted below
        try:
            _, stats = speculative_generate(target, draft, make_prompts(4), 24, k, sampling=sampling)
        finally:
            del target.forward
    assert stats.target_forwards == len(marks) >= 4
    steps = []
    for before, after in zip(marks[1:], marks[2:]):  # marks[0]: the prefill; marks[1]: the first verify
        step = after - before
        steps.append(Counter({site: n for site, n in step.items() if CPU_ONLY not in site}))
    return steps


def head_for(target) -> DraftHead:
    torch.manual_seed(0)
    return DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="last_layer"))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("draft_name", ["mtp_chain", "target_draft"])
def test_a_chain_step_reads_the_device_once(models, draft_name, sampling):
    """MTP chain (a head through the step-by-step draft loop, as on CUDA) and target–draft, batch 4, k = 3: per step
    exactly one read, the verdicts of all four sequences; the drafts, the catch-up rows, the batch metadata and the
    verify's input stay on the device or are copied there without waiting."""
    target = models["target"]
    draft = head_for(target) if draft_name == "mtp_chain" else models["other_seed"]
    for step in syncs_per_step(target, draft, sampling):
        assert sum(step.values()) == 1, step
        (site,) = step
        assert site.startswith(VERDICT) and site.endswith("tolist"), site


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["tree", "tree+lookup"])
def test_a_tree_step_reads_the_device_once_per_depth_and_once_for_the_verdicts(models, sampling, hybrid):
    """Tree drafting decides the tree's shape on the host (which nodes to expand and keep), so it reads each depth's
    children back, once for the whole batch; the verify's verdicts are the one other read."""
    target = models["target"]
    shape = TreeShape.parse("3x2x5")
    draft = DraftTree(head_for(target), shape, PromptLookup() if hybrid else None)
    steps = syncs_per_step(target, draft, sampling)
    for step in steps:
        verdicts = sum(n for site, n in step.items() if site.startswith(VERDICT))
        drafting = sum(n for site, n in step.items() if "TreeProposer._children" in site)
        assert verdicts == 1 and drafting <= shape.depth and verdicts + drafting == sum(step.values()), step
    assert max(sum(step.values()) for step in steps) == shape.depth + 1


def test_prompt_lookup_reads_only_what_its_lookup_needs(models):
    """Prompt lookup: greedy, the verdicts only (its drafts are host n-gram lookups); sampled, also each sampled draft
    but the last (the next n-gram lookup searches for it on the host)."""
    target = models["target"]
    for step in syncs_per_step(target, PromptLookup(), SamplingParams()):
        assert sum(step.values()) == 1 and all(site.startswith(VERDICT) for site in step), step
    for step in syncs_per_step(target, PromptLookup(), SamplingParams(temperature=0.8), k=3):
        verdicts = sum(n for site, n in step.items() if site.startswith(VERDICT))
        lookups = sum(n for site, n in step.items() if "PromptLookupProposer.draft_step" in site)
        assert (verdicts, lookups) == (1, sum(step.values()) - 1), step
        assert lookups <= 2, step


def test_the_counter_counts_reads_and_blocking_copies_not_to_device():
    values = torch.arange(4)
    with count_host_syncs(within=Path(__file__).parent) as syncs:  # this file's calls
        values.tolist()
        int(values[0])
        torch.tensor([1, 2], device="cpu")
        values.to("cpu")
        to_device([1, 2], torch.long, "cpu")  # the non-blocking path: not counted
        values.to("cpu", non_blocking=True)
        values.to(torch.float32)  # no device named
    kinds = sorted(site.rsplit(" ", 1)[1] for site in syncs.sites.elements())
    assert kinds == ["__int__", "tensor(device=)", "to(device)", "tolist"], syncs.sites
    assert syncs.count == 4
    assert torch.Tensor.tolist(values) == [0, 1, 2, 3]  # restored on exit
