"""The speculative proposer plugins in vLLM's CPU engine on the bundled tiny Llama: greedy
outputs identical to plain vLLM, drafts verified and partly accepted, the verify step's
top-k reaching Token Recycling aligned with the tokens it follows, and per-request state
released once vLLM reports the requests finished."""
from __future__ import annotations

import pytest

from vllm_graft.hooks import Kind

from .test_adapters_speculative_quant import PROMPTS, _events, _greedy, _tokens, engine

pytestmark = pytest.mark.e2e

NEW_TOKENS = 32
# Repetitive text, so that every proposer has something to draft from.
PROMPTS = PROMPTS + [
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2, 3]\nv = [1, 2,",
]

CASES = {
    "token-recycling": {"plugin": "token-recycling", "params": {"k": 4, "num_speculative_tokens": 3}},
    "lookahead": {"plugin": "lookahead", "params": {"num_speculative_tokens": 3}},
    "pooled-ngram": {"plugin": "pooled-ngram", "params": {"num_speculative_tokens": 3}},
    # wraps token-recycling: the top-k must reach the wrapped proposer through adaptive
    "adaptive": {"plugin": "adaptive", "params": {"proposer": "token-recycling",
                                                  "num_speculative_tokens": 3}},
}


@pytest.fixture(scope="module")
def plain_tokens():
    with engine(None) as llm:
        tokens = _tokens(llm.generate(PROMPTS, _greedy(NEW_TOKENS), use_tqdm=False))
    assert all(len(t) == NEW_TOKENS for t in tokens)
    return tokens


class TopkAudit:
    """Wraps a proposer's observe_topk/accepted/propose and checks, for every step, that
    row j's top-1 is the token greedy decoding produced after ``tokens[j]`` (rows up to the
    last accepted draft), i.e. that the top-k are aligned with the tokens they follow."""

    def __init__(self, plugin):
        self.plugin, self.pending, self.checked = plugin, {}, 0
        self.mismatches: list = []
        inner_observe, inner_accepted, inner_propose = (
            plugin.observe_topk, plugin.accepted, plugin.propose)

        def observe_topk(rid, tokens, ids):
            self.pending[rid] = [list(tokens), ids.tolist(), 0]
            return inner_observe(rid, tokens, ids)

        def accepted(rid, a, v):
            if rid in self.pending:
                self.pending[rid][2] = a
            return inner_accepted(rid, a, v)

        def propose(rid, token_ids, max_tokens):
            if rid in self.pending:
                tokens, ids, a = self.pending.pop(rid)
                p = len(token_ids) - a - 2  # position of tokens[0]
                for j in range(min(a + 1, len(tokens))):
                    self.checked += 1
                    if (tokens[j], ids[j][0]) != (token_ids[p + j], token_ids[p + j + 1]):
                        self.mismatches.append((rid, j, tokens, ids[j], token_ids[p:p + a + 2]))
            return inner_propose(rid, token_ids, max_tokens)

        plugin.observe_topk, plugin.accepted, plugin.propose = observe_topk, accepted, propose


@pytest.mark.parametrize("name", list(CASES))
def test_proposer_is_lossless_and_its_drafts_are_accepted(name, plain_tokens):
    from vllm_graft.integration.runtime import RUNTIME

    with engine({"speculative": CASES[name]}) as llm:
        spec = llm.llm_engine.vllm_config.speculative_config
        assert (spec.method, spec.num_speculative_tokens) == ("custom_class", 3)
        plugin = RUNTIME.instances[(Kind.SPECULATIVE, name)]
        topk_target = plugin.inner if name == "adaptive" else plugin
        audit = TopkAudit(plugin) if topk_target.topk else None
        got = _tokens(llm.generate(PROMPTS, _greedy(NEW_TOKENS), use_tqdm=False))
        events = _events(Kind.SPECULATIVE, name)
        described = plugin.describe()
        llm.generate(PROMPTS[:1], _greedy(1), use_tqdm=False)  # delivers the finishes
        after = plugin.describe()
    assert got == plain_tokens, f"{name}: greedy output differs from plain vLLM"
    print(name, dict(events), described)
    assert 0 < events["accepted"] <= events["verified"] <= events["drafted"]
    assert events["propose"] < sum(len(t) for t in got)  # accepted drafts saved steps
    live = after["inner"] if name == "adaptive" else after
    if "live_requests" in live:  # all released but the one request of the second generate
        assert live["live_requests"] <= 1
    if name == "adaptive":
        assert after["live_requests"] <= 1
    if audit is not None:
        assert topk_target.describe()["rows_observed"] > 0
        assert audit.checked > sum(len(t) for t in got) // 2
        assert not audit.mismatches, audit.mismatches[:3]
