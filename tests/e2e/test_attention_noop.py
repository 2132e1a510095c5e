"""The attention ``noop`` on vLLM's CPU engine, both ways: by default (``host_kernel``) vLLM's own
cache write and C++ kernel compute every layer behind vllm-graft's backend and the plugin is
never called; with ``host_kernel: false`` the shared PyTorch paged attention computes every
layer. Both give plain vLLM's greedy tokens, and the events say which route ran."""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytestmark = pytest.mark.e2e

LLAMA = str(Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama")
ENGINE = {"dtype": "float32", "max_model_len": 1024, "block_size": 32, "enforce_eager": True}
NEW_TOKENS = 16
STREAMING = {"plugin": "streaming", "params": {"sink_blocks": 1, "budget_blocks": 4}}


@pytest.fixture(scope="module")
def prompts():
    from vllm_graft.tools import workloads

    tok = workloads.Tokenizer.from_model(LLAMA)
    (ps,) = workloads.build(["shared-prefix"], tok, num_prompts=4, max_tokens=NEW_TOKENS,
                            max_model_len=ENGINE["max_model_len"])
    return [{"prompt_token_ids": list(p.token_ids)} for p in ps.prompts]


def _run(prompts, sections: dict | None) -> dict:
    from vllm import SamplingParams

    from vllm_graft.integration import launch
    from vllm_graft.integration.runtime import RUNTIME

    plan = launch.plan_from_dict({"model": LLAMA, "engine": ENGINE, **(sections or {})})
    with launch.in_process_engine(plan, graft=sections is not None) as llm:
        res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                   ignore_eos=True), use_tqdm=False)
        counts = dict(RUNTIME.counts("attention", "noop")) if sections else {}
    return {"tokens": [list(r.outputs[0].token_ids) for r in res], "counts": counts}


@pytest.fixture(scope="module")
def runs(prompts):
    return {
        "plain": _run(prompts, None),
        "host": _run(prompts, {"attention": {"plugin": "noop"}}),
        "torch": _run(prompts, {"attention": {"plugin": "noop", "params": {"host_kernel": False}}}),
        "streaming": _run(prompts, {"kvcompress": STREAMING}),
        "host+streaming": _run(prompts, {"attention": {"plugin": "noop"}, "kvcompress": STREAMING}),
    }


def test_noop_default_hands_every_layer_to_vllms_kernel(runs):
    host = runs["host"]
    assert host["tokens"] == runs["plain"]["tokens"]
    # 4 layers: every layer call went to the host kernel, none through the plugin
    assert host["counts"].get("host", 0) >= 4 * NEW_TOKENS
    assert "forward" not in host["counts"] and "plan" not in host["counts"]


def test_noop_without_the_host_kernel_computes_every_layer_itself(runs):
    torch_route = runs["torch"]
    assert torch_route["tokens"] == runs["plain"]["tokens"]
    assert torch_route["counts"].get("forward", 0) >= 4 * NEW_TOKENS
    assert "host" not in torch_route["counts"]


def test_the_host_kernel_reads_a_kv_compressors_rewritten_block_tables(runs):
    """streaming frees blocks (its budget is below these prompts' length); with the noop on the
    host kernel the tokens are streaming's own, not plain vLLM's."""
    both = runs["host+streaming"]
    assert both["counts"].get("host", 0) > 0
    assert both["tokens"] == runs["streaming"]["tokens"]
    assert both["tokens"] != runs["plain"]["tokens"]
