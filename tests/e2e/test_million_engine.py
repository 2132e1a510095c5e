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
from vllm_graft.integration.plan import plan_for  # noqa: E402

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
    from vllm import SamplingParams

    from vllm_graft.launch import engine as launch

    engine = {k: v for k, v in scenario.ENGINE.items() if k != "num_gpu_blocks_override"}
    got, text = {}, {}
    prompt = scenario.PROMPTS[0]
    for name, kv in (("plain", None), ("million", _million(books))):
        data = {"model": str(scenario.LLAMA), "engine": engine, **({"kvcompress": kv} if kv else {})}
        with launch.in_process_engine(plan_for(data), graft=bool(kv), seed=0) as llm:
            core = llm.llm_engine.engine_core.engine_core
            config = core.scheduler.kv_cache_config
            (group,) = config.kv_cache_groups
            memory = sum(t.size for t in config.kv_cache_tensors)
            got[name] = (config.num_blocks, group.kv_cache_spec.page_size_bytes, str(group.kv_cache_spec.dtype), memory)
            sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            text[name] = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].text
    print(f"KV memory: plain {got['plain']}, million {got['million']} (blocks, page bytes per layer, dtype, bytes)")
    for name in text:
        print(f"--- {name}:\n{prompt}{text[name]}")
    # graft-tiny-llama: 4 layers, 2 KV heads, head size 64, blocks of 32 tokens
    assert got["plain"][1:3] == (2 * 32 * 2 * 64 * 4, "torch.float32")
    assert got["million"][1:3] == (2 * 32 * 64, "torch.uint8")  # 32 key + 32 value bytes per token and head
    space = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) << 30
    assert got["plain"][0] == space // (4 * 2 * 32 * 2 * 64 * 4)
    assert got["million"][0] == space // (4 * 2 * 32 * 64) == 8 * got["plain"][0]
    assert got["million"][3] <= got["plain"][3]
    assert text["million"].strip() and text["million"][:8] == text["plain"][:8]  # close to plain at first


def test_million_runs_the_scenario_close_to_plain(plain, books):
    out = scenario.run(_million(books))
    scenario.check_close_to_plain("million", plain, out, page_bytes=2 * 32 * 64, min_first=2)
