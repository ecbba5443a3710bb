"""The vLLM report's account of a speculative output that parts from plain (`export/vllm_eval.py`): where (prompt,
first differing new token, the two tokens) and why, from vLLM's own logprobs: the plain decode's margin against the
rounding between its decode and a prefill of the same prefix; a near-tie or a fault, in the words of our engine's
`evaluate.margins.Divergence`.

All but the last test run without vLLM (the engine replaced by recorded replies). The last one drives the real
worker on SmolLM2 (vLLM's interpreter: `make .venv-vllm/.installed`; `make test` sets MTP_TRAIN_REQUIRE_VLLM=1 so that
a missing vLLM fails there instead of skipping)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from mtp_train.export import vllm_eval
from mtp_train.export.vllm_eval import (
    classify_divergence,
    describe_divergence,
    explain_divergences,
    find_divergences,
    markdown_lines,
)
from tests.pipeline_fixtures import vllm_python

PLAIN, SPEC, OTHER = 10, 11, 12  # token ids: the plain run's, the speculative run's, a third


def test_a_margin_within_twice_the_rounding_is_a_near_tie():
    decode = {PLAIN: -0.70, SPEC: -0.75}  # margin 0.05
    prefill = {PLAIN: -0.68, SPEC: -0.78}  # the tokens move by 0.02 and 0.03: rounding 0.03, 2 × 0.03 ≥ 0.05
    verdict = classify_divergence(decode, prefill, PLAIN, SPEC)
    assert verdict == {"margin": pytest.approx(0.05), "margin_is_lower_bound": False,
                       "rounding": pytest.approx(0.03), "prefill_argmax": PLAIN, "verdict": "near-tie"}


def test_a_margin_beyond_twice_the_rounding_is_a_fault():
    decode = {PLAIN: -0.10, SPEC: -2.50}
    prefill = {PLAIN: -0.11, SPEC: -2.48}
    verdict = classify_divergence(decode, prefill, PLAIN, SPEC)
    assert verdict["verdict"] == "fault"
    assert verdict["margin"] == pytest.approx(2.40) and verdict["rounding"] == pytest.approx(0.02)


def test_a_prefill_that_picks_the_speculative_token_is_a_near_tie():
    """The speculative token is not in the decode's top 2 (margin: the top-1/top-2 one, a lower bound; rounding: the
    plain token's alone), so the margin rule calls it a fault; the prefill itself picks it: a near-tie."""
    decode = {PLAIN: -0.50, OTHER: -1.50}
    prefill = {PLAIN: -0.60, SPEC: -0.55}
    verdict = classify_divergence(decode, prefill, PLAIN, SPEC)
    assert verdict["margin"] == pytest.approx(1.0) and verdict["margin_is_lower_bound"]
    assert verdict["rounding"] == pytest.approx(0.10)  # 1.0 > 2 × 0.10: not by the margin
    assert verdict["prefill_argmax"] == SPEC and verdict["verdict"] == "near-tie"


def test_divergences_are_found_where_outputs_first_differ():
    plain = [[1, 2, 3], [4, 5, 9], [7, 8]]
    spec = [[1, 2, 3], [4, 6, 9], [7]]
    assert find_divergences(plain, spec) == [
        {"prompt": 1, "position": 1, "plain_token": 5, "spec_token": 6},
        {"prompt": 2, "position": 1, "plain_token": 8, "spec_token": None}]
    assert find_divergences(plain, plain) == []


class _Tokenizer:
    def decode(self, ids):
        return f"<{ids[0]}>"


def test_explaining_scores_each_shared_prefix_once_and_fills_the_fields(monkeypatch, tmp_path):
    """The prefills are of the prompt, the shared new tokens and each candidate (one per distinct sequence, however
    many k part there); each divergence gets its tokens' text, margin, rounding and verdict; an output that had
    ended has nothing to compare: a fault."""
    prompts = [[100, 101], [200]]
    plain = {"outputs": [[1, 2, PLAIN], [3, 4]],
             "logprobs": [[[[1, -0.1]], [[2, -0.2]], [[PLAIN, -0.70], [SPEC, -0.75]]], [[[3, -0.1]], [[4, -0.1]]]]}
    scored: list[list[int]] = []

    def prefill_logprobs(target_dir, dtype, sequences, stops, work_dir, python, engine_args):
        scored.extend(sequences)
        return [{PLAIN: -0.68} if s[-1] == PLAIN else {PLAIN: -0.68, SPEC: -0.78} for s in sequences]

    monkeypatch.setattr(vllm_eval, "_prefill_logprobs", prefill_logprobs)
    monkeypatch.setattr("mtp_train.runtime.loader.load_tokenizer", lambda path: _Tokenizer())
    at_k1 = {"prompt": 0, "position": 2, "plain_token": PLAIN, "spec_token": SPEC}
    divergences = [at_k1, dict(at_k1), {"prompt": 1, "position": 2, "plain_token": None, "spec_token": 5}]
    explain_divergences(divergences, prompts, plain, "target", "auto", [0], tmp_path, None, {})
    assert sorted(scored) == [[100, 101, 1, 2, PLAIN], [100, 101, 1, 2, SPEC]]
    assert divergences[0] == divergences[1] == {
        **at_k1, "plain_text": f"<{PLAIN}>", "spec_text": f"<{SPEC}>", "margin": pytest.approx(0.05),
        "margin_is_lower_bound": False, "rounding": pytest.approx(0.03), "prefill_argmax": PLAIN,
        "verdict": "near-tie"}
    assert divergences[2]["verdict"] == "fault" and divergences[2]["margin"] is None
    assert "where the plain output had ended: a FAULT" in describe_divergence("mtp@k=2", divergences[2])


