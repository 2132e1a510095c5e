"""The speculative proposer plugins (token-recycling, lookahead, pooled-ngram, adaptive): their
policies, bounded state, release on finish, and parameter validation. No vLLM, no tensors
beyond NumPy (property-style tests use seeded random streams)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from pydantic import ValidationError

from vllm_graft.hooks import Kind, Proposer, get_registry, validate
from vllm_graft.hooks.deployment import DeploymentError
from vllm_graft.plugins.speculative.adaptive.policy import GoodputPolicy
from vllm_graft.plugins.speculative.lookahead.policy import Calibration, OwnContext, SharedOutputs, TokenTrie, _size
from vllm_graft.plugins.speculative.pooled_ngram.policy import NgramPool, PoolStore
from vllm_graft.plugins.speculative.token_recycling.policy import EMPTY, RecyclingMatrix, tree_paths

NAMES = ("token-recycling", "lookahead", "pooled-ngram", "adaptive")


def build(name, **params):
    entry = get_registry().get(Kind.SPECULATIVE, name)
    cls = entry.registration.load()
    assert issubclass(cls, Proposer)
    return cls(entry.registration.params.model_validate(params))


def default_params(name):
    return {"proposer": "lookahead"} if name == "adaptive" else {}


# ------------------------------------------------------------------------ token recycling
def test_recycling_matrix_rows_are_the_latest_topk_and_the_chain_follows_column_0():
    m = RecyclingMatrix(k=3)
    m.update([5, 7], np.array([[7, 1, 2], [9, 5, 4]]))
    assert m.successors(5).tolist() == [7, 1, 2]
    m.update([5], np.array([[8, 0, 3]]))  # overwritten by the latest step
    assert m.successors(5).tolist() == [8, 0, 3]
    m.update([8], np.array([[7, 6, 6]]))
    assert m.chain(5, 4) == [8, 7, 9]  # 5 -> 8 -> 7 -> 9 -> (9 unknown: stop)
    assert m.chain(123456, 4) == []  # a token never seen
    m.update([3, 3], np.array([[1, 1, 1], [2, 2, 2]]))  # repeated token: the last row wins
    assert m.successors(3).tolist() == [2, 2, 2]


def test_recycling_matrix_fewer_columns_leave_cells_empty_and_vocab_is_enforced():
    m = RecyclingMatrix(k=4, vocab_size=10)
    m.update([2], np.array([[3, 4]]))
    assert m.successors(2).tolist() == [3, 4, EMPTY, EMPTY]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.update([10], np.array([[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="k must be positive"):
        RecyclingMatrix(k=0)


def test_recycling_tree_has_the_chain_as_its_first_path_and_respects_breadth():
    rng = np.random.default_rng(0)
    m = RecyclingMatrix(k=4, vocab_size=50)
    m.update(np.arange(50), rng.integers(0, 50, size=(50, 4)))
    nodes = m.tree(3, [3, 2, 1])
    depth1 = [i for i, (_, p) in enumerate(nodes) if p == -1]
    assert len(depth1) == 3
    assert len(nodes) == 3 + 3 * 2 + 3 * 2 * 1
    for tok, parent in nodes:  # every child is among its parent's successors
        ptok = 3 if parent == -1 else nodes[parent][0]
        assert tok in m.successors(ptok).tolist()
    assert tree_paths(nodes)[0] == m.chain(3, 3)


def test_recycling_memory_is_fixed_whatever_the_traffic():
    m = RecyclingMatrix(k=8, vocab_size=1000)
    before = m.nbytes
    rng = np.random.default_rng(1)
    for _ in range(10_000):
        toks = rng.integers(0, 1000, size=5)
        m.update(toks, rng.integers(0, 1000, size=(5, 8)))
    assert m.nbytes == before == 1000 * 8 * 8


def test_token_recycling_asks_for_topk_and_drafts_from_what_it_observed():
    p = build("token-recycling", k=4, num_speculative_tokens=3)
    assert p.topk == 4
    p.observe_topk("r", [10, 11], np.array([[11, 1, 2, 3], [12, 1, 2, 3]]))
    p.observe_topk("r", [12], np.array([[13, 0, 0, 0]]))
    assert p.propose("r", [1, 2, 10], 8) == [11, 12, 13]
    assert p.propose("r", [1, 2, 10], 2) == [11, 12]  # max_tokens bounds it
    assert p.describe()["rows_observed"] == 3


def test_plugins_that_do_not_ask_for_topk_pay_nothing():
    for name in ("lookahead", "pooled-ngram", "noop"):
        assert build(name, **default_params(name)).topk == 0
    assert build("adaptive", proposer="lookahead").topk == 0
    assert build("adaptive", proposer="token-recycling", params={"k": 5}).topk == 5


# ------------------------------------------------------------------------------ lookahead
def test_trie_drafts_the_most_frequent_continuation_of_the_longest_suffix():
    t = TokenTrie(depth=4, max_nodes=1000)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 9], [2, 3, 7, 7], [9, 2, 3, 5]):
        t.insert(seq)
    assert t.continuation([8, 1, 2, 3], 1) == [4]  # suffix [1,2,3]: 4 (twice) beats 9
    assert t.continuation([0, 9, 2, 3], 1) == [5]  # the longest suffix wins: [9,2,3] -> 5
    assert t.continuation([0, 0, 2, 3], 1) == [7]  # only [2,3] matches: [2,3,7,7]
    # room for 2 drafts: suffixes of at most 4 - 2 = 2 tokens are tried: [2,3] -> 7, 7
    assert t.continuation([0, 9, 2, 3], 2) == [7, 7]
    assert t.continuation([0, 0, 0, 42], 3) == []


def test_trie_respects_its_node_cap_over_10000_requests_and_keeps_frequent_paths():
    rng = random.Random(0)
    p = build("lookahead", depth=6, max_nodes=5000, num_speculative_tokens=4)
    common = [7, 8, 9, 10, 11, 12, 13, 14]
    peak = 0
    for r in range(10_000):
        rid = f"req-{r}"
        seq = [rng.randrange(5000) for _ in range(rng.randrange(4, 20))] + common
        for n in range(len(seq) - len(common), len(seq) + 1):
            p.propose(rid, seq[:n], 4)
        peak = max(peak, p.trie.num_nodes)
        assert p.trie.num_nodes == _size(p.trie.root) - 1  # the counter is exact
        if r % 3:
            p.finish(rid)  # the others are "aborted" later
    assert peak <= 5000
    assert p.trie.prunes > 0
    assert p.propose("x", [1, 7, 8, 9], 4) == [10, 11, 12, 13]  # frequent path survived
    for r in range(0, 10_000, 3):
        p.finish(f"req-{r}")
    p.finish("x")
    assert len(p.progress) == 0


def test_lookahead_learns_from_other_requests_and_from_its_own_output():
    p = build("lookahead", depth=5, num_speculative_tokens=3)
    p.propose("a", [1, 2, 3, 4, 5, 6, 7], 3)
    assert p.propose("b", [9, 9, 3, 4], 3) == [5, 6, 7]  # shared across requests
    p.finish("a")
    p.finish("b")
    assert len(p.progress) == 0


def test_own_context_matches_the_longest_most_recent_suffix_and_indexes_once():
    own = OwnContext()
    seq = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    own.update(seq)
    assert own.indexed == len(seq) - 1  # the last position has no next token yet
    # suffix [1, 2, 3] occurred ending at position 2 (then 4); [2, 3] also at 6 (then 5)
    at, length = own.match(seq, longest=7)
    assert (at, length) == (2, 3) and seq[at + 1] == 4
    assert own.match(seq, longest=2) == (6, 2)  # capped at 2: the most recent [2, 3]
    assert own.match([*seq[:-1], 8], longest=7) == (-1, 0)  # 8 never seen before
    assert own.match([5, 6, 7, 0, 7], longest=7, min_match=2) == (-1, 0)  # not indexed: no pair
    grown = [*seq, 4, 9]
    own.update(grown)  # only the new positions
    assert own.indexed == len(grown) - 1 and own.pairs[(3, 4)] == [3, 12]
    assert own.match(grown, longest=7) == (4, 5)  # [1 2 3 4 9] again, at 0..4


def test_lookahead_drafts_its_own_prompt_without_inserting_it_into_the_trie():
    p = build("lookahead", depth=6, num_speculative_tokens=3)
    assert p.params.shared_prompts is False
    prompt = list(range(100, 140)) + [7, 8, 9, 10, 11, 12] + list(range(200, 240)) + [7, 8]
    assert p.propose("a", prompt, 3) == [9, 10, 11]  # from its own prompt
    assert p.trie.num_nodes <= 6  # only the window reaching the last token went in
    shared = build("lookahead", depth=6, num_speculative_tokens=3, shared_prompts=True)
    assert shared.propose("a", prompt, 3) == [9, 10, 11]
    assert shared.trie.num_nodes > 400  # every window of the prompt
    # outputs from the first draft on are shared with other requests either way
    for n in range(1, 11):
        p.propose("a", prompt + list(range(50, 60))[:n], 3)
    assert p.propose("b", [1, 50, 51], 3) == [52, 53, 54]
    p.finish("a")
    assert "a" not in p.own and len(p.progress) == 1


def test_lookahead_drafts_a_repeating_tail_as_repeating_on():
    # the latest earlier occurrence of [1 2 1 2] ends two tokens back: its continuation runs into
    # the drafts themselves (an overlapping copy), not cut after the period's two tokens
    p = build("lookahead", num_speculative_tokens=6)
    assert p.propose("a", [9, 8, 1, 2, 1, 2, 1, 2], 6) == [1, 2, 1, 2, 1, 2]
    assert p.propose("b", [9, 7, 7, 7], 5) == [7, 7, 7, 7, 7]
    # an occurrence far enough back is copied as it is
    assert p.propose("c", [4, 5, 6, 7, 8, 4, 5], 3) == [6, 7, 8]


def test_calibration_drafts_while_the_whole_draft_pays_at_this_batch_size():
    cal = Calibration(fixed_cost_tokens=64.0)  # floor B / (64 + B): 1/65 at batch 1, 1/3 at 32
    copying, guess = Calibration.kind("own", 20), Calibration.kind("trie", 1)
    assert copying == ("own", 16) and guess == ("trie", 1) and Calibration.kind("own", 9) == ("own", 8)
    for _ in range(40):  # copying: every draft accepted whole; a guess: its first token rejected
        cal.length("a", copying, 8)
        cal.observe("a", 8, 8)
        cal.length("b", guess, 8)
        cal.observe("b", 0, 4)
    assert cal.rate(copying) > 0.99 and cal.rate(guess) < 0.1
    for batch in (1, 32):
        cal.batch = batch
        assert cal.length("a", copying, 16) == 16
    cal.batch = 1
    assert cal.length("b", guess, 8) >= 1  # 0.05^1 >= 1/65
    cal.observe("b", 0, 1)
    cal.batch = 32
    assert [cal.length("b", guess, 8) for _ in range(15)] == [0] * 15
    assert cal.length("b", guess, 8) == 1  # the 16th proposal held at 0 probes one token
    cal.observe("b", 1, 1)
    # at rate q a draft of j tokens is accepted whole with chance q^j: 0.8^4 >= 1/3 > 0.8^5
    mid = Calibration.kind("trie", 4)
    cal.stats[mid] = [8.0, 2.0]  # 8 accepted, 2 rejections, and the prior's 2 at 0.5: q = 9 / 12
    q = cal.rate(mid)
    assert abs(q - 0.75) < 1e-9
    expected = max(j for j in range(9) if q**j >= 32 / 96)
    assert cal.length("c", mid, 8) == expected == 3
    cal.observe("nobody", 1, 1)  # a request with no draft on record changes nothing
    assert set(cal.stats) == {copying, guess, mid}


def test_calibrate_lookahead_stops_guessing_at_a_large_batch_and_keeps_copying():
    p = build("lookahead", num_speculative_tokens=16, calibrate=True, fixed_cost_tokens=64.0)
    body = list(range(300, 340))
    prompt = [1, 2, *body, 5, 6]
    p.begin_step(32)
    seq = [*prompt, *body[:20]]  # copying its prompt: a 20-token match
    assert p.propose("a", seq, 16) == [body[20]]  # at the prior (0.5), one token pays at batch 32
    lengths = []
    for _ in range(8):  # every draft accepted whole: the copying kind's rate climbs, drafts grow
        drafts = p.propose("a", seq, 16)
        assert drafts == body[20 : 20 + len(drafts)]
        lengths.append(len(drafts))
        p.accepted("a", len(drafts), len(drafts))
    assert lengths == sorted(lengths) and lengths[-1] == 16
    # a one-token guess (9 seen once, followed by 10) rejected every time: none at batch 32
    for i in range(12):
        d = p.propose(f"g{i}", [9, 10, 11, 12, 9], 16)
        if d:
            p.accepted(f"g{i}", 0, len(d))
    assert p.propose("h", [9, 10, 11, 12, 9], 16) == []
    q = p.calibration.rate(("own", 1))
    assert q < 1 / 3  # below batch 32's floor, 32 / (64 + 32)
    p.begin_step(1)  # at batch 1 (floor 1/65) the same guess is worth a few tokens
    expected = max(j for j in range(17) if q**j >= 1 / 65)
    assert expected >= 1 and p.propose("h", [9, 10, 11, 12, 9], 16) == [10, 11, 12, 9][:expected]
    assert "acceptance_by_match" in p.describe()
    p.finish("a")
    assert "a" not in p.calibration.pending


def test_calibrate_is_refused_with_trees_and_shared_prompts():
    params = get_registry().get(Kind.SPECULATIVE, "lookahead").registration.params
    with pytest.raises(ValidationError, match="calibrate sets chain lengths"):
        params.model_validate({"calibrate": True, "tree": True})
    with pytest.raises(ValidationError, match="shared_prompts: true .* does not apply"):
        params.model_validate({"calibrate": True, "shared_prompts": True})


def test_calibrate_lookahead_drafts_other_requests_outputs_without_the_trie():
    p = build("lookahead", num_speculative_tokens=8, calibrate=True)
    p.begin_step(1)
    out = list(range(500, 530))
    seq = [1, 2, 3]
    for t in out:  # request a generates 500..529 (its prompt: 1 2 3)
        seq.append(t)
        p.propose("a", seq, 8)
    assert p.trie.num_nodes == 0  # calibrated: nothing goes into the trie
    drafts = p.propose("b", [9, 9, 500, 501, 502], 8)  # b's text matches a's output
    assert drafts and drafts == out[3 : 3 + len(drafts)]
    assert p.calibration.pending["b"][0] == "shared"


def test_shared_outputs_match_other_requests_outputs_at_any_length_and_evict_the_finished():
    shared = SharedOutputs(max_tokens=30)
    shared.update("a", [7, 7, 7, 1])  # the first call: the output starts at its last token
    shared.update("a", [7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8])
    assert shared.texts[0] == [1, 2, 3, 4, 5, 6, 7, 8]
    candidates, length = shared.match("b", [40, 41, 2, 3, 4], longest=32)
    assert length == 3 and SharedOutputs.continuation(candidates, 3, 0.5) == [5, 6, 7]
    candidates, length = shared.match("b", [40, 1, 2, 3, 4], longest=32)  # matched in full
    assert length == 4 and candidates == [(shared.texts[0], 3)]
    assert shared.match("a", [2, 3, 4], longest=32) == ([], 0)  # its own output: not matched here
    assert shared.match("b", [3, 4], longest=32) == ([], 0)  # three tokens at least
    assert shared.match("b", [9, 9, 9], longest=32) == ([], 0)
    shared.update("b", [50, 2, 3])
    shared.finish("a")
    assert 0 in shared.texts  # 10 tokens held, within 30
    shared.update("c", [60, 100])
    shared.update("c", [60, *range(100, 140)])  # 40 output tokens
    shared.finish("c")  # over 30 tokens: the oldest finished output goes first
    assert 0 not in shared.texts and shared.size == sum(len(t) for t in shared.texts.values())
    assert shared.match("b", [2, 3, 4], longest=32) == ([], 0)  # its entries are skipped


def test_shared_outputs_draft_the_continuation_most_occurrences_agree_on():
    shared = SharedOutputs(max_tokens=1000)
    for rid, tail in (("a", [5, 6, 7]), ("b", [5, 6, 8]), ("c", [5, 9, 9]), ("d", [5, 6, 8])):
        shared.update(rid, [0, 1])
        shared.update(rid, [0, 1, 2, 3, *tail])
    candidates, length = shared.match("e", [7, 1, 2, 3], longest=32)
    assert length == 3 and len(candidates) == 4
    assert candidates[0][0] == [1, 2, 3, 5, 6, 8]  # the most recent first
    # 5: 4 of 4; 6: 3 of 4 (0.75); then 8 for two of the three left: 0.75 x 2/3 = 0.5
    assert SharedOutputs.continuation(candidates, 5, 0.5) == [5, 6, 8]
    assert SharedOutputs.continuation(candidates, 5, 0.6) == [5, 6]
    assert SharedOutputs.continuation(candidates, 1, 0.5) == [5]
    # an occurrence with nothing after it yet does not vote
    assert SharedOutputs.continuation([([1, 2], 1), ([1, 2, 4], 1)], 3, 0.9) == [4]


def test_lookahead_spec_factor_drafts_long_only_after_long_matches():
    p = build("lookahead", depth=6, num_speculative_tokens=12, spec_factor=1.0)
    body = list(range(300, 320))
    # copying: the last 10 tokens occurred before, so 10 tokens may be drafted (of 12)
    seq = [1, 2, *body, 5, 6, *body[:10]]
    assert p.propose("a", seq, 12) == body[10:20]
    # one token matched (7 seen once before): one token drafted
    assert p.propose("b", [7, 8, 9, 9, 9, 400, 7], 12) == [8]
    unlimited = build("lookahead", depth=6, num_speculative_tokens=12)
    # the occurrence's continuation runs to the end of the sequence: drafted as repeating on
    assert unlimited.propose("b", [7, 8, 9, 9, 9, 400, 7], 12) == [8, 9, 9, 9, 400, 7] * 2


def test_lookahead_min_prob_stops_drafts_where_the_trie_is_unsure():
    t = TokenTrie(depth=5, max_nodes=1000)
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7, 7]):
        t.insert(seq)
    # after [1 2]: 3 (4/4), then 4 (3/4), then 5 (2/3): path probabilities 1, 0.75, 0.5
    assert t.continuation([1, 2], 3) == [3, 4, 5]
    assert t.continuation([1, 2], 3, min_prob=0.6) == [3, 4]
    assert t.continuation([1, 2], 3, min_prob=0.8) == [3]
    # the likeliest nodes first: 3 (1), 4 (0.75), 5 (0.5), then at 0.25 the shallower 7 (after 3),
    # then 6 (after 3 4) and 7 (after 3 7), the lower token id first
    assert t.likely_tree([1, 2], 8, 3, 0.3) == ([3, 4, 5], [-1, 0, 1])  # a chain where one path dominates
    tokens, parents = t.likely_tree([1, 2], 8, 3, 0.2)
    assert tokens == [3, 4, 5, 7, 6, 7] and parents == [-1, 0, 1, 0, 1, 3]
    assert t.likely_tree([1, 2], 2, 3, 0.0) == ([3, 4], [-1, 0])  # the node budget
    assert t.likely_tree([1, 2], 8, 1, 0.0) == ([3], [-1])  # the depth limit
    assert t.likely_tree([42], 8, 3, 0.0) == ([], [])


# --------------------------------------------------------------------------- pooled n-gram
def test_pool_is_shared_by_requests_with_the_same_prompt_prefix():
    p = build("pooled-ngram", prefix_tokens=4, include_prompt=False, num_speculative_tokens=3)
    prompt = [1, 2, 3, 4, 5]
    p.propose("s0", prompt + [50], 3)  # first call: prompt = tokens[:-1]
    for n in range(7, 12):
        p.propose("s0", prompt + [50, 60, 70, 80, 90, 100][: n - 5], 3)
    # a sibling sample of the same prompt drafts the first sample's continuation
    assert p.propose("s1", prompt + [50], 3) == [60, 70, 80]
    # another prompt has its own pool: nothing to draft
    assert p.propose("t0", [9, 9, 9, 9, 5, 50], 3) == []
    assert len(p.store.pools) == 2


def test_pool_prefers_the_longest_context_and_the_most_frequent_successor():
    pool = NgramPool(max_order=3, max_contexts=100)
    for seq in ([1, 2, 3], [1, 2, 3], [5, 2, 4], [9, 2, 4], [8, 2, 4]):
        for pos in range(1, len(seq)):
            pool.add(seq, pos)
    assert pool.draft([1, 2], 1) == [3]  # context (1,2) wins over (2,) -> 4
    assert pool.draft([7, 2], 1) == [4]  # only (2,) known: 4 (3 times) beats 3 (twice)


def test_pools_stay_bounded_over_10000_requests_and_finish_releases_requests():
    rng = random.Random(1)
    store = PoolStore(prefix_tokens=8, max_order=3, max_contexts=400, max_pools=16, include_prompt=True)
    peak = 0
    for r in range(10_000):
        prompt = [rng.randrange(20)] + [rng.randrange(1000) for _ in range(10)]
        toks = prompt + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
        for n in range(len(prompt) + 1, len(toks) + 1):
            store.observe(f"r{r}", toks[:n])
        assert len(store.pools) <= 16
        assert all(len(p.table) <= 400 for p in store.pools.values())
        peak = max(peak, store.num_contexts)
        store.release(f"r{r}")
    assert peak <= 16 * 400
    assert not store.requests


# -------------------------------------------------------------------------------- adaptive
def test_goodput_speculates_at_batch_1_and_not_at_batch_32_with_middling_acceptance():
    pol = GoodputPolicy(4, fixed_cost_tokens=8, prior_acceptance=0.5)
    assert pol.best_length(0.6, 1) >= 2
    assert pol.best_length(0.6, 32) == 0
    assert pol.best_length(0.0, 1) == 0  # nothing is ever accepted: off
    assert pol.best_length(0.95, 1) == 4
    # goodput is what the formula says
    assert pol.goodput(0.5, 2, 1) == pytest.approx(1 * 1.75 / (8 + 3))


def test_best_length_is_the_argmax_of_goodput_over_every_length_ties_to_the_shorter():
    # best_length sums the expected tokens once over k; it must pick what goodput() ranks first
    pol = GoodputPolicy(16, fixed_cost_tokens=64, prior_acceptance=0.5)
    rng = random.Random(0)
    for _ in range(3000):
        a = rng.choice([0.0, 1.0, 0.5, rng.random()])
        b = rng.randint(1, 300)
        pol.c = rng.choice([0.0, 64.0, rng.random() * 500])
        ranked = max(range(pol.max_k + 1), key=lambda k: (pol.goodput(a, k, b), -k))
        assert pol.best_length(a, b) == ranked
    pol.c = 0.0  # no fixed cost: every length gives the same goodput at acceptance 1 -> the shortest
    assert pol.best_length(1.0, 4) == 0


def test_acceptance_estimate_follows_observations():
    pol = GoodputPolicy(4, fixed_cost_tokens=4, prior_acceptance=0.5)
    for _ in range(30):
        pol.observe("good", 4, 4)
        pol.observe("bad", 0, 4)
    assert pol.acceptance("good") > 0.9
    assert pol.acceptance("bad") < 0.2
    pol.begin_step(1)
    assert pol.choose("good") == 4
    assert pol.choose("bad") == 0


def test_adaptive_turns_off_under_load_probes_when_off_by_acceptance_and_releases():
    class Always(Proposer):
        def __init__(self):
            super().__init__(None)
            self.calls, self.finished = [], []

        def propose(self, request_id, token_ids, max_tokens):
            self.calls.append(max_tokens)
            return [1] * max_tokens

        def finish(self, request_id):
            self.finished.append(request_id)

    entry = get_registry().get(Kind.SPECULATIVE, "adaptive")
    params = entry.registration.params.model_validate(
        {"proposer": "lookahead", "probe_every": 4, "fixed_cost_tokens": 8, "measure_goodput": False}
    )
    inner = Always()
    a = entry.registration.load()(params, inner=inner)
    a.begin_step(32)
    assert [a.propose(f"r{i}", [1, 2], 4) for i in range(32)] == [[]] * 32  # off under load
    assert inner.calls == []
    a.begin_step(1)
    assert len(a.propose("r0", [1, 2], 4)) >= 2
    for _ in range(40):
        a.accepted("r0", 0, 4)
    drafts = [len(a.propose("r0", [1, 2], 4)) for _ in range(8)]
    assert drafts.count(0) == 6 and drafts.count(1) == 2  # a probe every 4 steps
    for i in range(32):
        a.finish(f"r{i}")
    assert not a.policy.stats and len(inner.finished) == 32


def test_adaptive_state_is_bounded_over_10000_requests():
    a = build("adaptive", proposer="lookahead", params={"max_nodes": 2000, "depth": 4})
    rng = random.Random(2)
    for r in range(10_000):
        a.begin_step(rng.choice([1, 4, 16, 32]))
        toks = [rng.randrange(300) for _ in range(6)]
        a.propose(f"r{r}", toks, 4)
        a.accepted(f"r{r}", rng.randrange(3), 2)
        a.finish(f"r{r}")
        assert a.inner.trie.num_nodes <= 2000
    assert not a.policy.stats and len(a.inner.progress) == 0


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "section, fragment",
    [
        ({"plugin": "token-recycling", "params": {"k": 0}}, "params.k"),
        ({"plugin": "token-recycling", "params": {"num_speculative_tokens": 0}}, "num_speculative_tokens"),
        ({"plugin": "lookahead", "params": {"depth": -3}}, "params.depth"),
        ({"plugin": "lookahead", "params": {"max_nodes": -1}}, "params.max_nodes"),
        ({"plugin": "lookahead", "params": {"depth": 4, "min_match": 4}}, "min_match"),
        ({"plugin": "pooled-ngram", "params": {"max_order": 0}}, "params.max_order"),
        ({"plugin": "pooled-ngram", "params": {"prefix_tokens": -5}}, "params.prefix_tokens"),
        ({"plugin": "pooled-ngram", "params": {"min_order": 3, "max_order": 2}}, "min_order"),
        ({"plugin": "adaptive", "params": {"proposer": "lookahed"}}, "unknown wrapped proposer 'lookahed'"),
        ({"plugin": "adaptive", "params": {"proposer": "adaptive"}}, "cannot wrap itself"),
        (
            {"plugin": "adaptive", "params": {"proposer": "lookahead", "params": {"depth": -1}}},
            "params of wrapped proposer 'lookahead': depth",
        ),
        (
            {"plugin": "adaptive", "params": {"proposer": "token-recycling", "params": {"k": 0}}},
            "wrapped proposer 'token-recycling': k",
        ),
        (
            {"plugin": "adaptive", "params": {"proposer": "lookahead", "num_speculative_tokens": 0}},
            "num_speculative_tokens",
        ),
        ({"plugin": "adaptive", "params": {"proposer": "lookahead", "fixed_cost_tokens": -1}}, "fixed_cost_tokens"),
        ({"plugin": "adaptive", "params": {"proposer": ""}}, "unknown wrapped proposer ''"),
    ],
)
def test_bad_parameters_are_refused_at_deployment_validation(section, fragment):
    with pytest.raises(DeploymentError) as info:
        validate({"speculative": section}, get_registry())
    assert fragment in str(info.value)


@pytest.mark.parametrize("name", NAMES)
def test_defaults_validate_and_every_plugin_is_lossless_and_registered(name):
    plan = validate({"speculative": {"plugin": name, "params": default_params(name)}}, get_registry())
    (e,) = plan.enabled
    assert e.entry.registration.capabilities.lossless
    assert isinstance(build(name, **default_params(name)), Proposer)


@pytest.mark.parametrize("name", NAMES)
def test_drafts_are_token_ids_within_max_tokens_on_random_streams(name):
    p = build(name, **default_params(name))
    rng = random.Random(3)
    vocab = 40  # small: repeats are frequent, so drafts are frequent
    drafted = 0
    for r in range(200):
        rid = f"r{r}"
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(2, 30))]
        p.begin_step(rng.choice([1, 8]))
        for step in range(10):
            if p.topk:
                p.observe_topk(rid, toks[-1:], np.array([[rng.randrange(vocab) for _ in range(p.topk)]]))
            m = rng.randrange(1, 5)
            d = p.propose(rid, toks, m)
            assert isinstance(d, list) and len(d) <= m
            assert all(isinstance(t, int) and 0 <= t < vocab for t in d)
            drafted += len(d)
            if d:
                p.accepted(rid, rng.randrange(len(d) + 1), len(d))
            toks = toks + [rng.randrange(vocab)]
        p.finish(rid)
    assert drafted > 0


def test_cost_model_is_learnt_from_step_times():
    pol = GoodputPolicy(4, fixed_cost_tokens=8, prior_acceptance=0.5, min_cost_samples=8)
    rng = random.Random(4)
    for _ in range(7):
        pol.observe_step(rng.randrange(1, 100), 0.002)
    assert pol.c == 8  # too few samples: the prior
    for _ in range(200):  # a step costs 1 ms + 0.1 ms per token: c = 10 tokens
        x = rng.randrange(1, 100)
        pol.observe_step(x, 0.001 + 0.0001 * x)
    assert pol.c == pytest.approx(10, rel=0.05)  # the first 7 samples have decayed, not gone
    pol.observe_step(50, 30.0)  # idle time between requests: ignored
    assert pol.c == pytest.approx(10, rel=0.05)  # the first 7 samples have decayed, not gone
    cheap = GoodputPolicy(4, fixed_cost_tokens=8, prior_acceptance=0.5, min_cost_samples=8)
    for _ in range(50):  # cost all per token: c -> 0, speculation only pays at high acceptance
        x = rng.randrange(1, 100)
        cheap.observe_step(x, 0.0001 * x)
    assert cheap.c == pytest.approx(0, abs=1e-6)
    assert cheap.best_length(0.6, 32) == 0 and cheap.best_length(0.6, 1) == 0
    flat = GoodputPolicy(4, fixed_cost_tokens=8, prior_acceptance=0.5, min_cost_samples=8)
    for _ in range(50):  # no spread in tokens: no fit, the prior stays
        flat.observe_step(32, 0.003)
    assert flat.c == 8


def _run_chooser(c, steps, batch, seconds, expected, tokens=None):
    """Drive a ModeChooser: each step's mode, recorded with its time (``seconds[mode]``)."""
    modes = []
    for _ in range(steps):
        m = c.choose(batch, expected() if callable(expected) else expected)
        modes.append(m)
        c.record(batch, m, seconds[m], (tokens or {}).get(m, 0))
    return modes


