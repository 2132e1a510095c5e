"""hyperattention in vLLM's CPU engine on the bundled tiny llama: with min_seq_len above the
prompts it gives plain vLLM's greedy tokens (every prefill exact); with a low min_seq_len the
prompts' prefills are approximated (whole, and in chunks over a cached prefix when vLLM's chunked
prefill cuts them at max_num_batched_tokens), and decode stays exact."""
from __future__ import annotations

import pytest

from .engines import long_context  # first: the in-process engine's environment, before vLLM is imported

pytestmark = pytest.mark.e2e

ENGINE = {"dtype": "float32", "max_model_len": 1024, "block_size": 32, "enforce_eager": True}
NEW_TOKENS = 16
APPROX = {"min_seq_len": 128, "block_size": 32, "sample_size": 32}


def _run(params: dict | None, engine: dict | None = None) -> dict:
    return long_context("hyperattention", params, {**ENGINE, **(engine or {})}, NEW_TOKENS)


@pytest.fixture(scope="module")
def runs():
    return {"plain": _run(None), "above": _run({"min_seq_len": 4096}), "approx": _run(APPROX),
            "chunked": _run(APPROX, {"max_num_batched_tokens": 128, "enable_chunked_prefill": True})}


def _agree(a, b):
    return sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))


def test_min_seq_len_above_the_prompts_gives_plain_tokens(runs):
    assert max(runs["plain"]["prompt_lens"]) < 4096
    assert runs["above"]["tokens"] == runs["plain"]["tokens"]
    d = runs["above"]["describe"]
    assert d["approx_rows"] == 0 and d["exact_rows"] > 0


def test_low_min_seq_len_approximates_the_prefill(runs):
    d = runs["approx"]["describe"]
    lens = runs["approx"]["prompt_lens"]
    print("hyperattention", APPROX, "prompts", lens, d,
          f"greedy tokens equal to plain: {_agree(runs['approx']['tokens'], runs['plain']['tokens'])}/{2 * NEW_TOKENS}")
    assert min(lens) >= APPROX["min_seq_len"]
    assert d["approx_rows"] == sum(lens) * 4  # every prompt row, 4 layers, in one step each
    assert d["chunks_with_prefix"] == 0 and d["score_fraction"] < 1
    assert all(len(t) == NEW_TOKENS for t in runs["approx"]["tokens"])


def test_chunked_prefill_approximates_each_chunk_over_its_prefix(runs):
    d = runs["chunked"]["describe"]
    print("hyperattention chunked at 128 tokens", d,
          f"greedy tokens equal to plain: {_agree(runs['chunked']['tokens'], runs['plain']['tokens'])}/{2 * NEW_TOKENS}")
    assert d["chunks_with_prefix"] > 0
    # chunks whose context is shorter than min_seq_len (the first of each prompt) stay exact
    assert 0 < d["approx_rows"] < sum(runs["chunked"]["prompt_lens"]) * 4
