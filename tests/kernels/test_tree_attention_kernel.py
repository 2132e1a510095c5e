"""The Triton tree-attention kernel (plugins/speculative/_tree/kernel.py) against its PyTorch
reference under TRITON_INTERPRET=1: multi-head, grouped-query and multi-query heads, contexts
that end mid-block, at a block's end or are empty, block and head sizes that are not powers of
two, a tree of more than 32 nodes (several bitmask words, bit 31 included), a cache given as
a permuted view, fp32 and fp16. Small shapes: the interpreter runs each program in NumPy. Compiled
on ``GRAFT_REAL_DEVICE`` where it is set (see tests/kernels/__init__.py)."""
from __future__ import annotations

from tests.kernels import device

DEVICE = device()  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.plugins.speculative._tree import DraftTree, ancestor_mask, tree_attention  # noqa: E402

pytest.importorskip("triton")

from vllm_graft.plugins.speculative._tree.kernel import (  # noqa: E402
    pack_ancestor_bits,
    tree_attention_triton,
)

pytestmark = pytest.mark.kernel

TREE = DraftTree.from_chains([[1, 2, 3], [1, 4], [5, 6, 7, 8], [5, 6, 9]])  # 9 nodes, depth 4


def big_tree(n: int = 40, seed: int = 0) -> DraftTree:
    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(max(-1, i - 6), i) for i in range(1, n)]  # depth grows
    return DraftTree([rng.randrange(100) for _ in range(n)], parents)


def case(tree, hq, hkv, d, bs, context_len, dtype=torch.float32, seed=0, head_major=False):
    """Random queries, a paged context in scattered blocks (unused slots of the last block hold
    garbage), the tree's own keys/values. ``head_major``: the caches are permuted views of
    ``[num_blocks, Hkv, block_size, D]`` tensors."""
    g = torch.Generator().manual_seed(seed)
    n = len(tree)
    nb = -(-context_len // bs)
    num_blocks = nb + 4
    shape = (num_blocks, hkv, bs, d) if head_major else (num_blocks, bs, hkv, d)
    k_cache, v_cache = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    if head_major:
        k_cache, v_cache = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)
    table = torch.randperm(num_blocks, generator=g)[: nb + 1].to(torch.int32)
    if context_len % bs:
        k_cache[int(table[nb - 1]), context_len % bs:] = 1e3
        v_cache[int(table[nb - 1]), context_len % bs:] = 1e3
    q = torch.randn(n, hq, d, generator=g)
    k_tree, v_tree = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    return (q.to(dtype).to(DEVICE), k_cache.to(dtype).to(DEVICE), v_cache.to(dtype).to(DEVICE),
            table.to(DEVICE), context_len, k_tree.to(dtype).to(DEVICE), v_tree.to(dtype).to(DEVICE),
            tree.parents.to(DEVICE), d ** -0.5)


@pytest.mark.parametrize("tree, hq, hkv, d, bs, context_len, head_major", [
    (TREE, 4, 2, 32, 16, 37, False),  # grouped-query, ends mid-block
    (TREE, 2, 2, 16, 8, 16, True),  # multi-head, ends at a block's end, head-major cache view
    (TREE, 4, 1, 16, 16, 0, False),  # multi-query, no context
    (TREE, 6, 2, 24, 12, 30, False),  # group of 3, block 12, head size 24: padded tiles
    (big_tree(), 4, 2, 16, 16, 21, False),  # 40 nodes: two bitmask words
])
def test_kernel_matches_the_reference_fp32(tree, hq, hkv, d, bs, context_len, head_major):
    args = case(tree, hq, hkv, d, bs, context_len, head_major=head_major)
    out = tree_attention_triton(*args)
    ref = tree_attention(*args)
    err = (out - ref).abs().max().item()
    print(f"N={len(tree)} Hq={hq} Hkv={hkv} D={d} B={bs} L={context_len}: max |diff| {err:.2e}")
    assert out.dtype == torch.float32 and err < 1e-5


def test_kernel_matches_the_reference_fp16():
    args = case(TREE, 4, 2, 16, 8, 19, dtype=torch.float16, seed=1)
    out = tree_attention_triton(*args)
    assert out.dtype == torch.float16
    assert (out.float() - tree_attention(*args).float()).abs().max().item() < 2e-3


def test_ancestor_bits_pack_the_mask():
    tree = big_tree(40, seed=2)
    mask = ancestor_mask(tree.parents)
    bits = pack_ancestor_bits(mask)
    assert bits.shape == (40, 2) and bits.dtype == torch.int32
    unpacked = ((bits.long()[:, :, None] >> torch.arange(32)) & 1).reshape(40, 64)[:, :40].bool()
    assert torch.equal(unpacked, mask)
    assert torch.equal(bits[:, 0] < 0, mask[:, 31]) and bool(mask[:, 31].any())  # bit 31: the sign


def test_launcher_reuses_given_bits_and_refuses_bad_ones():
    args = case(TREE, 4, 2, 16, 8, 9)
    bits = pack_ancestor_bits(TREE.ancestor_mask()).to(DEVICE)
    assert torch.allclose(tree_attention_triton(*args, ancestor_bits=bits), tree_attention(*args), atol=1e-5)
    with pytest.raises(ValueError, match=r"ancestor_bits must be int32 \[N, ceil\(N / 32\)\]"):
        tree_attention_triton(*args, ancestor_bits=bits.long())
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        tree_attention_triton(args[0][:, :3], *args[1:])
    with pytest.raises(ValueError, match="unit stride along the head dimension"):
        tree_attention_triton(args[0], args[1].transpose(2, 3).contiguous().transpose(2, 3), *args[2:])