def test_mode_chooser_measures_each_shape_then_runs_the_best_by_cost_and_expected_tokens():
    from vllm_graft.plugins.speculative.adaptive.policy import ModeChooser

    for bad in (("chain", "chain"), ("chain", "tree"), ("chain", "off", "wide")):
        with pytest.raises(ValueError):
            ModeChooser(bad)
    with pytest.raises(ValueError, match="min_samples <= window"):
        ModeChooser(("chain", "off"), min_samples=9, window=8)  # a shape could never be measured
    c = ModeChooser(("chain", "off"), min_samples=2, retry_every=8, max_retry_every=64)
    # a chain step costs 1.5x an undrafted one: it pays when it yields more than 1.5 tokens
    modes = _run_chooser(c, 60, 8, {"chain": 0.0015, "off": 0.001}, expected=1.8)
    # each measured (the first step after a switch is not recorded), the most drafting first
    assert modes[:6] == ["chain"] * 3 + ["off"] * 3
    assert modes[6:].count("chain") > 0.75 * len(modes[6:]) and "off" in modes[6:]  # off re-measured
    # far ahead (off's goodput under retry_within of chain's): off is not re-tried
    assert _run_chooser(c, 200, 8, {"chain": 0.0015, "off": 0.001}, expected=2.5) == ["chain"] * 200
    assert c.step_seconds(8, "chain") == pytest.approx(0.0015) and c.step_seconds(1, "off") is None
    assert c.predicted(8, 2.5) == {"chain": pytest.approx(8 * 2.5 / 0.0015), "off": pytest.approx(8 / 0.001)}
    # the acceptance falls: the same measured costs now say off, at once (no re-trial needed)
    assert _run_chooser(c, 3, 8, {"chain": 0.0015, "off": 0.001}, expected=1.2) == ["off"] * 3


