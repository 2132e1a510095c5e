"""The GPU route's attention backend (``integration/adapters/custom_backend.py``, registered as
vLLM's CUSTOM backend on CUDA) run on the CPU engine: ``VLLM_GRAFT_ATTENTION_BACKEND=generic``
puts it in place of CPU_ATTN. Exact plugins through it give plain vLLM's greedy tokens, and a KV
compressor through it (no attention plugin: the backend's exact PyTorch attention), and the kv4
storage format, give the same tokens as on the stock CPU route.

On the stock CPU route, the attention ``noop`` both ways: by default (``host_kernel``) vLLM's own
cache write and C++ kernel compute every layer behind vllm-graft's backend and the plugin is
never called; with ``host_kernel: false`` the shared PyTorch paged attention computes every layer.
Both give plain vLLM's greedy tokens, and the events say which route ran."""
from __future__ import annotations

import os

import pytest

from .engines import LLAMA  # first: the in-process engine's environment, before vLLM is imported
from vllm_graft.integration.plan import plan_for

pytestmark = pytest.mark.e2e

ENGINE = {"dtype": "float32", "max_model_len": 1024, "block_size": 32, "enforce_eager": True}
NEW_TOKENS = 16
STREAMING = {"plugin": "streaming", "params": {"sink_blocks": 1, "budget_blocks": 4}}
NOOP_TORCH = {"plugin": "noop", "params": {"host_kernel": False}}


@pytest.fixture(scope="module")
def prompts():
    from vllm_graft.tools import workloads

    tok = workloads.Tokenizer.from_model(LLAMA)
    (ps,) = workloads.build(["shared-prefix"], tok, num_prompts=4, max_tokens=NEW_TOKENS,
                            max_model_len=ENGINE["max_model_len"])
    return [{"prompt_token_ids": list(p.token_ids)} for p in ps.prompts]


def _greedy(prompts, sections: dict | None, *, generic: bool) -> dict:
    from vllm import SamplingParams

    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.runtime import RUNTIME

    env = os.environ
    old = env.get("VLLM_GRAFT_ATTENTION_BACKEND")
    env["VLLM_GRAFT_ATTENTION_BACKEND"] = "generic" if generic else ""
    before = dict(RUNTIME.backend_calls)
    try:
        plan = plan_for({"model": LLAMA, "engine": ENGINE, **(sections or {})})
        with launch.in_process_engine(plan, graft=sections is not None) as llm:
            res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                       ignore_eos=True), use_tqdm=False)
            tokens = [list(r.outputs[0].token_ids) for r in res]
            counts = dict(RUNTIME.counts("attention", "noop")) if sections else {}
    finally:
        if old is None:
            env.pop("VLLM_GRAFT_ATTENTION_BACKEND", None)
        else:
            env["VLLM_GRAFT_ATTENTION_BACKEND"] = old
    calls = {k: RUNTIME.backend_calls[k] - before.get(k, 0) for k in ("build", "forward")}
    return {"tokens": tokens, "calls": calls, "noop": counts}


@pytest.fixture(scope="module")
def runs(prompts):
    # (the bridge keeps a deployment active across engines of one process while it does not
    # change: the two streaming arms are not consecutive, so each activates its own route)
    return {
        "plain": _greedy(prompts, None, generic=False),
        "streaming-cpu": _greedy(prompts, {"kvcompress": STREAMING}, generic=False),
        "hydragen": _greedy(prompts, {"attention": {"plugin": "hydragen"}}, generic=True),
        "streaming-generic": _greedy(prompts, {"kvcompress": STREAMING}, generic=True),
        "kv4-cpu": _greedy(prompts, {"kvcompress": {"plugin": "kv4"}}, generic=False),
        "noop": _greedy(prompts, {"attention": {"plugin": "noop"}}, generic=True),
        "kv4-generic": _greedy(prompts, {"kvcompress": {"plugin": "kv4"}}, generic=True),
        "noop-host": _greedy(prompts, {"attention": {"plugin": "noop"}}, generic=False),
        "noop-torch": _greedy(prompts, {"attention": NOOP_TORCH}, generic=False),
        "noop-host+streaming": _greedy(prompts, {"attention": {"plugin": "noop"}, "kvcompress": STREAMING},
                                       generic=False),
    }


@pytest.mark.parametrize("arm", ["hydragen", "noop"])
def test_exact_plugins_through_the_generic_backend_match_plain_vllm(runs, arm):
    print(arm, runs[arm]["calls"])
    assert runs[arm]["calls"]["build"] > 0 and runs[arm]["calls"]["forward"] > 0, \
        "the generic backend was not used"
    assert runs[arm]["tokens"] == runs["plain"]["tokens"]


@pytest.mark.parametrize("name", ["streaming", "kv4"])
def test_kv_compressor_through_the_generic_backend_matches_the_cpu_route(runs, name):
    cpu, generic = runs[f"{name}-cpu"], runs[f"{name}-generic"]
    assert cpu["calls"] == {"build": 0, "forward": 0}
    assert generic["calls"]["forward"] > 0
    assert generic["tokens"] == cpu["tokens"]
    # streaming's budget is below the prompts' length and kv4 is lossy: both really changed
    # something, so the equality above is not plain vLLM's tokens twice
    assert generic["tokens"] != runs["plain"]["tokens"]


def test_noop_default_hands_every_layer_to_vllms_kernel(runs):
    host = runs["noop-host"]
    assert host["tokens"] == runs["plain"]["tokens"]
    # 4 layers: every layer call went to the host kernel, none through the plugin
    assert host["noop"].get("host", 0) >= 4 * NEW_TOKENS
    assert "forward" not in host["noop"] and "plan" not in host["noop"]
    assert host["calls"] == {"build": 0, "forward": 0}


def test_noop_without_the_host_kernel_computes_every_layer_itself(runs):
    torch_route = runs["noop-torch"]
    assert torch_route["tokens"] == runs["plain"]["tokens"]
    assert torch_route["noop"].get("forward", 0) >= 4 * NEW_TOKENS
    assert "host" not in torch_route["noop"]


def test_the_host_kernel_reads_a_kv_compressors_rewritten_block_tables(runs):
    """streaming frees blocks (its budget is below these prompts' length); with the noop on the
    host kernel the tokens are streaming's own, not plain vLLM's."""
    both = runs["noop-host+streaming"]
    assert both["noop"].get("host", 0) > 0
    assert both["tokens"] == runs["streaming-cpu"]["tokens"]
    assert both["tokens"] != runs["plain"]["tokens"]
