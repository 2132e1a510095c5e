"""kv4 (the 4-bit KV storage format) in vLLM's CPU engine, alone and composed with the
``streaming`` eviction compressor, through the shared KV-compression scenario (requests over
time, a prefix-cache hit, preemption, an abort; see ``kvcompress_scenario``):

* vLLM's page really shrinks (uint8 pages of 80 bytes per token and KV head instead of 512
  float32 ones), so the same KV memory holds 6.4x the blocks (read from vLLM's KV config);
* kv4 runs the scenario to the end (preemption, abort, prefix hits, no leaked block) and its
  greedy tokens are close to plain vLLM's (it is lossy: the agreement is printed);
* kv4 + streaming frees blocks as streaming alone does, and its blocks are salted with both;
* the prefix-cache salt keeps kv4 KV apart from plain KV.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402

from . import kvcompress_scenario as scenario  # noqa: E402

pytestmark = pytest.mark.e2e

KV4 = {"plugin": "kv4"}
KV4_SALT = 'vllm-graft/kvcompress/kv4/{"kernel":"reference","value_group_size":32}'
STREAM = {"plugin": "streaming", "params": {"budget_blocks": 3, "sink_blocks": 1}}
STREAM_SALT = 'vllm-graft/kvcompress/streaming/{"budget_blocks":3,"sink_blocks":1}'


@pytest.fixture(scope="module")
def plain():
    return scenario.run_shared(None)  # shared with test_kvcompress_engine in one pytest process


@pytest.fixture(scope="module")
def kv4():
    return scenario.run(KV4)


def test_kv4_pages_are_smaller_and_the_same_memory_holds_more_blocks():
    # the same KV memory for both: VLLM_CPU_KVCACHE_SPACE (1 GiB, the launch default)
    plain, kv4 = scenario.storage(None), scenario.storage(KV4)
    scenario.check_pool("kv4", plain, kv4, page_bytes=2 * 32 * 80)  # uint8: 80 bytes a token and KV head
    assert kv4["blocks"] >= 6 * plain["blocks"]  # 6.4x the blocks of float32 (3.2x of float16)


def test_kv4_runs_the_scenario_close_to_plain(plain, kv4):
    # 4-bit KV: close, not identical
    scenario.check_close_to_plain("kv4", plain, kv4, page_bytes=2 * 32 * 80, min_first=4)


def test_the_salt_keeps_kv4_kv_apart_from_plain_kv(plain, kv4):
    assert plain["salts"] == [""]
    assert kv4["salts"] == [KV4_SALT]


def test_kv4_with_streaming_frees_blocks(plain):
    both = scenario.run([STREAM, KV4])
    assert both["manager"] == "GraftKVCompressManager" and both["page_bytes"] == 2 * 32 * 80
    assert both["aborted"] == ["r4"] and sorted(both["tokens"]) == sorted(plain["tokens"])
    assert all(len(t) == scenario.NEW_TOKENS for t in both["tokens"].values())
    # held: budget + the block a new token opens + prompt blocks shared with another request
    assert both["max_held"] <= 3 + 1 + 2 < plain["max_held"], both["max_held"]
    assert both["events"]["streaming:blocks_freed"] > 0 and both["events"]["kv4:write"] > 0
    assert both["leaked"] == 0 and both["left"] == []
    assert both["salts"] == [STREAM_SALT + "+" + KV4_SALT]
    print(f"kv4+streaming: max held {both['max_held']} blocks (plain {plain['max_held']}), "
          f"{both['events']['streaming:blocks_freed']} blocks freed, "
          f"{100 * scenario.agreement(plain['tokens'], both['tokens']):.1f}% tokens agree with plain")