def test_mode_chooser_records_no_step_time_after_a_switch():
    """The first step of a shape after another carries the switch's one-off costs (a proposer
    catching up on tokens it did not see): not recorded; the tokens it yielded are."""
    from vllm_graft.plugins.speculative.adaptive.policy import ModeChooser

    c = ModeChooser(("chain", "off"), min_samples=2)
    c.record(4, "off", 0.001)
    c.record(4, "chain", 0.05, tokens=12)  # after a switch
    assert c.step_seconds(4, "chain") is None and c.yields["chain"] == [3.0, 1.0]
    c.record(4, "chain", 0.0015, tokens=8)
    assert c.step_seconds(4, "chain") == pytest.approx(0.0015)


def test_mode_chooser_shadows_while_off_and_backs_off_its_re_trials():
    """Where no drafts is best, every ``shadow_every``-th step is a shadow step (every request
    drafts, nothing is verified; recorded for no shape), at every batch size and without
    back-off, less often where a shadow step's measured extra time would exceed
    ``shadow_budget`` of the steps it watches. Re-trials only refresh a shape's cost: while they
    change nothing the wait doubles (up to the cap); a cheaper chain is found by one and kept."""
    from vllm_graft.plugins.speculative.adaptive.policy import SHADOW, ModeChooser

    for batch in (1, 32):
        c = ModeChooser(("chain", "off"), min_samples=2, retry_every=8, max_retry_every=64, shadow_every=4)
        seconds = {"chain": 0.004, "off": 0.001, SHADOW: 0.00102}  # a shadow step: 2% over an off step
        # chain's predicted goodput 3.5 / 4 ms, within retry_within of off's 1 / 1 ms: re-tried
        modes = _run_chooser(c, 600, batch, seconds, expected=3.5)
        shadows = [i for i, m in enumerate(modes) if m == SHADOW]
        assert len(shadows) > 100 and max(b - a for a, b in zip(shadows, shadows[1:])) <= 4 + 4
        assert c.shadow_wait(batch) == 4
        starts = [i for i in range(7, len(modes)) if modes[i] == "chain" and modes[i - 1] != "chain"]
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert gaps[:3] == sorted(gaps[:3]) and gaps[2] > 2 * gaps[0]  # backing off
        assert max(gaps) <= 64 + 8 and c.wait[c.bucket(batch)] == 64
        assert c.step_seconds(batch, "chain") == pytest.approx(0.004)  # shadows recorded for no shape
    seconds[SHADOW] = 0.0016  # 60% over an off step: at most 5% of the off steps' time goes to them
    modes = _run_chooser(c, 200, 32, seconds, expected=3.5)
    assert c.shadow_wait(32) == 12 and c.probe(32) == SHADOW
    shadows = [i for i, m in enumerate(modes) if m == SHADOW]
    assert min(b - a for a, b in zip(shadows[-5:], shadows[-4:])) >= 12
    seconds[SHADOW] = 0.003  # dearer still: the wait stops at max_shadow_every
    _run_chooser(c, 200, 32, seconds, expected=3.5)
    assert c.shadow_wait(32) == 16
    seconds[SHADOW] = 0.005  # dearer than a chain step: the yield is measured by a chain step
    modes = _run_chooser(c, 200, 32, seconds, expected=3.5)
    assert c.probe(32) == "chain" and c.shadow_wait(32) == 16 and SHADOW not in modes[-100:]
    # chain becomes the cheaper: the next re-trial finds it, and it is kept
    seconds["chain"] = 0.0005
    modes = _run_chooser(c, 400, 32, seconds, expected=3.5)
    assert modes[-50:].count("chain") > 45


