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
from vllm_graft.integration.plan import plan_for  # noqa: E402

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
    from vllm import SamplingParams

    from vllm_graft.launch import engine as launch

    engine = {k: v for k, v in scenario.ENGINE.items() if k != "num_gpu_blocks_override"}
    got, text = {}, {}
    prompt = scenario.PROMPTS[0]
    for name, kv in (("plain", None), ("xquant4", _xquant(bases, 4)), ("xquant8", _xquant(bases, 8))):
        data = {"model": str(scenario.LLAMA), "engine": engine, **({"kvcompress": kv} if kv else {})}
        with launch.in_process_engine(plan_for(data), graft=bool(kv), seed=0) as llm:
            config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
            (group,) = config.kv_cache_groups
            got[name] = (config.num_blocks, group.kv_cache_spec.page_size_bytes, str(group.kv_cache_spec.dtype))
            sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            text[name] = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].text
    print(f"KV memory: {got} (blocks, page bytes per layer, dtype)")
    for name in text:
        print(f"--- {name}:\n{prompt}{text[name]}")
    # graft-tiny-llama: 4 layers, 2 KV heads, head size 64, blocks of 32 tokens
    assert got["plain"][1:] == (2 * 32 * 2 * 64 * 4, "torch.float32")
    assert got["xquant4"][1:] == (2 * 32 * 84, "torch.uint8")  # 32 + 32 code bytes, 16 of scales, 4 of position
    space = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) << 30
    assert got["xquant4"][0] == space // (4 * 2 * 32 * 84) > 6 * got["plain"][0]
    assert text["xquant8"] == text["plain"]  # 8-bit latents: RoPE undone and redone at the right positions


def test_xquant_runs_the_scenario_close_to_plain(plain, bases):
    out = scenario.run(_xquant(bases, 8))
    scenario.check_close_to_plain("xquant", plain, out, page_bytes=2 * 32 * (2 * 64 + 16 + 4), min_first=8)
