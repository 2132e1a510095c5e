"""Routing traces, affinity placement (ExFlow) and expert caches (ExpertFlow/EdgeMoE):
property tests on random traces, and the moe-sim command on a synthetic trace. No vLLM."""
import itertools
import json
import random

import numpy as np
import pytest

from vllm_graft.hooks import MoEModel
from vllm_graft.plugins.moe.affinity_placement import Params as PlaceParams
from vllm_graft.plugins.moe._shared import StepAssembler
from vllm_graft.plugins.moe.affinity_placement import policy as P
from vllm_graft.plugins.moe.affinity_placement.reference import AffinityPlacement
from vllm_graft.plugins.moe.expert_cache import Params as CacheParams
from vllm_graft.plugins.moe.expert_cache.policy import ExpertCache, sets_from_trace, simulate
from vllm_graft.plugins.moe.expert_cache.reference import ExpertCacheScheduler
from vllm_graft.plugins.moe.route_trace.reference import Recorder, Trace, TraceError, concat


def replay(s, t):
    """Trace ``t`` step by step into MoE plugin ``s``: each layer's expert ids and weights of the step's tokens."""
    import torch

    start = 0
    for T in t.steps:
        for l in range(t.ids.shape[0]):  # the trace's rows, one per MoE layer
            s.observe(l, torch.from_numpy(t.ids[l, start:start + T].astype(np.int64)),
                      torch.from_numpy(t.weights[l, start:start + T].astype(np.float32)))
        start += T


def random_trace(seed, L=4, E=8, k=2, steps=(5, 1, 1, 7, 1), sticky=0.7, zero_share=0.0):
    """Tokens whose layer-(l+1) experts follow their layer-l experts with probability `sticky`
    (so there is affinity to find)."""
    rng = np.random.default_rng(seed)
    N = sum(steps)
    perm = [rng.permutation(E) for _ in range(L)]
    ids = np.zeros((L, N, k), dtype=np.int16)
    for n in range(N):
        first = rng.choice(E, size=k, replace=False)
        ids[0, n] = first
        for l in range(1, L):
            prev = ids[l - 1, n]
            nxt = [perm[l][e] if rng.random() < sticky else rng.integers(E) for e in prev]
            nxt = list(dict.fromkeys(int(x) for x in nxt))
            while len(nxt) < k:
                x = int(rng.integers(E))
                if x not in nxt:
                    nxt.append(x)
            ids[l, n] = nxt
    w = np.full((L, N, k), 0.5, dtype=np.float16)
    zero = rng.random((L, N)) < zero_share
    w[zero, 1] = 0
    w[zero, 0] = 1
    return Trace(ids, list(range(L)), E, np.asarray(steps), w, [("a", 0, 6), ("b", 6, N)], {})


# -------------------------------------------------------------------------------- traces
def test_trace_save_load_split_and_select(tmp_path):
    t = random_trace(0, zero_share=0.3)
    path = tmp_path / "t.npz"
    t.save(path)
    u = Trace.load(path)
    assert np.array_equal(u.ids, t.ids) and np.array_equal(u.weights, t.weights)
    assert u.segments == t.segments and list(u.steps) == [5, 1, 1, 7, 1]
    fit, held = u.split(0.5)
    assert fit.num_tokens + held.num_tokens == u.num_tokens
    assert [s[0] for s in fit.segments] == ["a", "b"] and fit.segment("b").num_tokens == 4
    assert u.segment("a").num_tokens == 6 and sum(u.select(3, 10).steps) == 7
    sets = u.token_sets()
    assert sets.sum() == u.active().sum()  # one expert per active slot
    assert concat([fit, held]).num_tokens == u.num_tokens
    with pytest.raises(TraceError, match="no segment 'c'"):
        u.segment("c")
    (tmp_path / "x.npz").write_bytes(b"no")
    with pytest.raises(TraceError, match="cannot read routing trace"):
        Trace.load(tmp_path / "x.npz")
    with pytest.raises(TraceError, match="steps sum"):
        Trace(t.ids, t.layers, 8, np.asarray([1]))