def test_mode_chooser_yield_follows_the_shadow_steps_after_steps_off():
    """The chain's yield is measured (chain steps, shadow steps), and what was observed before
    decays per step since, whatever ran: a shadow after several steps without drafts outweighs
    the chain steps before them, so a yield that rose while nothing drafted turns chains on at
    once."""
    from vllm_graft.plugins.speculative.adaptive.policy import SHADOW, ModeChooser

    c = ModeChooser(("chain", "off"), min_samples=2, retry_every=1000, shadow_every=4)
    assert c.chain_yield() is None
    seconds = {"chain": 0.002, "off": 0.001, SHADOW: 0.001}
    modes = _run_chooser(c, 6, 8, seconds, expected=lambda: c.chain_yield() or 2.5, tokens={"chain": 12})
    assert modes[:3] == ["chain"] * 3 and c.chain_yield() == pytest.approx(1.5)  # few drafts accepted
    modes = _run_chooser(c, 12, 8, seconds, expected=lambda: c.chain_yield() or 2.5)
    assert "chain" not in modes  # off (and shadows): 1 token per request at half the cost
    c.observe_yield(3.5)  # a shadow step: drafts now match (3.5 tokens per request)
    assert c.chain_yield() > 3.0  # the chain steps of 16 steps ago weigh 0.8^16 each
    assert c.choose(8, c.chain_yield()) == "chain"  # 3.5 / 2 ms beats 1 / 1 ms
    c.forget_text()
    assert c.chain_yield() is None and c.step_seconds(8, "chain") == pytest.approx(0.002)


