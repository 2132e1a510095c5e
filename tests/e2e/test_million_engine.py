"""million (MILLION product-quantised KV storage) in vLLM's CPU engine on the bundled tiny
llama, with codebooks the test calibrates on it (``calibrate``: post-RoPE K/V from
transformers, k-means per sub-space; few tokens and iterations, to be fast):

* vLLM's page really shrinks (uint8 pages of 64 bytes per token and KV head instead of 512
  float32 ones: 4 bits per channel, no scales), so the same KV memory holds 8x the blocks;
* million runs the shared KV-compression scenario (requests over time, a prefix-cache hit,
  preemption, an abort) to the end with no leaked block, its greedy tokens close to plain's
  (lossy: the agreement and a sample of text are printed).
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402

from . import kvcompress_scenario as scenario  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    out = tmp_path_factory.mktemp("million") / "graft-tiny-llama.safetensors"
    info = scenario.million_books(out)
    print(f"calibrated on {info['tokens']} tokens: relative squared error per layer (K, V) "
          f"{info['relative_sq_error']}")
    return str(out)


@pytest.fixture(scope="module")
def plain():
    return scenario.run_shared(None)


def _million(books):
    return {"plugin": "million", "params": {"codebooks": books}}


def test_million_pages_are_smaller_and_the_same_memory_holds_8x_the_blocks(books):
    plain, million = scenario.storage(None), scenario.storage(_million(books))
    for name, out in (("plain", plain), ("million", million)):
        print(f"--- {name}:\n{scenario.PROMPTS[0]}{out['text']}")
    scenario.check_pool("million", plain, million, page_bytes=2 * 32 * 64)  # 32 key + 32 value bytes a token and head
    assert million["blocks"] == 8 * plain["blocks"]
    assert million["text"].strip() and million["text"][:8] == plain["text"][:8]  # close to plain at first


def test_million_runs_the_scenario_close_to_plain(plain, books):
    out = scenario.run(_million(books))
    scenario.check_close_to_plain("million", plain, out, page_bytes=2 * 32 * 64, min_first=2)