def _fake_engine(outputs_by_k: dict[int | None, list[list[int]]], seen: list[dict]):
    """`_run`'s stand-in: plain (no speculative config) or each k's outputs, the plain run's top-2 logprobs (the
    plain token -0.70, token 11 -0.75 at every step), and for the prefill engine each sequence's last token at -0.68
    (token 11 at -0.78)."""
    def run(target_dir, dtype, prompts, max_new_tokens, stops, work_dir, python, engine_args, speculative=None,
            hf_overrides=None, logprobs=None):
        seen.append({"work_dir": Path(work_dir).name, "logprobs": logprobs, "prompts": prompts})
        if logprobs and "prompt_logprobs" in logprobs:
            return {"prompt_logprobs": [[None, [[s[-1], -0.68 if s[-1] != SPEC else -0.78]]] for s in prompts]}
        k = speculative["num_speculative_tokens"] if speculative else None
        outputs = outputs_by_k[k]
        reply = {"outputs": outputs, "seconds": [1.0] * len(outputs), "info": {"vllm": "0.32.0", "device": "cpu",
                                                                             "dtype": "bfloat16"},
                 "metrics": {"vllm:spec_decode_num_drafts": 4, "vllm:spec_decode_num_accepted_tokens": 0}}
        if logprobs:
            reply["logprobs"] = [[[[t, -0.70], [SPEC if t != SPEC else 0, -0.75]] for t in o] for o in outputs]
        return reply
    return run


def test_the_report_says_where_and_why_in_json_markdown_and_print(monkeypatch, tmp_path):
    """evaluate_in_vllm with the engines replaced: the plain run asks for top-2 logprobs; a divergence at k = 2 is
    in the method's JSON (`divergences`), printed, and a line under the markdown table; k = 1, identical, has none."""
    seen: list[dict] = []
    outputs = {None: [[1, 2, PLAIN, 3], [5, 6]], 1: [[1, 2, PLAIN, 3], [5, 6]], 2: [[1, 2, SPEC, 4], [5, 6]]}
    monkeypatch.setattr(vllm_eval, "_run", _fake_engine(outputs, seen))
    monkeypatch.setattr(vllm_eval, "read_head_config", lambda d: SimpleNamespace(kind="mtp", draft_vocab_size=None))
    monkeypatch.setattr(vllm_eval, "export_head", lambda *a, **kw: tmp_path / "export")
    monkeypatch.setattr("mtp_train.runtime.loader.load_tokenizer", lambda path: _Tokenizer())
    printed: list[str] = []
    section = vllm_eval.evaluate_in_vllm("head", "target", [[100, 101], [200]], [0], [1, 2], 4, tmp_path,
                                         show=printed.append)
    assert seen[0] == {"work_dir": "plain", "logprobs": {"logprobs": 2}, "prompts": [[100, 101], [200]]}
    assert seen[-1]["work_dir"] == "plain-prefill" and seen[-1]["logprobs"] == {"prompt_logprobs": 1}
    assert sorted(seen[-1]["prompts"]) == [[100, 101, 1, 2, PLAIN], [100, 101, 1, 2, SPEC]]
    assert section["methods"]["mtp@k=1"]["divergences"] == []
    k2 = section["methods"]["mtp@k=2"]
    assert k2["prompts_differing"] == [0] and not k2["outputs_identical_to_plain"]
    assert k2["divergences"] == [{
        "prompt": 0, "position": 2, "plain_token": PLAIN, "spec_token": SPEC, "plain_text": f"<{PLAIN}>",
        "spec_text": f"<{SPEC}>", "margin": pytest.approx(0.05), "margin_is_lower_bound": False,
        "rounding": pytest.approx(0.03), "prefill_argmax": PLAIN, "verdict": "near-tie"}]
    assert any("mtp@k=2, prompt 0: parts from plain at new token 2" in line and "a near-tie" in line
               for line in printed)
    assert not any("FAULT" in line for line in printed)
    markdown = "\n".join(markdown_lines(section))
    assert "| mtp@k=1 | 1.000 |" in markdown and "| yes |" in markdown
    assert "| no (1 prompts; near-ties) |" in markdown
    assert ("- mtp@k=2, prompt 0: parts from plain at new token 2 (plain '<10>' = 10, speculative '<11>' = 11): "
            "decode margin 0.0500 against a rounding of 0.0300 between vLLM's decode and a prefill "
            "(a near-tie: margin ≤ 2 × rounding)") in markdown