def test_mode_chooser_measures_no_drafting_shape_where_no_draft_pays():
    """expected = 1 (no draft is accepted): no drafting shape can win, so none is measured or
    re-tried (each would cost several slow steps); shadow steps only, and a rise in the yield
    brings the measurement."""
    from vllm_graft.plugins.speculative.adaptive.policy import SHADOW, ModeChooser

    c = ModeChooser(("tree", "chain", "off"), min_samples=2, retry_every=8, max_retry_every=8)
    seconds = {"tree": 0.006, "chain": 0.004, "off": 0.001, SHADOW: 0.0012}
    modes = _run_chooser(c, 60, 32, seconds, expected=1.0)
    assert set(modes) == {"off", SHADOW} and modes[:3] == ["off"] * 3
    assert c.step_seconds(32, "chain") is None and c.step_seconds(32, "tree") is None
    modes = _run_chooser(c, 10, 32, seconds, expected=3.0)
    assert modes[:5] == ["tree"] * 3 + ["chain"] * 2  # now measured (a chain step after a tree step is timed)


def test_mode_chooser_over_three_shapes_uses_the_measured_tree_gain():
    from vllm_graft.plugins.speculative.adaptive.policy import ModeChooser

    c = ModeChooser(("tree", "chain", "off"), min_samples=2, retry_every=6, max_retry_every=6)
    assert c.tree_gain() == 1.0  # nothing measured yet
    seconds = {"tree": 0.003, "chain": 0.002, "off": 0.001}
    # per request: a tree step yields 4 tokens, a chain step 2.5, an undrafted one 1
    modes = _run_chooser(c, 80, 4, seconds, expected=2.5, tokens={"tree": 16, "chain": 10, "off": 4})
    # a chain step after a tree step is timed (the same proposer runs: no catch-up to leave out)
    assert modes[:8] == ["tree"] * 3 + ["chain"] * 2 + ["off"] * 3
    assert c.tree_gain() == pytest.approx(4 / 2.5)
    rest = modes[8:]  # goodput per request: tree 4/3ms > chain 2.5/2ms > off 1/1ms
    assert rest.count("tree") > 0.5 * len(rest) and rest.count("chain") >= 3 and rest.count("off") >= 3
    assert sum(c.chosen.values()) == 80


