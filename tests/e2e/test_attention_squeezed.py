"""squeezed in vLLM's CPU engine: at full budget it gives plain vLLM's greedy tokens (the route
is exact); at a quarter of the context, decode tokens attend sparsely (KV read well below
plain) and with refresh 8 the choice made at a refresh position is reused for the same
request in later steps; mode recycled likewise reuses what its full steps chose."""
from __future__ import annotations

import pytest

from .engines import long_context  # first: the in-process engine's environment, before vLLM is imported

pytestmark = pytest.mark.e2e

ENGINE = {"dtype": "float32", "max_model_len": 1024, "block_size": 32, "enforce_eager": True}
NEW_TOKENS = 24


def _run(params: dict | None) -> dict:
    return long_context("squeezed", params, ENGINE, NEW_TOKENS)


@pytest.fixture(scope="module")
def runs():
    return {"plain": _run(None), "full": _run({"budget": 1.0}),
            "sparse": _run({"budget": 0.25, "refresh": 8, "sink_tokens": 16, "recent_tokens": 64}),
            "recycled": _run({"mode": "recycled", "budget": 0.25, "refresh": 8, "sink_tokens": 16,
                              "recent_tokens": 64})}


def test_full_budget_gives_plain_tokens(runs):
    assert runs["full"]["tokens"] == runs["plain"]["tokens"]
    assert runs["full"]["describe"]["kv_read_fraction"] == 1.0


def test_sparse_decode_reads_less_and_reuses_choices(runs):
    d = runs["sparse"]["describe"]
    same = sum(a == b for x, y in zip(runs["sparse"]["tokens"], runs["plain"]["tokens"]) for a, b in zip(x, y))
    print("squeezed K=1/4 refresh 8:", d, f"greedy tokens equal to plain: {same}/{2 * NEW_TOKENS}")
    # 2 requests x (NEW_TOKENS - 1) decode steps x 4 layers
    assert d["decode_token_layers"] == 2 * (NEW_TOKENS - 1) * 4
    assert d["kv_read_fraction"] < 0.4
    # between refreshes (7 of every 8 positions) the stored choice was found again
    assert d["selections_reused"] >= 0.6 * d["decode_token_layers"]


def test_recycled_runs_full_steps_and_reuses_their_choice(runs):
    d = runs["recycled"]["describe"]
    same = sum(a == b for x, y in zip(runs["recycled"]["tokens"], runs["plain"]["tokens"]) for a, b in zip(x, y))
    print("squeezed recycled K=1/4 refresh 8:", d, f"greedy tokens equal to plain: {same}/{2 * NEW_TOKENS}")
    assert d["decode_token_layers"] == 2 * (NEW_TOKENS - 1) * 4
    assert d["selections_reused"] >= 0.6 * d["decode_token_layers"]
    # full steps until the first refresh position and then every 8th; sparse steps in between
    assert d["kv_read_fraction"] < 0.75