# ---- the flash-decoding kernel: splits of the context, row tiles, the tree as its own split
def chain_tree(n: int) -> DraftTree:
    return DraftTree(list(range(n)), [-1] + list(range(n - 1)))


@pytest.fixture
def fine(monkeypatch):
    """Knobs that make the tiny test shapes take every path: one block per step, one block per
    split (several splits merged), 16 query rows per program (several row tiles)."""
    from vllm_graft.plugins.speculative._tree import kernel

    monkeypatch.setattr(kernel, "KEYS_PER_STEP", 16)
    monkeypatch.setattr(kernel, "MIN_KEYS_PER_SPLIT", 1)
    monkeypatch.setattr(kernel, "PROGRAMS_PER_SM", 64)
    monkeypatch.setattr(kernel, "MAX_ROWS", 16)
    return kernel


SHAPES = [  # tree, hq, hkv, d, bs, context_len
    (DraftTree([7], [-1]), 4, 2, 16, 8, 1),  # N = 1, one token of context
    (chain_tree(28), 8, 1, 16, 16, 23),  # N = 28 (not a multiple of 16), group of 8
    (big_tree(40, seed=4), 2, 2, 16, 8, 13),  # group of 1, two bitmask words
    (big_tree(33, seed=3), 1, 1, 16, 16, 18),  # N = 33: one node in the second word
]


@pytest.mark.parametrize("tree, hq, hkv, d, bs, context_len", SHAPES)
def test_more_shapes_match_the_reference(tree, hq, hkv, d, bs, context_len):
    args = case(tree, hq, hkv, d, bs, context_len, seed=5)
    assert (tree_attention_triton(*args) - tree_attention(*args)).abs().max().item() < 1e-5


@pytest.mark.parametrize("tree, hq, hkv, d, bs, context_len, head_major", [
    (big_tree(40), 4, 2, 16, 16, 37, False),  # 3 context splits, 10 row tiles
    (TREE, 6, 2, 24, 12, 30, True),  # splits of a non-power-of-two block, head-major view
    (TREE, 4, 1, 16, 16, 0, False),  # no context: the tree's split alone
])
def test_splits_and_row_tiles_merge_exactly(fine, tree, hq, hkv, d, bs, context_len, head_major):
    args = case(tree, hq, hkv, d, bs, context_len, seed=6, head_major=head_major)
    blocks = -(-context_len // bs)
    assert fine.split_plan(torch.device(DEVICE), 2, blocks, bs, 1)[0] == blocks  # one block per split
    assert (tree_attention_triton(*args) - tree_attention(*args)).abs().max().item() < 1e-5


def test_fp16_and_bf16_through_splits(fine):
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        args = case(TREE, 4, 2, 32, 16, 45, dtype=dtype, seed=7)
        out = tree_attention_triton(*args)
        assert out.dtype == dtype
        assert (out.float() - tree_attention(*args).float()).abs().max().item() < tol, dtype


def test_a_device_context_length_is_never_read_on_the_host(monkeypatch):
    args = list(case(TREE, 4, 2, 16, 16, 37))
    want = tree_attention(*args)
    bits = pack_ancestor_bits(TREE.ancestor_mask()).to(DEVICE)
    length = torch.tensor([37], device=DEVICE)

    def guard(name):
        real = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            if self is length:
                raise AssertionError(f"context_len was read on the host ({name})")
            return real(self, *a, **k)

        return read

    for name in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, guard(name))
    args[4] = length
    out = tree_attention_triton(*args, ancestor_bits=bits)
    monkeypatch.undo()
    assert (out - want).abs().max().item() < 1e-5
    # a length past the table is clamped to its width, not read out of bounds
    args[3] = args[3][:2]  # two blocks of 16: the first 32 tokens
    args[4] = torch.tensor(37, device=DEVICE)
    clamped = tree_attention(*args[:4], 32, *args[5:])
    assert (tree_attention_triton(*args, ancestor_bits=bits) - clamped).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="one-element integer tensor"):
        tree_attention_triton(*args[:4], torch.tensor([1.0]), *args[5:])


def test_split_plan_covers_the_context_within_its_limits(monkeypatch):
    from vllm_graft.plugins.speculative._tree import kernel

    cpu = torch.device("cpu")
    assert kernel.split_plan(cpu, 8, 0, 16, 4) == (0, 0)  # no context: the tree's split only
    monkeypatch.setattr(kernel, "HOST_SMS", 132)
    for programs, blocks, bs, pages in ((8, 256, 16, 4), (8, 1024, 16, 4), (16, 7, 16, 4), (1, 5000, 16, 4),
                                        (2, 33, 12, 5), (264, 256, 16, 4)):
        n, per = kernel.split_plan(cpu, programs, blocks, bs, pages)
        assert per % pages == 0 and (n - 1) * per < blocks <= n * per  # every block, no empty split
        assert 1 <= n <= kernel.MAX_SPLITS
        assert n == 1 or per * bs >= kernel.MIN_KEYS_PER_SPLIT  # a split reads enough keys
        assert n <= max(1, -(-kernel.PROGRAMS_PER_SM * 132 // programs))  # about PROGRAMS_PER_SM per SM
    assert kernel.split_plan(cpu, 8, 256, 16, 2) == (15, 18)  # ctx 4096, H_kv 8 on an H100: 15 splits of 288 keys
    assert kernel.split_plan(cpu, 8, 1 << 14, 16, 4)[0] == kernel.MAX_SPLITS