def test_mode_chooser_is_not_misled_by_one_slow_step():
    """One slow step of a shape (a shape the engine meets first) among its recorded ones: the
    median of the recent step times keeps it from deciding."""
    from vllm_graft.plugins.speculative.adaptive.policy import ModeChooser

    c = ModeChooser(("chain", "off"), min_samples=3, window=8)
    times = iter([0.001, 0.05, 0.0013, 0.0013])  # chain's: the first (after no step) unrecorded

    for _ in range(8):
        m = c.choose(1, 2.0)
        c.record(1, m, next(times) if m == "chain" else 0.001)
    assert c.step_seconds(1, "chain") == pytest.approx(0.0013)
    assert c.choose(1, 2.0) == "chain"


def test_adaptive_takes_any_iterable_of_drafts_from_the_wrapped_proposer_and_cuts_it():
    """The steady chain step hands the wrapped proposer's list on as it is; a tuple or a
    generator (the adapter accepts any iterable) becomes a list, and drafts beyond the length
    asked are cut."""
    from vllm_graft.hooks import Proposer
    from vllm_graft.plugins.speculative.adaptive import AdaptiveParams
    from vllm_graft.plugins.speculative.adaptive.reference import Adaptive

    class Inner(Proposer):
        def __init__(self, shape):
            self.shape = shape

        def propose(self, request_id, token_ids, max_tokens):
            return self.shape(range(10, 10 + max_tokens + 2))  # two more than asked

    for shape in (list, tuple, iter):
        a = Adaptive(AdaptiveParams(proposer="lookahead", num_speculative_tokens=4), inner=Inner(shape))
        a._mode = "chain"
        assert a.propose("r", [1, 2, 3], 3) == [10, 11, 12]


def test_mode_chooser_with_only_the_chain_measured_keeps_drafting():
    """A step without drafts that ran but recorded nothing (every one of them had a prompt chunk,
    as under a steady flow of arrivals) leaves the chain the only measured shape once off's
    tries are spent: the chain is chosen. It used to look up the chain's goodput in a table
    holding only off's, and the engine's step failed with a KeyError."""
    from vllm_graft.plugins.speculative.adaptive.policy import ModeChooser

    c = ModeChooser(("chain", "off"), min_samples=2, window=4, retry_every=1000)
    modes = []
    for _ in range(16):
        m = c.choose(8, 3.0)
        modes.append(m)
        if m == "chain":
            c.record(8, m, 0.003, tokens=24)
    assert modes[:2] == ["chain", "chain"] and modes.count("off") == 2 * c.window  # off was tried
    assert c.step_seconds(8, "off") is None and modes[-1] == "chain"
    assert c.choose(8, 3.0) == "chain"


