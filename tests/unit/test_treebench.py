"""`vllm-graft treebench` (tools/speculative/treebench.py): the one-forward tree verification
on the bundled model (mask and positions), every arm reproducing plain greedy, the figures, and
``TokenTrie.branches``."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_graft.plugins.speculative._tree import DraftTree
from vllm_graft.plugins.speculative.lookahead.policy import TokenTrie
from vllm_graft.tools import workloads as W
from vllm_graft.tools.speculative import treebench as TB

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "graft-tiny-llama"


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return TB.load_model(MODEL)


@pytest.fixture(scope="module")
def parts():
    return TB.speculative_parts()


# ------------------------------------------------------------------------------ mask, positions
def test_tree_inputs_mask_and_positions():
    tree = DraftTree([7, 8, 9, 10], [-1, 0, -1, 1])  # 0 -> 1 -> 3, and 2
    mask, pos = TB.tree_inputs(3, 2, tree.parents, tree.depth, tree.ancestor_mask())
    assert mask.shape == (1, 1, 6, 9) and pos.shape == (1, 6)
    seen = (mask[0, 0] == 0).int().tolist()
    assert seen == [  # 3 cached | 2 pending | 4 nodes
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 1, 1, 1, 1, 0, 1],
    ]
    assert set(mask.unique().tolist()) == {0.0, float("-inf")}
    # pending at 3, 4; the context is 5 tokens long, so a node of depth d sits at 4 + d
    assert pos[0].tolist() == [3, 4, 5, 6, 5, 7]


def _path_logits(model, context, tree, i):
    path = [int(tree.tokens[j]) for j in tree.path_to(i)]
    with torch.no_grad():
        return model(input_ids=torch.tensor([context + path])).logits[0, -1]


@pytest.mark.parametrize("cached", [0, 17])
def test_one_masked_forward_scores_every_path_as_if_decoded_alone(model, cached):
    g = torch.Generator().manual_seed(cached)
    context = torch.randint(1, 4096, (25,), generator=g).tolist()
    parents = [-1, 0, 0, 1, -1, 4, 3, 2, 6, 5, 5, -1]
    tree = DraftTree(torch.randint(1, 4096, (len(parents),), generator=g), parents)
    target = TB.TreeTarget(model)
    target.start()
    if cached:
        target.forward(context[:cached], DraftTree([], []))
    logits = target.forward(context[cached:], tree)
    p = len(context) - cached
    assert logits.shape == (p + len(tree), model.config.vocab_size)
    assert target.cached == len(context) and target.cache.get_seq_length() == len(context)
    with torch.no_grad():
        root = model(input_ids=torch.tensor([context])).logits[0, -1]
    torch.testing.assert_close(logits[p - 1], root, atol=1e-4, rtol=1e-4)
    for i in range(len(tree)):
        torch.testing.assert_close(logits[p + i], _path_logits(model, context, tree, i),
                                   atol=1e-4, rtol=1e-4, msg=f"node {i}")
    # the check can fail: a plain causal pass over the flattened tree scores node 2 (node 0's
    # second child) after node 1 as well, at the wrong position
    with torch.no_grad():
        flat = model(input_ids=torch.tensor([context + tree.tokens.tolist()])).logits[0]
    assert not torch.allclose(flat[len(context) + 2], _path_logits(model, context, tree, 2), atol=1e-3)


def test_the_cache_keeps_only_the_verified_prefix(model):
    target = TB.TreeTarget(model)
    target.start()
    target.forward([5, 6, 7], DraftTree([1, 2, 3], [-1, 0, -1]))
    assert target.cached == 3 and target.cache.get_seq_length() == 3
    # the next step continues from the verified prefix as if no tree had been there
    a = target.forward([8, 9], DraftTree([4], [-1]))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 4]])).logits[0, -3:]
    torch.testing.assert_close(a, ref, atol=1e-4, rtol=1e-4)


def test_clip_depth_keeps_ancestors_and_renumbers(parts):
    tree = DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 1, -1, 3, 0])  # depths 1 2 3 1 2 2
    clipped = TB.clip_depth(parts[0], tree, 2)
    assert clipped.tokens.tolist() == [1, 2, 4, 5, 6] and clipped.parents.tolist() == [-1, 0, -1, 2, 0]
    assert len(TB.clip_depth(parts[0], tree, 0)) == 0
    assert TB.clip_depth(parts[0], tree, 3) is tree


# ------------------------------------------------------------------------------ arms
@pytest.fixture(scope="module")
def short_prompts():
    tok = W.Tokenizer.from_model(MODEL)
    (code,) = W.build(["code-completion"], tok, num_prompts=1, max_tokens=20, max_model_len=2048)
    (copy,) = W.build(["extractive"], tok, num_prompts=1, max_tokens=20, max_model_len=2048)
    return [(p.token_ids, p.max_tokens) for p in code.prompts + copy.prompts]


def test_every_arm_emits_plain_greedys_tokens(model, parts, short_prompts):
    settings = TB.Settings(chain_length=3, breadth=(3, 2, 1), k=4, branches=3, trie_depth=6)
    runs = {arm: TB.run_arm(model, parts, arm, short_prompts, settings) for arm in TB.ARMS}
    greedy = runs["greedy"]
    # the reference itself: plain greedy decoding of the whole sequence
    for (prompt, n), r in zip(short_prompts, greedy):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert r.tokens == ids[len(prompt):] and r.forwards == n
    for arm, rs in runs.items():
        f = TB.figures(rs, greedy)
        assert f["identical"] == len(short_prompts), arm
        assert f["output_tokens"] == sum(n for _, n in short_prompts)
        assert f["forwards"] == f["output_tokens"] - f["accepted"]  # each forward: accepted + 1
    # the speculative arms did verify drafts, and some were accepted
    for arm in TB.ARMS[1:]:
        assert sum(r.verify_steps for r in runs[arm]) > 0, arm
    assert sum(r.accepted for arm in TB.ARMS[1:] for r in runs[arm]) > 0
    # a tree arm verifies wider drafts than its chain
    tree = TB.figures(runs["recycling-tree"], greedy)
    chain = TB.figures(runs["recycling-chain"], greedy)
    assert tree["nodes_per_verify"] > chain["nodes_per_verify"]


def test_drafters_draft_what_the_policies_give(parts):
    s = TB.Settings(chain_length=3, breadth=(2, 2), k=2)
    d = {shape: TB.Drafter(parts, f"recycling-{shape}", s) for shape in TB.SHAPES}
    succ = {1: [2, 3], 2: [4, 5], 3: [6, 7], 4: [8, 9], 8: [1, 2]}
    for drafter in d.values():
        drafter.matrix.update(list(succ), [succ[t] for t in succ])
    assert d["chain"].draft([0, 1], 9).tokens.tolist() == [2, 4, 8]
    tree = d["tree"].draft([0, 1], 9)
    assert tree.tokens.tolist() == [2, 3, 4, 5, 6, 7] and tree.parents.tolist() == [-1, -1, 0, 0, 1, 1]
    wide = d["chain-wide"].draft([0, 1], 9)  # as many tokens as the tree has nodes
    assert wide.tokens.tolist() == [2, 4, 8, 1, 2, 4] and wide.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    # the output budget bounds the depth
    assert d["tree"].draft([0, 1], 1).tokens.tolist() == [2, 3]
    assert d["chain"].draft([0, 1], 0).tokens.tolist() == []
    # learning: the root's row and every node's row take the step's top-k
    rows = torch.zeros(3, 10)
    rows[0, [5, 6]] = torch.tensor([2.0, 1.0])
    rows[1, [7, 3]] = torch.tensor([2.0, 1.0])
    rows[2, [9, 0]] = torch.tensor([2.0, 1.0])
    d["chain"].learn(1, DraftTree([2, 3], [-1, 0]), rows)
    m = d["chain"].matrix
    assert m.successors(1).tolist() == [5, 6] and m.successors(2).tolist() == [7, 3]
    assert m.successors(3).tolist() == [9, 0]


def test_lookahead_drafter_merges_trie_branches(parts):
    s = TB.Settings(chain_length=2, branches=3, trie_depth=4)
    tree_arm = TB.Drafter(parts, "lookahead-tree", s)
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 5, 9, 1, 2]
    tree = tree_arm.draft(seq, 9)
    # windows inserted up to len - depth + 1; suffix [1, 2] then 3 (x2) / 4 / 5
    assert tree_arm.inserted == len(seq) - 4 + 1
    assert tree.tokens.tolist() == [3, 1, 4, 1, 5, 9] and tree.parents.tolist() == [-1, 0, -1, 2, -1, 4]
    chain_arm = TB.Drafter(parts, "lookahead-chain", s)
    assert chain_arm.draft(seq, 9).tokens.tolist() == [3, 1]


# ------------------------------------------------------------------------------ TokenTrie.branches
def test_trie_branches_are_the_most_frequent_paths_first():
    t = TokenTrie(depth=4, max_nodes=1000)
    for w, n in (([0, 1, 2, 3], 3), ([0, 1, 5, 6], 2), ([0, 7, 8, 9], 1), ([0, 1, 2, 4], 1)):
        for _ in range(n):
            t.insert(w)
    # suffix [0]: 1 (6x) -> 2 (4x) -> 3 (3x); branches: [0,1,5] (2x) then [0,7] / [0,1,2,4] (1x)
    assert t.continuation([9, 0], 3) == [1, 2, 3]
    assert t.branches([9, 0], 3, 1) == [[1, 2, 3]]
    assert t.branches([9, 0], 3, 2) == [[1, 2, 3], [1, 5, 6]]
    # ties at count 1: the shallower ([7]) before the deeper ([1, 2, 4])
    assert t.branches([9, 0], 3, 4) == [[1, 2, 3], [1, 5, 6], [7, 8, 9], [1, 2, 4]]
    assert t.branches([9, 0], 3, 10) == t.branches([9, 0], 3, 4)  # no more paths
    assert t.branches([9, 0], 2, 4) == [[1, 2], [1, 5], [7, 8]]  # no room for [1, 2, 4]
    assert t.branches([9, 42], 3, 4) == [] and t.branches([9, 0], 0, 4) == []
    tree = DraftTree.from_chains(t.branches([9, 0], 3, 4))
    assert tree.tokens.tolist() == [1, 2, 3, 5, 6, 7, 8, 9, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3, -1, 5, 6, 1]


# ------------------------------------------------------------------------------ figures
def test_figures_and_ratios_are_computed_as_documented():
    def run(n, forwards, verify, nodes, accepted, tokens=None):
        return TB.PromptRun(tokens or list(range(n)), forwards=forwards, steps=forwards - 1,
                            verify_steps=verify, nodes=nodes, accepted=accepted,
                            accept_hist={accepted: verify} if verify else {})

    greedy = [run(64, 64, 0, 0, 0), run(32, 32, 0, 0, 0)]
    chain = [run(64, 48, 20, 80, 16), run(32, 28, 10, 40, 4)]
    tree = [run(64, 40, 20, 560, 24), run(32, 24, 10, 280, 8, tokens=[9] * 32)]
    wide = [run(64, 44, 20, 560, 20), run(32, 26, 10, 280, 6)]
    f = TB.figures(chain, greedy)
    assert f["forwards"] == 76 and f["decode_steps"] == 74 and f["verify_steps"] == 30
    assert f["acc_per_verify"] == pytest.approx(20 / 30)
    assert f["acc_per_step"] == pytest.approx(20 / 74)
    assert f["tok_per_fwd"] == pytest.approx(96 / 76)
    assert f["nodes_per_verify"] == pytest.approx(4.0)
    assert f["identical"] == 2 and f["accept_hist"] == {4: 10, 16: 20}
    rows = {"greedy": TB.figures(greedy, None), "recycling-chain": f,
            "recycling-tree": TB.figures(tree, greedy), "recycling-chain-wide": TB.figures(wide, greedy)}
    assert rows["greedy"]["identical"] is None and rows["greedy"]["tok_per_fwd"] == 1.0
    assert rows["greedy"]["acc_per_verify"] == 0.0  # no verify steps
    assert rows["recycling-tree"]["identical"] == 1
    (r,) = TB.ratios(rows)  # no lookahead arms: one row
    assert r["proposer"] == "recycling"
    assert r["acc_per_verify_vs_chain"] == pytest.approx((32 / 30) / (20 / 30))
    assert r["tok_per_fwd_vs_chain"] == pytest.approx((96 / 64) / (96 / 76))
    assert r["acc_per_verify_vs_chain_wide"] == pytest.approx(32 / 26)
    assert r["target_met"] is True  # 1.6x >= 1.3x
    table = TB.render({"code-completion": {"arms": rows, "ratios": [r]}})
    assert "| code-completion | recycling-chain | 76 | 30 | 4.0 | 0.67 | 0.27 | 1.263 | 2/2 |" in table
    assert "| code-completion | recycling-tree | 64 | 30 | 28.0 | 1.07 | 0.52 | 1.500 | 1/2 |" in table
    assert "| code-completion | greedy | 96 | 0 | 0.0 | 0.00 | 0.00 | 1.000 | - |" in table
    assert "| code-completion | recycling | 1.60 | 1.19 | 1.23 | 1.09 | yes |" in table
    assert TB._tree_size((4, 2, 1, 1)) == 28


def test_the_command_is_registered():
    from vllm_graft.cli.main import build_parser

    args = build_parser().parse_args(["treebench", "--breadth", "3,2,1", "--num-prompts", "2"])
    assert args.breadth == (3, 2, 1) and args.num_prompts == 2 and args.max_tokens == 64
    with pytest.raises(SystemExit):
        build_parser().parse_args(["treebench", "--breadth", "3,0"])