def _section(divergences: list[dict]) -> dict:
    row = {"k": 1, "tau": 1.0, "acceptance_per_position": [0.0], "drafts": 9, "new_tokens": 30, "tokens_per_s": 10.0,
           "speedup": 0.9, "outputs_identical_to_plain": not divergences,
           "prompts_differing": [d["prompt"] for d in divergences], "divergences": divergences}
    return {"vllm_version": "0.32.0", "device": "cpu", "dtype": "bfloat16",
            "export": {"format": "vllm-mtp", "dir": "export", "full_vocab": False}, "prompts": 3,
            "max_new_tokens": 32, "plain": {"new_tokens": 30, "tokens_per_s": 11.0}, "methods": {"mtp@k=1": row},
            "serve": {"target": "target", "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}}


def test_markdown_says_a_fault_loudly_and_nothing_when_outputs_are_identical():
    fault = {"prompt": 2, "position": 7, "plain_token": PLAIN, "spec_token": SPEC, "plain_text": " the",
             "spec_text": " a", "margin": 2.4, "margin_is_lower_bound": False, "rounding": 0.02,
             "prefill_argmax": PLAIN, "verdict": "fault"}
    lines = markdown_lines(_section([fault]))
    assert "| mtp@k=1 | 1.000 | 0.00 | 10.0 | 0.90× | no (1 prompts; **1 FAULT**) |" in lines
    assert ("- mtp@k=1, prompt 2: parts from plain at new token 7 (plain ' the' = 10, speculative ' a' = 11): "
            "decode margin 2.4000 against a rounding of 0.0200 between vLLM's decode and a prefill "
            "(NOT a near-tie: a FAULT)") in lines
    tie_by_prefill = {**fault, "margin_is_lower_bound": True, "prefill_argmax": SPEC, "verdict": "near-tie"}
    line = describe_divergence("mtp@k=1", tie_by_prefill)
    assert "decode margin ≥ 2.4000" in line and line.endswith("(a near-tie: the prefill itself picks the speculative "
                                                              "token)")
    identical = markdown_lines(_section([]))
    assert "| mtp@k=1 | 1.000 | 0.00 | 10.0 | 0.90× | yes |" in identical
    assert not any("parts from plain" in line or "Where a speculative output parts" in line for line in identical)


# ---- the real worker (vLLM's interpreter) on SmolLM2 ----------------------------------------------------------------




@pytest.mark.slow
@pytest.mark.real_model
def test_the_worker_returns_top2_decode_logprobs_and_prompt_logprobs(smollm2_dir, tmp_path):
    """vLLM's plain engine on a SmolLM2 prompt: with logprobs=2 each new token's top 2, best first, the chosen (greedy)
    token first; with prompt_logprobs=1 every prompt token's logprob (the first position null); a prefill of the
    prompt and the answer scores each answer token within bf16 rounding of its decode step's logprob."""
    from mtp_train.runtime.chat import encode_chat
    from mtp_train.runtime.loader import load_tokenizer
    from mtp_train.vllm_engine.engine import VllmWorker

    vllm_python()
    prompt = encode_chat(load_tokenizer(smollm2_dir), [{"role": "user", "content": "Name three colors."}])
    settings = {"mode": "generate", "model": str(Path(smollm2_dir).resolve()), "dtype": "auto",
                "speculative_config": None, "hf_overrides": None,
                "engine_args": {"max_model_len": 256, "enforce_eager": True}}
    with VllmWorker(settings, tmp_path, None) as worker:
        decoded = worker.request({"op": "generate", "prompts": [prompt], "max_new_tokens": 12, "logprobs": 2})
        answer = decoded["outputs"][0]
        scored = worker.request({"op": "generate", "prompts": [prompt + answer], "max_new_tokens": 1,
                                 "prompt_logprobs": 1})
    assert "prompt_logprobs" not in decoded and "logprobs" not in scored
    steps = decoded["logprobs"][0]
    assert len(answer) == 12 and len(steps) == len(answer)
    for token, step in zip(answer, steps):
        assert len(step) == 2 and step[0][0] == token and 0 >= step[0][1] >= step[1][1]
    positions = scored["prompt_logprobs"][0]
    assert len(positions) == len(prompt) + len(answer) and positions[0] is None
    for token, position in zip((prompt + answer)[1:], positions[1:]):
        assert 1 <= len(position) <= 2 and token in dict(position)
        assert position[0][1] == max(logprob for _, logprob in position) <= 0
    prefill = [dict(position)[token] for token, position in zip(answer, positions[len(prompt):])]
    decode = [step[0][1] for step in steps]
    assert max(abs(p - d) for p, d in zip(prefill, decode)) < 0.25, (prefill, decode)