def test_adaptive_shadow_steps_draft_for_every_request_and_measure_what_would_have_held():
    """A shadow step asks the wrapped proposer for every request's drafts and returns none (no
    verification); at the request's next propose its drafts are compared with the tokens that
    followed: 1 + the drafts that matched is the tokens a chain would have yielded, and the
    matches count as acceptance."""
    from vllm_graft.plugins.speculative.adaptive.policy import SHADOW

    a = build("adaptive", proposer="lookahead", params={"depth": 4})
    a.bandit.choose = lambda batch, expected, min_yield=1.0: SHADOW  # every step a shadow step
    history = [1, 2, 3, 1, 2, 3, 1, 2]
    assert a.begin_step(2, 2) is True  # a shadow step needs the propose calls
    assert a.propose("copy", history, 4) == [] and a.propose("other", [9, 8, 7, 6], 4) == []
    assert a._shadows["copy"] == (8, [3, 1, 2, 3], 4) and a._shadows["other"][1] == []
    a.begin_step(2, 2)
    # "copy" went on copying (all 4 drafts held); "other" had no drafts: 1 token
    a.propose("copy", history + [3, 1, 2, 3, 1], 4)
    a.propose("other", [9, 8, 7, 6, 5], 4)
    assert a.policy.stats["copy"][0] == 4 and "other" not in a.policy.stats
    assert a._shadow_yield == [5 + 1, 2]
    a.begin_step(2, 2)
    assert a.bandit.chain_yield() == pytest.approx(3.0)
    pending = a._shadows["copy"]
    a.propose("copy", history + [3, 1, 2, 3, 1, 2, 3], 4)  # too few tokens yet for "copy"'s drafts...
    assert a._shadows["copy"] == pending and a._shadow_yield == [0.0, 0]  # ...kept, not replaced
    a.begin_step(2, 2)
    a.propose("copy", history + [3, 1, 2, 3, 1, 2, 3, 9, 9], 4)  # ...now known: 2 of 4 held
    assert a._shadow_yield == [3, 1] and a.policy.stats["copy"][1] == 1.0
    a.finish("copy")
    assert "copy" not in a._shadows


def test_adaptive_drafts_what_the_proposer_drafts_unless_per_request_lengths_are_asked():
    """With measured goodput a drafting step asks the wrapped proposer for the longest draft
    (its own length choice stands); ``per_request_length: true`` cuts each request's draft to
    the cost model's length, as ``measure_goodput: false`` does."""
    history = [1, 2, 3, 1, 2, 3, 1, 2]
    for per_request, want in ((False, 4), (True, 1)):
        a = build("adaptive", proposer="lookahead", params={"depth": 4}, per_request_length=per_request)
        a.bandit.choose = lambda batch, expected, min_yield=1.0: "chain"
        a.begin_step(32, 32)
        for _ in range(20):  # this request's drafts are mostly rejected
            a.accepted("r", 0, 4)
        a.bandit.trying = True  # a measuring step drafts at least one token
        assert a.per_request is per_request and len(a.propose("r", history, 4)) == want


def test_adaptive_says_when_a_step_drafts_nothing():
    """begin_step returns whether the step drafts (Proposer.begin_step: False spares the
    adapter the step's propose calls)."""
    a = build("adaptive", proposer="lookahead", params={"depth": 4})
    assert a.modes == ("chain", "off") and not a.drafts_trees
    a._mode = "off"
    a.bandit = None  # keep the mode as set
    assert a.begin_step(8, 8) is False and a.propose("r", [1, 2, 3, 1, 2], 3) == []
    a._mode = "chain"
    assert a.begin_step(8, 8) is True


def test_adaptive_over_a_tree_proposer_drafts_a_tree_a_chain_or_nothing_by_mode():
    """With a tree proposer (lookahead tree: true) the tree is one of the controller's modes:
    tree mode gives the wrapped tree, chain mode the wrapped chain as a one-path tree (at most
    tree_depth long: num_speculative_tokens counts nodes), off nothing."""
    a = build(
        "adaptive",
        proposer="lookahead",
        num_speculative_tokens=16,
        params={"tree": True, "tree_branches": 4, "tree_depth": 3, "depth": 6},
    )
    assert a.params.tree is True and a.drafts_trees and a.modes == ("tree", "chain", "off")
    assert a.chain_max == 3 and a.policy.max_k == 3
    a.bandit = None
    history = [5, 6, 7, 8, 5, 6, 9, 8, 5, 6, 7, 8, 5, 6, 9, 8, 5, 6]
    a.inner.propose("warm", history, 3)  # the wrapped trie learns the history
    a._mode = "tree"
    a.begin_step(1, 1)
    tokens, parents = a.propose_tree("r", history, 16)
    assert (tokens, parents) == tuple(list(x) for x in a.inner.propose_tree("r", history, 16))
    assert len(tokens) > 3 and parents != list(range(-1, len(tokens) - 1))  # branches: a real tree
    a._mode = "chain"
    tokens, parents = a.propose_tree("r", history, 16)
    assert 0 < len(tokens) <= 3 and parents == list(range(-1, len(tokens) - 1))
    assert tokens == list(a.inner.propose("r", history, len(tokens)))
    a._mode = "off"
    assert a.propose_tree("r", history, 16) == ([], [])
    b = build(
        "adaptive",
        proposer="lookahead",
        num_speculative_tokens=16,
        chain_tokens=2,
        params={"tree": True, "tree_depth": 4},
    )
    assert b.chain_max == 2


def test_adaptive_pairs_each_tree_with_its_chain_and_times_chain_only_steps_as_chains():
    """A tree's gain is measured on its own step: the tokens it gave (accepted + 1) against those
    its first path (the chain) would have, read from the tokens the step appended. A tree-mode
    step whose proposer drafted no branches is recorded as a chain step."""
    a = build(
        "adaptive",
        proposer="lookahead",
        num_speculative_tokens=16,
        params={"tree": True, "tree_branches": 4, "tree_depth": 3, "depth": 6},
    )
    history = [5, 6, 7, 8, 5, 6, 9, 8, 5, 6, 7, 8, 5, 6, 9, 8, 5, 6]
    a.inner.propose("warm", history, 3)
    a._mode = "tree"
    tokens, parents = a.propose_tree("r", history, 16)
    assert parents != list(range(-1, len(parents) - 1)) and a._real_tree
    from vllm_graft.plugins.speculative._tree import first_path

    chain = first_path(tokens, parents)[0]
    assert chain == tokens[: len(chain)] and len(chain) >= 2  # lookahead's chain is its first path
    other = next(t for t in range(100) if t != chain[1])
    a.accepted("r", 2, len(tokens))  # the tree kept 2 nodes; its chain, only the first
    a.begin_step(1, 1 + len(tokens))
    assert a._prev == (1, "tree") and not a._real_tree
    a._mode = "tree"
    a.propose_tree("r", [*history, chain[0], other, 4], 16)
    assert a.bandit.paired == [3.0, 2.0] and a.bandit.tree_gain() == pytest.approx(1.5)
    # a tree mode step with no branches anywhere: a chain step
    a.inner.fresh_drafting_state()
    a._mode, a._real_tree = "tree", False
    t2, p2 = a.propose_tree("s", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 16)
    assert p2 == list(range(-1, len(p2) - 1)) and not a._real_tree
    a.begin_step(1, 1 + len(t2))
    assert a._prev == (1, "chain")
    # a request that ends with its tree unverified leaves nothing behind
    a.inner.propose("warm", history, 3)
    a._mode = "tree"
    a.propose_tree("r", history, 16)
    assert set(a._trees) == {"r"}
    a.finish("r")
    assert not a._trees


