"""hydragen: the shared-prefix planner (property tests on random block-table trees) and the
PyTorch reference against plain paged attention."""
from __future__ import annotations

import random

import pytest
import torch

from vllm_graft.hooks import AttentionLayer, PagedBatch
from vllm_graft.plugins.attention.hydragen import HydragenParams
from vllm_graft.plugins.attention.hydragen.policy import (
    check_plan,
    eligible_blocks,
    kv_bytes_read,
    plan_prefixes,
)
from vllm_graft.plugins.attention._shared import paged_attention
from vllm_graft.plugins.attention.hydragen.reference import Hydragen


def random_tree_batch(rng: random.Random, block_size: int, max_seqs: int = 12):
    """Block-table rows grown as a random tree (a shared root, sub-groups, leaves), with
    random query lengths and garbage (other sequences' ids) past each row's end."""
    next_id = iter(range(10_000))
    rows: list[list[int]] = []

    def grow(prefix: list[int], n_seqs: int) -> None:
        run = prefix + [next(next_id) for _ in range(rng.randint(0, 4))]
        if n_seqs == 1 or rng.random() < 0.25:
            for _ in range(n_seqs):
                rows.append(run + [next(next_id) for _ in range(rng.randint(0, 3))])
            return
        k = rng.randint(1, min(n_seqs, 4))
        cuts = sorted(rng.sample(range(1, n_seqs), k - 1)) if k > 1 else []
        for a, b in zip([0, *cuts], [*cuts, n_seqs]):
            grow(run, b - a)

    for _ in range(rng.randint(1, 3)):  # a few independent trees (no sharing between them)
        grow([], rng.randint(1, max_seqs))
    rng.shuffle(rows)
    seq_lens, q_lens = [], []
    for r in rows:
        if not r:
            r.append(next(next_id))
        n = (len(r) - 1) * block_size + rng.randint(1, block_size)
        q = rng.choice([0, 1, 1, 1, 2, min(n, block_size + 3), n])
        seq_lens.append(n)
        q_lens.append(min(q, n))
    width = max(len(r) for r in rows) + 2
    padded = [r + [rng.choice(rows[0]) for _ in range(width - len(r))] for r in rows]
    return padded, seq_lens, q_lens


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(200))
def test_plan_is_the_maximal_sharing_tree(seed):
    rng = random.Random(seed)
    bs = rng.choice([16, 32])
    rows, seq_lens, q_lens = random_tree_batch(rng, bs)
    plan = plan_prefixes(rows, seq_lens, q_lens, bs)
    check_plan(plan, rows, seq_lens, q_lens)
    own = [r[:eligible_blocks(n, q, bs)] if q else [] for r, n, q in zip(rows, seq_lens, q_lens)]
    member = {}
    for g in plan.groups:
        for s in g.seqs:
            member.setdefault(s, []).append(g)
    n = len(rows)
    for s in range(n):
        for t in range(n):
            if s == t:
                continue
            common = sum(len(g.blocks) for g in member.get(s, []) if t in g.seqs)
            # two sequences share exactly their common eligible prefix, read once for both
            assert common == lcp(own[s], own[t]), (s, t)
        best = max((lcp(own[s], own[t]) for t in range(n) if t != s), default=0)
        assert plan.suffix_start[s] == best  # nothing shared is left in a suffix


def test_plan_tree_of_system_prompt_few_shot_and_samples():
    bs = 16
    system = [1, 2, 3]
    shots = {0: [10, 11], 1: [20]}
    rows, seq_lens, q_lens = [], [], []
    for p in (0, 1):  # two prompts sharing the system prompt, each with its few-shot examples
        for sample in range(3):  # n=3 samples of each prompt: own decode blocks
            rows.append(system + shots[p] + [100 + 10 * p + sample])
            seq_lens.append(len(rows[-1]) * bs - 5)
            q_lens.append(1)
    plan = plan_prefixes(rows, seq_lens, q_lens, bs)
    assert [(g.seqs, g.blocks, g.level) for g in plan.groups] == [
        ((0, 1, 2, 3, 4, 5), (1, 2, 3), 0), ((0, 1, 2), (10, 11), 1), ((3, 4, 5), (20,), 1)]
    assert plan.depth == 2 and plan.suffix_start == (5, 5, 5, 4, 4, 4)
    plain, read = kv_bytes_read(plan, seq_lens, 1)
    assert plain == sum(seq_lens) and read == 3 * bs + 2 * bs + bs + sum(seq_lens) - 3 * 5 * bs - 3 * 4 * bs


def test_plan_never_groups_blocks_holding_new_tokens():
    bs = 16
    rows = [[7, 8, 9], [7, 8, 9]]  # same blocks, but the second block holds seq 1's new tokens
    plan = plan_prefixes(rows, [40, 40], [1, 20], bs)
    assert [g.blocks for g in plan.groups] == [(7,)]  # only block 7 precedes token 20 of seq 1
    assert plan_prefixes(rows, [40, 40], [1, 30], bs).groups == ()  # block 7 holds token 10
    assert plan_prefixes(rows, [40, 40], [40, 40], bs).groups == ()  # a prefill: nothing cached


