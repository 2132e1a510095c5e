"""The tree speculative-verification primitives (plugins/speculative/_tree): the draft tree's
construction and validation, the reference tree attention against a dense computation written
independently (context gathered token by token from the pages, ancestors found by walking the
parents), greedy verification against a brute-force search, and the losslessness of sampling
verification measured on seeded trials, with broken rules shown to fail the same check.
No engine, no Triton (the kernel is in tests/kernels/test_tree_attention_kernel.py)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from vllm_graft.plugins.speculative._tree import (
    DraftTree,
    Verdict,
    ancestor_mask,
    merge_chains,
    tree_attention,
    verify_greedy,
    verify_sampling,
)
from vllm_graft.plugins.speculative.token_recycling.policy import RecyclingMatrix, tree_paths


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(-1, i) for i in range(n)]


def walk(parents, i: int) -> list[int]:
    """Node i and its ancestors, i first."""
    out = []
    while i != -1:
        out.append(i)
        i = int(parents[i])
    return out


# ------------------------------------------------------------------------------------ the tree
def test_from_chains_merges_common_prefixes():
    tree = DraftTree.from_chains([[5, 6, 7], [5, 8], [9], [5, 6], []])
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9]
    assert tree.parents.tolist() == [-1, 0, 1, 0, -1]
    assert tree.depth.tolist() == [1, 2, 3, 2, 1]
    assert tree.children() == (0, 4) and tree.children(0) == (1, 3) and tree.children(2) == ()
    assert tree.paths() == [[0, 1, 2], [0, 3], [4]]
    assert [[int(tree.tokens[i]) for i in p] for p in tree.paths()] == [[5, 6, 7], [5, 8], [9]]
    # the same token under different parents is different nodes
    tree = DraftTree.from_chains([[1, 1], [1, 2, 1]])
    assert tree.tokens.tolist() == [1, 1, 2, 1] and tree.parents.tolist() == [-1, 0, 0, 2]


def test_from_chains_round_trips_random_chains():
    rng = random.Random(0)
    for _ in range(50):
        chains = [[rng.randrange(3) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(1, 6))]
        tree = DraftTree.from_chains(chains)
        paths = {tuple(int(tree.tokens[i]) for i in p) for p in tree.paths()}
        prefixes = {tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)}
        assert {tuple(c) for c in chains} <= prefixes  # every chain is a path from the root
        assert len(prefixes) == len(tree)  # and nodes are exactly the distinct prefixes
        for i in range(len(tree)):  # siblings carry distinct tokens
            kids = [int(tree.tokens[c]) for c in tree.children(i - 1)]
            assert len(kids) == len(set(kids))


def test_merge_chains_cut_is_the_merged_trees_first_nodes():
    """merge_chains(chains, n) (lookahead's propose_tree) is the first n nodes of from_chains'
    tree, every cut a tree (each parent before its child)."""
    rng = random.Random(1)
    for _ in range(200):
        chains = [[rng.randrange(4) for _ in range(rng.randrange(0, 6))] for _ in range(rng.randrange(0, 6))]
        tree = DraftTree.from_chains(chains)
        assert merge_chains(chains) == (tree.tokens.tolist(), tree.parents.tolist())
        n = rng.randrange(0, len(tree) + 2)
        tokens, parents = merge_chains(chains, n)
        assert (tokens, parents) == (tree.tokens[:n].tolist(), tree.parents[:n].tolist())
        assert all(-1 <= p < i for i, p in enumerate(parents))


@pytest.mark.parametrize("tokens, parents, match", [
    ([1, 2], [-1, 5], r"parents\[1\] = 5 is out of range"),
    ([1, 2], [-1, -2], r"parents\[1\] = -2 is out of range"),
    ([1], [0], r"parents\[0\] = 0 is not before node 0"),
    ([1, 2, 3], [-1, 2, 1], r"parents\[1\] = 2 is not before node 1.*topological"),
    ([1, 2], [-1], "differ in length: 2 != 1"),
    ([[1]], [[-1]], "tokens must be one-dimensional"),
    ([1], [-1.0], "parents must hold integers"),
    ([-3], [-1], "non-negative"),
])
def test_invalid_trees_are_refused_with_a_reason(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(tokens, parents)


def test_the_empty_tree_is_valid():
    tree = DraftTree([], [])
    assert len(tree) == 0 and tree.paths() == [] and tree.children() == ()
    assert tree.ancestor_mask().shape == (0, 0)
    rooted = tree.with_root(7)
    assert rooted.tokens.tolist() == [7] and rooted.parents.tolist() == [-1]
    assert verify_greedy(tree, [4]) == Verdict([], 4)
    onehot = torch.tensor([[0.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    assert verify_sampling(tree, onehot, torch.zeros(0, 3), g) == Verdict([], 2)


def test_ancestor_mask_matches_a_walk_of_the_parents():
    rng = random.Random(1)
    for n in [1, 2, 5, 17, 40]:
        parents = random_parents(rng, n)
        tree = DraftTree([rng.randrange(9) for _ in range(n)], parents)
        mask = tree.ancestor_mask()
        brute = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            brute[i, walk(parents, i)] = True
        assert torch.equal(mask, brute) and torch.equal(ancestor_mask(parents), brute)
        assert torch.equal(tree.depth, mask.sum(1))
        leaves = [i for i in range(n) if i not in parents]
        assert tree.paths() == [walk(parents, i)[::-1] for i in leaves]


def test_with_root_makes_the_root_node_zero():
    tree = DraftTree.from_chains([[5, 6, 7], [5, 8], [9]])
    rooted = tree.with_root(3)
    assert rooted.tokens.tolist() == [3, 5, 6, 7, 8, 9]
    assert rooted.parents.tolist() == [-1, 0, 1, 2, 1, 0]
    mask = rooted.ancestor_mask()
    assert mask[:, 0].all() and torch.equal(mask[1:, 1:], tree.ancestor_mask())
    assert torch.equal(rooted.depth[1:], tree.depth + 1)


def test_from_nodes_reads_token_recycling_trees():
    m = RecyclingMatrix(k=3, vocab_size=16)
    m.update([3, 4, 7, 9], np.array([[4, 7, 9], [5, 6, 1], [8, 2, 0], [10, 11, 12]]))
    nodes = m.tree(3, [3, 2, 1])
    tree = DraftTree.from_nodes(nodes)
    assert [[int(tree.tokens[i]) for i in p] for p in tree.paths()] == tree_paths(nodes)


# ------------------------------------------------------------------------ reference attention
TREE = DraftTree.from_chains([[1, 2, 3], [1, 4], [5, 6, 7, 8], [5, 6, 9]])  # 9 nodes, depth 4


def paged_tree_case(tree, hq, hkv, d, bs, context_len, dtype=torch.float32, seed=0):
    """Random queries, a paged context in scattered blocks (the partial last block's unused
    slots and the spare table entries point at garbage) and the tree's own keys/values."""
    g = torch.Generator().manual_seed(seed)
    n = len(tree)
    nb = -(-context_len // bs)
    num_blocks = nb + 5
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    table = torch.randperm(num_blocks, generator=g)[: nb + 2].to(torch.int32)
    if context_len % bs:  # slots past the context in its last block: must be ignored
        last = int(table[nb - 1])
        k_cache[last, context_len % bs:] = 1e4
        v_cache[last, context_len % bs:] = 1e4
    q = torch.randn(n, hq, d, generator=g)
    k_tree = torch.randn(n, hkv, d, generator=g)
    v_tree = torch.randn(n, hkv, d, generator=g)
    return tuple(t.to(dtype) for t in (q, k_cache, v_cache)) + (table, context_len) + \
        tuple(t.to(dtype) for t in (k_tree, v_tree)) + (tree.parents, d ** -0.5)


def dense_tree_attention(q, k_cache, v_cache, table, context_len, k_tree, v_tree, parents, scale):
    """The same attention, written differently: per node, the list of keys/values it may see
    (context token by token, then its ancestors root first); per head, an explicit softmax in
    float64."""
    n, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    ctx = [(int(table[t // bs]), t % bs) for t in range(context_len)]
    out = torch.empty(n, hq, d, dtype=torch.float64)
    for i in range(n):
        nodes = walk(parents, i)[::-1]
        keys = torch.stack([k_cache[b, s] for b, s in ctx] + [k_tree[j] for j in nodes]).double()
        vals = torch.stack([v_cache[b, s] for b, s in ctx] + [v_tree[j] for j in nodes]).double()
        for h in range(hq):
            kvh = h // (hq // hkv)
            s = keys[:, kvh] @ q[i, h].double() * scale
            w = torch.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ vals[:, kvh]
    return out


@pytest.mark.parametrize("hq, hkv, d, bs, context_len", [
    (4, 4, 16, 8, 24),  # multi-head, the context ends at a block's end
    (6, 2, 16, 8, 21),  # grouped-query, the context ends mid-block
    (4, 1, 8, 4, 13),  # multi-query
    (8, 2, 32, 16, 0),  # no context: the tree only
])
def test_reference_tree_attention_matches_a_dense_computation(hq, hkv, d, bs, context_len):
    case = paged_tree_case(TREE, hq, hkv, d, bs, context_len)
    out = tree_attention(*case)
    assert out.shape == (len(TREE), hq, d) and out.dtype == torch.float32
    err = (out.double() - dense_tree_attention(*case)).abs().max().item()
    assert err < 1e-5, err


def test_reference_tree_attention_in_half_precision_returns_half():
    case = paged_tree_case(TREE, 4, 2, 16, 8, 19, dtype=torch.float16, seed=3)
    out = tree_attention(*case)
    assert out.dtype == torch.float16
    assert (out.double() - dense_tree_attention(*case)).abs().max().item() < 2e-3


def test_a_chain_tree_is_causal_attention_over_context_and_chain():
    # the last node of a chain sees everything: plain attention over context + chain
    chain = DraftTree.from_chains([[4, 5, 6]])
    q, kc, vc, table, L, kt, vt, parents, scale = paged_tree_case(chain, 2, 2, 8, 4, 10, seed=5)
    out = tree_attention(q, kc, vc, table, L, kt, vt, parents, scale)
    keys = torch.cat([kc[table[:3].long()].reshape(12, 2, 8)[:10], kt])
    vals = torch.cat([vc[table[:3].long()].reshape(12, 2, 8)[:10], vt])
    for h in range(2):
        p = torch.softmax(keys[:, h] @ q[2, h] * scale, 0)
        assert torch.allclose(out[2, h], p @ vals[:, h], atol=1e-5)


@pytest.mark.parametrize("change, match", [
    (lambda c: {0: c[0][:, :3]}, "multiple of the kv heads"),
    (lambda c: {3: c[3][:1]}, "block_table must be 1-D with at least 3 entries"),
    (lambda c: {5: c[5][:2]}, r"k_tree must be \[N, Hkv, D\]"),
    (lambda c: {7: c[7][:2]}, r"parents must be \[N\]"),
])
def test_reference_refuses_mismatched_shapes(change, match):
    case = list(paged_tree_case(TREE, 4, 2, 8, 8, 20))
    for i, v in change(case).items():
        case[i] = v
    with pytest.raises(ValueError, match=match):
        tree_attention(*case)


# -------------------------------------------------------------------------------- greedy verify
def test_verify_greedy_on_hand_built_trees():
    tree = DraftTree.from_chains([[5, 6, 7], [5, 8], [9]])  # 0:5 1:6 2:7 3:8 4:9
    #                          root 0  1  2  3  4
    assert verify_greedy(tree, [5, 8, 0, 0, 3, 0]) == Verdict([0, 3], 3)
    assert verify_greedy(tree, [5, 6, 7, 2, 0, 0]) == Verdict([0, 1, 2], 2)  # a whole path + bonus
    assert verify_greedy(tree, [9, 6, 7, 2, 0, 4]) == Verdict([4], 4)
    assert verify_greedy(tree, [1, 6, 7, 2, 0, 4]) == Verdict([], 1)  # nothing: the bonus only
    assert verify_greedy(tree, [5, 1, 7, 2, 0, 4]).tokens(tree) == [5, 1]
    assert verify_greedy(tree, torch.tensor([5, 6, 1, 2, 0, 4])) == Verdict([0, 1], 1)


def test_verify_greedy_ties_between_siblings():
    # equal siblings, equally long continuations: the first child in index order
    tree = DraftTree([5, 5], [-1, -1])
    assert verify_greedy(tree, [5, 1, 2]) == Verdict([0], 1)
    tree = DraftTree([5, 5, 6, 6], [-1, -1, 0, 1])
    assert verify_greedy(tree, [5, 6, 6, 0, 0]) == Verdict([0, 2], 0)
    # the second copy continues further: the longest correct path wins
    tree = DraftTree([5, 5, 6], [-1, -1, 1])
    assert verify_greedy(tree, [5, 9, 6, 3]) == Verdict([1, 2], 3)


def test_verify_greedy_matches_a_brute_force_search():
    rng = random.Random(2)
    for _ in range(300):
        n = rng.randrange(0, 12)
        parents = random_parents(rng, n)
        tokens = [rng.randrange(3) for _ in range(n)]  # few tokens: duplicate siblings and ties
        target = [rng.randrange(3) for _ in range(n + 1)]
        tree = DraftTree(tokens, parents)
        # every path whose nodes all equal the target's argmax after their parent; the
        # longest, then the first in index order
        ok = [p for p in [[]] + [walk(parents, i)[::-1] for i in range(n)]
              if all(tokens[j] == target[parents[j] + 1] for j in p)]
        best = min(ok, key=lambda p: (-len(p), p))
        assert verify_greedy(tree, target) == Verdict(best, target[best[-1] + 1 if best else 0])


def test_verify_greedy_refuses_a_wrong_length():
    with pytest.raises(ValueError, match="N \\+ 1 = 3 entries, got 2"):
        verify_greedy(DraftTree([1, 2], [-1, 0]), [1, 2])


# ------------------------------------------------------------------------------ sampling verify
def test_verify_sampling_with_one_hot_targets_is_greedy():
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    for _ in range(100):
        chains = [[rng.randrange(4) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(1, 5))]
        tree = DraftTree.from_chains(chains)  # distinct siblings
        target = [rng.randrange(4) for _ in range(len(tree) + 1)]
        draft = torch.rand(len(tree), 4, generator=g) + 0.01
        assert verify_sampling(tree, torch.eye(4)[target], draft, g) == verify_greedy(tree, target)


def test_verify_sampling_refuses_mismatched_shapes():
    tree = DraftTree([1, 2], [-1, 0])
    with pytest.raises(ValueError, match=r"target_probs must be \[N \+ 1, V\]"):
        verify_sampling(tree, torch.rand(2, 4), torch.rand(2, 4))
    with pytest.raises(ValueError, match=r"draft_probs must be \[N, V\]"):
        verify_sampling(tree, torch.rand(3, 4), torch.rand(2, 5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_sampling(tree, torch.rand(3, 2), torch.rand(2, 2))


V = 5
PARENTS = [-1, -1, -1, 0, 0, 1, 1, 2, 2]  # three children at the root, two under each: depth 2


def _dists(g, *shape):
    """Random distributions over V tokens, each probability >= 0.04 (so every expected count of
    the chi-square tests below is in the hundreds)."""
    return 0.8 * torch.softmax(1.5 * torch.randn(*shape, V, generator=g), -1) + 0.2 / V


def draft_trials(trials: int, deterministic: bool, seed: int = 0):
    """``trials`` verify steps of one tree shape: the target's distributions depend on the token
    path (``p0`` at the root, ``p1[a]`` after token ``a``, ``p2[a, b]`` after ``a, b``), and each
    node's token is drawn from its own draft distribution: sampled (``q0[k]`` for the root's
    k-th child, ``q1[a, j]`` for the j-th child of a node with token ``a``), or deterministic
    (the top tokens of those distributions, with one-hot draft probabilities)."""
    g = torch.Generator().manual_seed(seed)
    p0, p1, p2 = _dists(g), _dists(g, V), _dists(g, V, V)
    q0, q1 = _dists(g, 3), _dists(g, V, 2)
    if deterministic:
        top0 = torch.argsort(q0[0], descending=True)[:3]  # the root's three children
        top1 = torch.argsort(q1[:, 0], dim=-1, descending=True)[:, :2]  # [V, 2]: after token a
        t1, t2 = top0.expand(trials, 3), top1[top0].expand(trials, 3, 2)
        q0, q1 = torch.eye(V)[top0], torch.eye(V)[top1]
    else:
        t1 = torch.stack([torch.multinomial(q0[k], trials, replacement=True, generator=g)
                          for k in range(3)], 1)
        t2 = torch.stack([torch.stack([torch.multinomial(q1[t1[:, k], j], 1, generator=g)[:, 0]
                                       for j in range(2)], 1) for k in range(3)], 1)
    tokens = torch.cat([t1, t2.reshape(trials, 6)], 1)
    target = torch.cat([p0.expand(trials, 1, V), p1[t1],
                        p2[t1[:, :, None].expand(-1, -1, 2), t2].reshape(trials, 6, V)], 1)
    draft = torch.cat([q0.expand(trials, 3, V), q1[t1[:, :, None], torch.arange(2)].reshape(trials, 6, V)], 1)
    return tokens, target, draft, p0, p1


def run_trials(verifier, tokens, target, draft, seed: int = 1):
    """(first emitted token [T], (first token, second token) of the trials that accepted a node)."""
    g = torch.Generator().manual_seed(seed)
    first, pairs = [], []
    for t in range(tokens.shape[0]):
        tree = DraftTree(tokens[t], PARENTS)
        verdict = verifier(tree, target[t], draft[t], g)
        out = verdict.tokens(tree)
        first.append(out[0])
        if verdict.accepted:
            pairs.append((out[0], out[1]))
    return torch.tensor(first), torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs.double()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def chi_square_limit(dof: int, z: float = 3.719) -> float:
    """The chi-square quantile at upper-tail probability 1e-4 (z = 3.719 standard deviations),
    by the Wilson-Hilferty approximation: a correct rule exceeds it once in 10,000 seeds."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def losslessness(first, pairs, p0, p1) -> tuple[float, float, float, float]:
    """(chi-square of the first emitted token against p0, its limit, chi-square of the second
    token given the first against p1[first] over the trials that accepted a node, its limit)."""
    c0 = torch.bincount(first, minlength=V)
    second, dof = 0.0, 0
    for a in range(V):
        rows = pairs[pairs[:, 0] == a, 1]
        if rows.numel() >= 100:
            second += chi_square(torch.bincount(rows, minlength=V), p1[a])
            dof += V - 1
    return chi_square(c0, p0), chi_square_limit(V - 1), second, chi_square_limit(max(dof, 1))


def accept_always(tree, target_probs, draft_probs, generator):
    """A broken rule: follow the first child to a leaf, then sample the bonus."""
    node, accepted = -1, []
    while tree.children(node):
        node = tree.children(node)[0]
        accepted.append(node)
    return Verdict(accepted, int(torch.multinomial(target_probs[node + 1], 1, generator=generator)))


def no_residual(tree, target_probs, draft_probs, generator):
    """A subtly broken rule: after a rejection the next child is tested against the unchanged
    target distribution instead of the residual max(p - q, 0)."""
    node, accepted = -1, []
    while True:
        p = target_probs[node + 1].double()
        for c in tree.children(node):
            x = int(tree.tokens[c])
            if float(torch.rand((), generator=generator)) * float(draft_probs[c, x]) < float(p[x]):
                node = c
                accepted.append(c)
                break
        else:
            return Verdict(accepted, int(torch.multinomial(p, 1, generator=generator)))


@pytest.mark.parametrize("deterministic, trials", [(False, 20000), (True, 10000)])
def test_verify_sampling_is_lossless(deterministic, trials):
    tokens, target, draft, p0, p1 = draft_trials(trials, deterministic)
    first, pairs = run_trials(verify_sampling, tokens, target, draft)
    x0, lim0, x1, lim1 = losslessness(first, pairs, p0, p1)
    tv = 0.5 * float((torch.bincount(first, minlength=V) / trials - p0).abs().sum())
    print(f"{'deterministic' if deterministic else 'sampled'} drafts, {trials} trials: first token "
          f"chi2 {x0:.1f} (limit {lim0:.1f}, TV {tv:.4f}); second given first chi2 {x1:.1f} "
          f"(limit {lim1:.1f}); {pairs.shape[0]} trials accepted a node")
    assert x0 < lim0 and x1 < lim1
    assert pairs.shape[0] > trials // 10  # the check of the second token had data
    # the same check catches broken rules, already on 2,000 trials: accepting every draft
    # token, and forgetting the residual after a rejection
    for broken in (accept_always, no_residual):
        bad = losslessness(*run_trials(broken, tokens[:2000], target[:2000], draft[:2000]), p0, p1)
        print(f"  {broken.__name__}: first token chi2 {bad[0]:.1f}, second given first {bad[2]:.1f}")
        assert bad[0] > lim0


def test_verify_sampling_draws_on_the_generators_device(monkeypatch):
    """vLLM's per-request generators are CUDA generators on CUDA: every draw is asked on the
    generator's device (a CPU draw with a CUDA generator raises)."""

    class Gen:  # stands in for a torch.Generator on another device
        device = torch.device("meta")

    asked = []
    real_rand = torch.rand

    def rand(*a, generator=None, device=None, **k):
        asked.append(("rand", device))
        return real_rand(*a, **k).fill_(0.99)  # rejects every node: the bonus is drawn

    def multinomial(p, n, generator=None):
        asked.append(("multinomial", p.device))
        return torch.zeros(n, dtype=torch.long)

    monkeypatch.setattr(torch, "rand", rand)
    monkeypatch.setattr(torch, "multinomial", multinomial)
    tree = DraftTree([1, 2], [-1, 0])
    target = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 3)
    verify_sampling(tree, target, torch.full((2, 4), 0.25), Gen())
    assert [k for k, _ in asked] == ["rand", "multinomial"]
    assert all(dev == torch.device("meta") for _, dev in asked)