def test_adaptive_over_a_tree_proposer_meets_the_tree_refusals_in_validation():
    doc = {
        "model": "m",
        "speculative": {"plugin": "adaptive", "params": {"proposer": "lookahead", "params": {"tree": True}}},
        "kvcompress": {"plugin": "streaming"},
    }
    with pytest.raises(DeploymentError, match="drafts trees"):
        validate(doc, get_registry())


def test_adaptive_turns_speculation_off_where_it_measures_slower(monkeypatch):
    """A step with drafts takes 2x the time of one without (measured); while no draft is kept
    that loses and adaptive runs without drafts; once the text repeats, its shadow steps see
    the drafts hold, and the same measured costs say chain (every draft kept: 4 tokens per
    request)."""
    from vllm_graft.plugins.speculative.adaptive import reference

    clock = [0.0]
    monkeypatch.setattr(reference.time, "perf_counter", lambda: clock[0])
    a = build("adaptive", proposer="lookahead", params={"depth": 4})
    rng = random.Random(0)
    texts = {f"r{r}": [rng.randrange(1000) for _ in range(8)] for r in range(8)}

    def run(steps, kept, repeat):
        chains = []
        for step in range(steps):
            chain = chains[-1] if chains else False  # the step verifies the last step's drafts
            a.begin_step(8, 8 + 8 * chain * 3)  # decode-only steps: requests + verified drafts
            chains.append(a._mode == "chain")
            for r, text in texts.items():
                # the target's tokens: new ones (no draft holds), or the text's 3-token cycle
                for _ in range(1 + (kept if chain else 0)):
                    text.append(text[-3] if repeat else rng.randrange(1000))
                if chain:
                    a.accepted(r, kept, 3)
                if a._on:
                    a.propose(r, text, 3)
            clock[0] += 0.002 if chain else 0.001
        return chains

    assert run(60, kept=0, repeat=False)[-20:].count(False) == 20
    assert "B<16|off" in a.describe()["step_ms"]
    assert run(100, kept=3, repeat=True)[-50:].count(True) >= 45
    assert {"B<16|chain", "B<16|off"} <= set(a.describe()["step_ms"])


def test_adaptive_fresh_drafting_state_keeps_what_it_measured_of_the_engine(monkeypatch):
    """Before each timed run the bench renews drafting state (no run drafts the last run's
    outputs). ``adaptive`` renews its wrapped proposer and the acceptance statistics, and
    keeps the step-cost fit and the goodput per mode, which a serving engine keeps for life:
    after a renewal it runs the mode it measured faster, without trying both again."""
    from vllm_graft.plugins.speculative.adaptive import reference

    clock = [0.0]
    monkeypatch.setattr(reference.time, "perf_counter", lambda: clock[0])
    a = build("adaptive", proposer="lookahead", params={"depth": 4})
    history = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    for step in range(60):  # as above: drafting measures slower at batch 16
        a.begin_step(16, 16 + 16 * a._on * 3)
        for r in range(16):
            if a._on:
                a.accepted(f"r{r}", 1, 3)
            a.propose(f"r{r}", history, 3)
        clock[0] += 0.003 if a._on else 0.001
    inner, bandit = a.inner, a.bandit
    inner.propose("r0", history, 3)  # the trie holds something
    assert inner.trie.num_nodes > 0 and a.policy.stats
    fit, cost = list(a.policy._fit), a.policy.c
    a.fresh_drafting_state()
    assert a.inner is inner and inner.trie.num_nodes == 0  # the wrapped trie renewed in place
    assert not a.policy.stats and a.policy.total == [0.0, 0.0]
    assert a.bandit is bandit and a.policy._fit == fit and a.policy.c == cost
    modes = []
    for step in range(5):
        clock[0] += 5.0 if step == 0 else 0.001  # the pause between runs is no step
        a.begin_step(16, 16)
        modes.append(a._mode)
    assert "chain" not in modes and "off" in modes  # no re-trial of both modes: off (and shadows), as measured
    assert a.bandit.chain_yield() is None  # the yield is the text's: renewed


# ------------------------------------------------------------------------------ tree mode
def _proposer(name, **params):
    entry = get_registry().get("speculative", name)
    return entry.registration.load()(entry.registration.params(**params))


def test_token_recycling_tree_mode_drafts_the_static_tree_within_the_node_budget():
    p = _proposer("token-recycling", k=3, tree=True, tree_breadth=[2, 1], num_speculative_tokens=8)
    assert p.drafts_trees and not _proposer("token-recycling").drafts_trees
    p.observe_topk("r", [7, 1, 2], np.array([[1, 2, 3], [4, 5, 6], [8, 9, 10]]))
    # root 7 -> 1, 2 (breadth 2); then 1 -> 4 and 2 -> 8 (breadth 1)
    assert p.propose_tree("r", [0, 7], 8) == ([1, 2, 4, 8], [-1, -1, 0, 1])
    assert p.propose_tree("r", [0, 7], 3) == ([1, 2, 4], [-1, -1, 0])
    assert p.propose_tree("r", [0, 99], 8) == ([], [])  # nothing recycled after 99
    with pytest.raises(Exception, match="tree_breadth"):
        get_registry().get("speculative", "token-recycling").registration.params(tree_breadth=[2, 0])


def test_lookahead_tree_mode_merges_continuations_sharing_a_prefix():
    # shared_prompts: the prompt's windows are in the trie, so its branches come from the prompt
    p = _proposer(
        "lookahead", tree=True, tree_branches=3, tree_depth=3, depth=4, num_speculative_tokens=16, shared_prompts=True
    )
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 6, 7, 9, 1, 2]
    tokens, parents = p.propose_tree("r", seq, 16)
    chains = [[tokens[i] for i in _path(parents, leaf)] for leaf in range(len(parents)) if leaf not in parents]
    # after "... 9 1 2" the trie saw 3 4 9 / 3 5 9 / 6 7 9: three continuations, "3" shared
    assert sorted(chains) == [[3, 4, 9], [3, 5, 9], [6, 7, 9]] and tokens.count(3) == 1
    assert p.propose_tree("r", seq, 2) == (tokens[:2], parents[:2])


def _path(parents, node):
    out = []
    while node != -1:
        out.append(node)
        node = parents[node]
    return out[::-1]