def test_plan_options_and_bad_values():
    rows = [[1, 2, 9], [1, 2, 8], [1, 5, 6]]
    seq_lens, q_lens = [40, 40, 40], [1, 1, 1]
    assert [g.blocks for g in plan_prefixes(rows, seq_lens, q_lens, 16, min_group=3).groups] == [(1,)]
    assert [g.blocks for g in plan_prefixes(rows, seq_lens, q_lens, 16, min_blocks=2).groups] == []
    with pytest.raises(ValueError, match="min_group"):
        plan_prefixes(rows, seq_lens, q_lens, 16, min_group=1)
    with pytest.raises(ValueError, match="one each per sequence"):
        plan_prefixes(rows, seq_lens[:2], q_lens, 16)
    with pytest.raises(ValueError, match="min_group"):
        HydragenParams(min_group=1)
    with pytest.raises(ValueError, match="kernel"):
        HydragenParams(kernel="cuda")


def paged_case(seed: int, dtype: torch.dtype, h: int, hkv: int, d: int, bs: int):
    rng = random.Random(seed)
    rows, seq_lens, q_lens = random_tree_batch(rng, bs, max_seqs=6)
    ids = sorted({b for r in rows for b in r})
    remap = {b: i for i, b in enumerate(ids)}
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(ids), generator=g).tolist()
    table = torch.tensor([[perm[remap[b]] for b in r] for r in rows], dtype=torch.int32)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    batch = PagedBatch(torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), table)
    kv = torch.randn(len(ids), hkv, bs, 2 * d, generator=g).to(dtype)
    q = torch.randn(qsl[-1], h, d, generator=g).to(dtype)
    return q, kv, batch, AttentionLayer(h, hkv, d, d ** -0.5, bs)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_equals_plain_paged_attention(seed, dtype):
    h, hkv, d, bs = [(4, 2, 64, 16), (8, 2, 128, 32), (4, 4, 64, 32)][seed % 3]
    q, kv, batch, layer = paged_case(seed, dtype, h, hkv, d, bs)
    m = Hydragen(HydragenParams())
    out = m.forward(q, kv, batch, layer, m.plan(batch))
    ref = paged_attention(q, kv, batch, layer)
    err = (out.float() - ref.float()).abs().max().item() if q.numel() else 0.0
    print(f"seed {seed} {dtype} H={h} Hkv={hkv} D={d} block={bs}: max|err| {err:.2e}, {m.describe()}")
    assert out.dtype == q.dtype and out.shape == q.shape
    assert err <= (2e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batched_cpu_path_equals_the_per_sequence_reference(seed, dtype, monkeypatch):
    """The CPU path (padded suffix calls, fused attention with log-sum-exp) against the loop
    form, on random sharing trees with decode, verify and prefill rows; every third seed with
    the mask limit so low that each short sequence gets its own call."""
    from vllm_graft.plugins.attention.hydragen import reference

    if seed % 3 == 2:
        monkeypatch.setattr(reference, "SUFFIX_MASK_MAX", 1)
    h, hkv, d, bs = [(4, 2, 64, 16), (8, 2, 128, 32), (4, 4, 64, 32)][seed % 3]
    q, kv, batch, layer = paged_case(seed + 100, dtype, h, hkv, d, bs)
    m = Hydragen(HydragenParams())
    plan = m.plan(batch)
    fast = reference.hydragen_attention_batched(q, kv, batch, layer, plan)
    again = reference.hydragen_attention_batched(q, kv, batch, layer, plan)  # the next layer: indices reused
    assert len([k for k in plan.cache if k[0] == "batched"]) == 1
    slow = reference.hydragen_attention(q, kv, batch, layer, plan)
    assert fast.dtype == q.dtype and fast.shape == q.shape
    assert torch.equal(fast, again)
    err = (fast.float() - slow.float()).abs().max().item() if q.numel() else 0.0
    assert err <= (1e-5 if dtype == torch.float32 else 2e-3), err
    if q.numel():  # the forward's CPU route is the batched path
        assert torch.equal(m.forward(q, kv, batch, layer, plan), fast)


def test_attention_bytes_ratio_approaches_the_batch_size():
    from vllm_graft.tools.attention.attention_bytes import hydragen_rows

    for batch in (8, 32, 128):
        for prefix in (1024, 4096):
            first = hydragen_rows(batch, prefix, 0, 16, 1)
            later = hydragen_rows(batch, prefix, 256, 16, 1)
            assert first["groups"] == 1 and first["plain_bytes"] == batch * (prefix + 1)
            assert 0.85 * batch < first["ratio"] <= batch  # prefix read once, one token each
            assert 1 < later["ratio"] < first["ratio"]  # own tokens are read per sequence
    tree = hydragen_rows(32, 1024, 256, 16, 1, samples=8)
    assert tree["depth"] == 2 and tree["groups"] == 5 and tree["ratio"] > hydragen_rows(32, 1024, 256, 16, 1)["ratio"]


def test_attention_bytes_command(capsys):
    import json

    from vllm_graft.cli.main import main

    assert main(["attention-bytes", "--batch", "8", "--prefix", "1024", "--suffix", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"][0]["batch"] == 8 and out["rows"][0]["ratio"] > 7.5