def test_recorder_and_step_assembler():
    r = Recorder(max_tokens=10)
    r.begin_segment("s")
    for T in (4, 3, 5):  # the third step would pass max_tokens: dropped whole
        for layer in (0, 1, 2):
            ids = np.full((T, 2), layer, dtype=np.int64)
            ids[:, 1] = layer + 1
            r.add(layer, ids, np.full((T, 2), 0.5, dtype=np.float32), 8)
    tr = r.trace()
    assert tr.ids.shape == (3, 7, 2) and list(tr.steps) == [4, 3] and r.dropped == 5
    assert tr.segments == [("s", 0, 7)] and (tr.ids[2] == [2, 3]).all()
    a = StepAssembler([0, 1])
    w = np.array([[0.7, 0.3], [1.0, 0.0]])
    assert a.add(0, np.array([[1, 2], [3, 4]]), w) is None
    assert a.add(1, np.array([[5, 6], [7, 0]]), w) == [[[1, 2], [5, 6]], [[3], [7]]]


# ------------------------------------------------------------------------------ placement
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("N", [1, 2, 4, 8])
def test_placements_are_balanced_partitions_and_the_optimum_is_bounded(seed, N):
    t = random_trace(seed, steps=(40,))
    A = P.affinity(t.token_sets())
    L, E = 4, 8
    sol = P.solve(A, N)
    p = sol.placement
    assert p.devices.shape == (L, E) and p.problems(E // N) == []
    for l in range(L):  # a partition: every expert on one device, E/N per device
        assert sorted(np.bincount(p.devices[l], minlength=N).tolist()) == [E // N] * N
    assert sol.lower_bound - 1e-9 <= sol.volume <= P.volume(A, P.round_robin(L, E, N)) + 1e-9
    assert sol.volume <= P.volume(A, P.linear(L, E, N)) + 1e-9
    heur = P.solve(A, N, "heuristic") if N > 1 else sol
    assert heur.placement.problems(E // N) == [] and heur.volume >= sol.volume - 1e-9  # exact is optimal


def test_exact_dp_is_optimal_by_brute_force():
    t = random_trace(3, L=3, E=4, steps=(30,))
    A = P.affinity(t.token_sets())
    parts = P._labelled_partitions(4, 2)
    best = min(P.volume(A, P.Placement(np.stack(c), 2)) for c in itertools.product(parts, repeat=3))
    assert P.solve(A, 2).volume == pytest.approx(best)
    assert P.solve(A, 4).volume == pytest.approx(min(
        P.volume(A, P.Placement(np.stack([np.arange(4), a, b]), 4))
        for a in itertools.permutations(range(4)) for b in itertools.permutations(range(4))))


def test_hungarian_matches_brute_force():
    rng = np.random.default_rng(1)
    for n in (1, 3, 5):
        c = rng.random((n, n))
        col = P.hungarian(c)
        assert sorted(col.tolist()) == list(range(n))
        best = min(sum(c[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
        assert c[np.arange(n), col].sum() == pytest.approx(best)


def test_placement_vllm_layout_round_trip(tmp_path):
    p = P.solve(P.affinity(random_trace(1, steps=(30,)).token_sets()), 4).placement
    data = p.to_vllm([0, 1, 2, 3])
    assert len(data["physical_to_logical_map"]) == 4 and len(data["expert_map"]) == 4
    for l in range(4):
        row = data["physical_to_logical_map"][l]
        assert sorted(row) == list(range(8))
        for r in range(4):  # rank r holds physical slots 2r, 2r+1 = its local experts 0, 1
            local = data["expert_map"][r][l]
            assert sorted(e for e in range(8) if local[e] >= 0) == sorted(row[2 * r:2 * r + 2])
            assert [local[e] for e in row[2 * r:2 * r + 2]] == [0, 1]
    p.save(tmp_path / "p.json", [0, 1, 2, 3])
    assert np.array_equal(P.Placement.load(tmp_path / "p.json").devices, p.devices)
    assert PlaceParams(placement_file=str(tmp_path / "p.json")).placement_file.endswith("p.json")
    with pytest.raises(ValueError, match="do not split evenly"):
        P.round_robin(4, 8, 3)


def test_live_placement_plugin_counts_what_the_policy_computes(tmp_path):
    t = random_trace(2, steps=(9, 1, 1, 1))
    P.solve(P.affinity(t.token_sets()), 4).placement.save(tmp_path / "p.json", t.layers)
    s = AffinityPlacement(PlaceParams(devices=4, placement_file=str(tmp_path / "p.json")))
    s.bind(MoEModel(4, 8, 2))
    replay(s, t)
    d = s.describe()
    A = P.affinity(t.token_sets())
    assert d["tokens"] == t.num_tokens
    assert d["transfers_round_robin"] == P.volume(A, P.round_robin(4, 8, 4))
    assert d["transfers_placement"] == P.volume(A, P.Placement.load(tmp_path / "p.json"))
    with pytest.raises(ValueError, match="do not split evenly over 3"):
        AffinityPlacement(PlaceParams(devices=3)).bind(MoEModel(4, 8, 2))
    with pytest.raises(ValueError, match="placement file is for 4 layers x 8 experts on 4 devices"):
        AffinityPlacement(PlaceParams(devices=4, placement_file=str(tmp_path / "p.json"))).bind(MoEModel(6, 8, 2))


# ---------------------------------------------------------------------------------- cache
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy, prefetch", [("lru", 0), ("lfu", 0), ("affinity", 1), ("affinity", 2), ("belady", 0)])
def test_cache_never_over_capacity_and_counts_add_up(seed, policy, prefetch):
    rng = random.Random(seed)
    E, L, k = 8, 3, 2
    C = rng.choice([2, 3, 4, 8])
    tokens = [[rng.sample(range(E), rng.choice([1, k])) for _ in range(L)] for _ in range(60)]
    cache = ExpertCache(L, E, C, policy, prefetch, future=tokens if policy == "belady" else None)
    for sets in tokens:
        cache.token(sets)
        for l in range(L):
            res = cache.resident(l)
            assert len(res) <= C and len(set(res)) == len(res)
            assert set(sets[l]) <= set(res)  # what the token needed is resident after it ran
    st = cache.stats
    assert st.accesses == sum(len(s) for t in tokens for s in t)
    assert st.hits + st.demand_loads == st.accesses
    if policy != "affinity":
        assert st.prefetch_loads == 0
    if C == E:  # everything fits: only the first use of each expert misses
        assert st.demand_loads == len({(l, e) for t in tokens for l, s in enumerate(t) for e in s})


def test_belady_is_the_best_demand_policy_and_lru_by_hand():
    rng = random.Random(5)
    tokens = [[rng.sample(range(6), 2)] for _ in range(200)]
    hits = {p: simulate(tokens, 6, 3, p).hit_rate for p in ("lru", "lfu", "belady")}
    assert hits["belady"] >= max(hits["lru"], hits["lfu"])
    # LRU by hand, capacity 2, one layer: [0,1] miss miss; [2] evicts 0; [0] evicts 1; [2] hit
    st = simulate([[[0, 1]], [[2]], [[0]], [[2]]], 4, 2, "lru")
    assert (st.accesses, st.hits, st.demand_loads) == (5, 1, 4)


def test_affinity_prefetch_predicts_a_deterministic_successor():
    # layer 1's expert is always layer 0's + 4: prefetch 1 makes layer 1 hit after warm-up
    rng = random.Random(0)
    tokens = [[[e], [e + 4]] for e in (rng.randrange(4) for _ in range(300))]
    lru = simulate(tokens, 8, 1, "lru")
    pre = simulate(tokens, 8, 1, "affinity", 1)
    assert pre.per_layer[1][1] / pre.per_layer[1][0] > 0.95 > lru.per_layer[1][1] / lru.per_layer[1][0]
    with pytest.raises(ValueError, match="capacity 9 must be in 1..8"):
        ExpertCache(2, 8, 9)
    with pytest.raises(ValueError, match="needs 3 experts in layer 0, cache capacity is 2"):
        simulate([[[0, 1, 2]]], 8, 2, "lru")


def test_live_cache_plugin_matches_the_simulation():
    t = random_trace(4, steps=(6, 1, 1, 1, 1), zero_share=0.3)
    s = ExpertCacheScheduler(CacheParams(policy="affinity", prefetch=1, expert_bytes=1000))
    s.bind(MoEModel(4, 8, 2))
    assert s.capacity == 2
    replay(s, t)
    ref = simulate(sets_from_trace(t), 8, 2, "affinity", 1)
    d = s.describe()
    assert d["hit_rate"] == round(ref.hit_rate, 4) and d["accesses"] == ref.accesses
    assert d["bytes_per_token"] == round(ref.loads * 1000 / ref.tokens, 1)
    with pytest.raises(ValueError, match="below the model's top-2"):
        ExpertCacheScheduler(CacheParams(capacity=1, policy="lru")).bind(MoEModel(4, 8, 2))
    with pytest.raises(ValueError, match="prefetch must be at least 1"):
        CacheParams(policy="affinity", prefetch=0)


# ------------------------------------------------------------------------------ moe-sim
def test_moe_sim_command(tmp_path, capsys):
    from vllm_graft.cli.main import main

    t = random_trace(7, steps=(200, 100))
    t.save(tmp_path / "t.npz")
    rc = main(["moe-sim", str(tmp_path / "t.npz"), "--devices", "2,4", "--expert-bytes", "1024",
               "--json", str(tmp_path / "r.json"), "--place-out", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "affinity placement" in out and "expert cache" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert [row["devices"] for row in r["placement"]] == [2, 4]
    for row in r["placement"]:
        assert row["lower_bound"] <= row["affinity"] + 1e-9
        assert row["reduction_vs_round_robin"] > 0  # the synthetic trace has affinity to use
    assert {c["capacity"] for c in r["cache"]} == {2, 4}
    assert P.Placement.load(tmp_path / "p.json").problems(2) == []
    assert main(["moe-sim", str(tmp_path / "t.npz"), "--devices", "3"]) == 2
    # the simulated plugins are chosen by name; one without the simulator's functions, or an
    # unknown one, is refused naming those that have them
    capsys.readouterr()
    assert main(["moe-sim", str(tmp_path / "t.npz"), "--cache", "dynamic-topk"]) == 2
    assert "moe plugins that have: expert-cache" in " ".join(capsys.readouterr().out.split())
    assert main(["moe-sim", str(tmp_path / "t.npz"), "--placement", "tova"]) == 2
    assert "no moe plugin named 'tova'; registered: " in " ".join(capsys.readouterr().out.split())


def test_calibrate_and_moe_commands_refuse_bad_arguments(tmp_path, capsys):
    from vllm_graft.tools.calibrate import METHODS
    from vllm_graft.cli.main import main

    assert list(METHODS) == ["expert-mask", "razor", "million", "xquant"] and METHODS["expert-mask"].plugin == "moe:expert-mask"
    assert METHODS["razor"].plugin == "attention:squeezed" and METHODS["million"].plugin == "kvcompress:million"
    assert main(["calibrate"]) == 2
    assert "name a calibration method: expert-mask, razor, million, xquant" in capsys.readouterr().out
    assert main(["calibrate", "expert-mask", "-a", str(tmp_path / "none.txt"), "-b", "x", "-o", "m.json"]) == 2
    (tmp_path / "a.txt").write_text("one\n---\ntwo\n")
    assert main(["calibrate", "expert-mask", "-a", str(tmp_path / "a.txt"), "-b", str(tmp_path / "a.txt"),
                 "-o", "m.json", "--top", "0"]) == 2
    from vllm_graft.tools.moe.moe_record import read_prompt_file

    assert read_prompt_file(tmp_path / "a.txt") == ["one", "two"]
    random_trace(0).save(tmp_path / "t.npz")
    assert main(["moe-sim", str(tmp_path / "t.npz"), "--fit-fraction", "1.5"]) == 2
    assert main(["moe-sim", str(tmp_path / "missing.npz")]) == 2
    assert main(["moe-trace", "d.yaml", "-o", "t.json"]) == 2  # the trace must be .npz
