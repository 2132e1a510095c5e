"""benchmarks/draft_replay.py: the replay of greedy outputs through a proposer counts what the
engine would compute and produce per decode step, and drives a graft proposer as the adapter
does (no engine: the texts are given)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def replay_mod():
    return load_script("draft_replay.py")


class Oracle:
    """Drafts the true next tokens, the first ``wrong_at`` of each draft replaced by a wrong one."""

    def __init__(self, texts, k, wrong_at=None):
        self.texts, self.k, self.wrong_at = texts, k, wrong_at
        self.calls = []

    def begin_step(self, num_requests, num_tokens=0):
        self.calls.append(("begin", num_requests))

    def accepted(self, rid, a, v):
        self.calls.append(("accepted", rid, a, v))

    def propose(self, rid, ctx, max_tokens, prompt_len):
        out = self.texts[int(rid)]["output"]
        pos = len(ctx) - prompt_len
        d = out[pos : pos + min(self.k, max_tokens)]
        if self.wrong_at is not None and len(d) > self.wrong_at:
            d = [*d[: self.wrong_at], -1, *d[self.wrong_at + 1 :]]
        return d

    def finish(self, rid):
        self.calls.append(("finish", rid))


def test_replay_counts_steps_tokens_and_acceptance(replay_mod):
    texts = [{"prompt": [1, 2, 3], "output": list(range(10, 20))}, {"prompt": [4], "output": list(range(30, 35))}]
    plain = replay_mod.replay(replay_mod.PlainArm(), texts, 2, (1.0, 0.0))
    # the prefill makes each first token; then one token per request and step: 9 and 4 steps
    assert plain["steps"] == 9 and plain["produced"] == 13 == plain["computed"] and plain["drafted"] == 0
    perfect = Oracle(texts, k=4)
    r = replay_mod.replay(perfect, texts, 2, (1.0, 0.0))
    assert r["accepted"] == r["drafted"]  # every draft right
    assert r["produced"] == 13 and r["steps"] == 2  # 9 tokens in steps of 5 (4 drafts + 1); 4 in one
    assert ("finish", "1") in perfect.calls and ("finish", "0") in perfect.calls
    assert perfect.calls[0] == ("begin", 2)
    # a draft wrong at its second token: 1 accepted, 2 tokens a step. The first request: drafts of
    # 4, 4, 4, 3 then 1 (its last token, right); the second: 4 then 2
    half = replay_mod.replay(Oracle(texts, k=4, wrong_at=1), texts, 1, (1.0, 0.0))
    assert (half["steps"], half["drafted"], half["accepted"], half["produced"]) == (7, 22, 7, 13)
    # batch 1: requests one after another, so as many steps as both need alone
    one = replay_mod.replay(replay_mod.PlainArm(), texts, 1, (1.0, 0.0))
    assert one["steps"] == 9 + 4
    # the modelled time: A + B x tokens computed, per step
    assert replay_mod.replay(replay_mod.PlainArm(), texts, 2, (2.0, 0.5))["model_s"] == pytest.approx(
        (9 * 2.0 + 13 * 0.5) / 1e3
    )


def test_replay_drives_a_graft_proposer_as_the_adapter_does(replay_mod, tmp_path):
    dep = tmp_path / "d.yaml"
    models = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"
    dep.write_text(f"model: {models}\nengine: {{dtype: float32}}\n"
                   "speculative: {plugin: lookahead, params: {num_speculative_tokens: 4}}\n")
    arm = replay_mod.GraftArm(str(dep))
    body = list(range(300, 330))
    texts = [{"prompt": [1, *body, 2], "output": body[:20]}]  # the output copies the prompt
    r = replay_mod.replay(arm, texts, 1, (1.0, 0.0))
    assert r["produced"] == 19 and r["accepted"] > 10 and r["steps"] < 19
    assert arm.impl.describe()["live_requests"] == 0  # finish reached the plugin


def test_replay_refuses_adaptive_whose_choices_follow_measured_step_times(replay_mod, tmp_path):
    dep = tmp_path / "a.yaml"
    models = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"
    dep.write_text(f"model: {models}\nengine: {{dtype: float32}}\n"
                   "speculative: {plugin: adaptive, params: {proposer: lookahead}}\n")
    with pytest.raises(SystemExit, match="adaptive chooses by measured step times"):
        replay_mod.GraftArm(str(dep))


def test_drafting_cost_drives_a_proposer_through_the_adapter_in_lock_step(replay_mod):
    mod = load_script("drafting_cost.py")
    from vllm_graft.hooks import Kind, get_registry

    reg = get_registry().get(Kind.SPECULATIVE, "lookahead").registration
    impl = reg.load()(reg.params.model_validate({"num_speculative_tokens": 4}))
    body = list(range(300, 340))
    texts = [{"prompt": [1, *body, 2], "output": body[:30]}, {"prompt": [5, 6], "output": list(range(700, 730))}]
    steps, per_step, counts = mod.drafting_cost(impl, texts, 4)
    # the copying row accepts its drafts: fewer steps than tokens; the adapter saw every row each step
    assert 0 < steps < 29 and per_step > 0
    assert counts["propose"] == 2 * steps and counts["accepted"] > 10
    # a proposer that says it drafts nothing: one token a step (from the first output token to the
    # 29th of the shorter text, 28 steps), no propose call, the steps counted
    idle_steps, _, idle_counts = mod.drafting_cost(mod.Idle(), texts, 4)
    assert idle_steps == 28 and idle_counts == {"undrafted_steps": 28}


def test_drafting_cost_times_a_deployments_begin_step_adaptive_included(tmp_path):
    mod = load_script("drafting_cost.py")
    dep = tmp_path / "a.yaml"
    dep.write_text("model: m\nspeculative: {plugin: adaptive, params: {proposer: lookahead}}\n")
    seconds, impl = mod.begin_step_cost(str(dep), 32, calls=40)
    # the controller ran 40 steps at batch 32 (its first steps measure the chain shape)
    assert 0 < seconds < 0.1 and sum(impl.describe()["steps_by_mode"].values()) == 40
    empty = tmp_path / "b.yaml"
    empty.write_text("model: m\n")
    with pytest.raises(SystemExit, match="no speculative"):
        mod.begin_step_cost(str(empty), 32, calls=1)
