"""xquant (XQuant's rematerialised latents) in vLLM's CPU engine on the bundled tiny llama, with
bases the test computes from its weights (``calibrate xquant``: the SVD of each layer's k_proj
and v_proj):

* vLLM's page really shrinks (uint8 pages of 84 bytes per token and KV head at 4 bits instead
  of 512 float32 ones), so the same KV memory holds ~6x the blocks;
* at 8 bits the rematerialised keys (latent -> K, RoPE re-applied at each token's stored
  position, which the engine's format seam reads from vLLM's attention metadata) give plain's
  greedy text, and xquant runs the shared KV-compression scenario (requests over time, prefix-
  cache hits, preemption, an abort) to the end with no leaked block, close to plain.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402

from . import kvcompress_scenario as scenario  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from vllm_graft.plugins.kvcompress.xquant import bases as xb

    out = tmp_path_factory.mktemp("xquant") / "graft-tiny-llama.safetensors"
    xb.save(out, *xb.compute(scenario.LLAMA))
    return str(out)


@pytest.fixture(scope="module")
def plain():
    return scenario.run_shared(None)


def _xquant(bases, bits):
    return {"plugin": "xquant", "params": {"bases": bases, "bits": bits}}


def test_xquant_pages_are_smaller_and_eight_bit_latents_give_plains_text(bases):
    plain, four, eight = (scenario.storage(kv) for kv in (None, _xquant(bases, 4), _xquant(bases, 8)))
    for name, out in (("plain", plain), ("xquant4", four), ("xquant8", eight)):
        print(f"--- {name}:\n{scenario.PROMPTS[0]}{out['text']}")
    # 32 + 32 code bytes, 16 of scales, 4 of position a token and KV head
    scenario.check_pool("xquant4", plain, four, page_bytes=2 * 32 * 84)
    assert four["blocks"] > 6 * plain["blocks"]
    assert eight["text"] == plain["text"]  # 8-bit latents: RoPE undone and redone at the right positions


def test_xquant_runs_the_scenario_close_to_plain(plain, bases):
    out = scenario.run(_xquant(bases, 8))
    scenario.check_close_to_plain("xquant", plain, out, page_bytes=2 * 32 * (2 * 64 + 16 + 4), min_first=8)
