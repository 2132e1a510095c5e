"""The MoE scheduler plugins in vLLM's CPU engine (in-process) on the bundled tiny Mixtral,
with routes recorded by the route-trace plugin:

* expert-mask with nothing masked gives plain vLLM's greedy tokens (and log-probabilities);
* a mask changes the recorded routes exactly as specified (an expert switched off in one
  layer never appears there, an expert forced on in another is in every token's top-k, and
  the layers before the first masked one route the first step as plain vLLM does);
* a mask that does not fit the model is refused at activation, naming the problem;
* dynamic-topk prunes (its count of expert evaluations equals the weighted slots recorded),
  and the live expert-cache and affinity-placement observers report what their policies
  compute on the same recorded routes.
"""
from __future__ import annotations

import os

from .engines import refusal  # first: the in-process engine's environment, set before vLLM loads

import gc  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from vllm_graft.integration.plan import plan_for  # noqa: E402


pytestmark = pytest.mark.e2e

MIXTRAL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-mixtral"
ENGINE = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True}
NEW_TOKENS = 12
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n"
    "    for arg in argv:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def read_config(path):\n    \"\"\"Return the parsed contents of the file at *path*.\"\"\"\n    with open(path",
]


def data(moe=None):
    d = {"model": str(MIXTRAL), "engine": dict(ENGINE)}
    if moe:
        d["moe"] = moe
    return d


def generate(moe=None):
    """(tokens, cumulative logprobs, trace or None, plugin report) of one engine run."""
    from vllm import LLM, SamplingParams

    from vllm_graft.hooks import Kind
    from vllm_graft.launch import engine as launch
    from vllm_graft.tools.moe.moe_record import with_tracer
    from vllm_graft.integration.runtime import RUNTIME

    d = with_tracer(data(moe)) if moe is not None else data()
    plan = plan_for(d)
    llm = LLM(**launch.llm_kwargs(plan, graft=moe is not None), seed=0)
    try:
        tracer = RUNTIME.instances.get((Kind.MOE, "route-trace"))
        for inst in RUNTIME.instances.values():
            getattr(inst, "reset_stats", lambda: None)()
        if tracer is not None:
            tracer.reset()
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1),
                            use_tqdm=False)
        trace = tracer.trace() if tracer is not None else None
        report = {r["name"]: r["described"] for r in RUNTIME.report()}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    generate.prompt_lens = [len(o.prompt_token_ids) for o in outs]
    return ([list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].cumulative_logprob for o in outs],
            trace, report)


@pytest.fixture(scope="module")
def plain():
    return generate()


@pytest.fixture(scope="module")
def unmasked(plain):
    return generate([{"plugin": "expert-mask"}])


def test_an_empty_mask_is_plain_vllm(plain, unmasked):
    tokens, logprobs, trace, report = unmasked
    assert tokens == plain[0]
    assert logprobs == plain[1]  # bit for bit: the logits are passed through untouched
    assert report["expert-mask"]["masked_layer_calls"] == 0
    assert trace.num_layers == 4 and trace.top_k == 2 and trace.num_experts == 8
    # every token of every prompt was recorded once: the prompts, then all outputs but the last
    prompt_tokens = sum(generate.prompt_lens)
    assert trace.num_tokens == prompt_tokens + sum(len(t) - 1 for t in tokens)
    assert int(trace.steps[0]) == prompt_tokens  # one prefill step for the three prompts


def test_masking_changes_the_recorded_routes_exactly_as_specified(plain, unmasked):
    _, _, base, _ = unmasked
    busiest1 = int(np.bincount(base.ids[1].ravel(), minlength=8).argmax())
    rarest3 = int(np.bincount(base.ids[3].ravel(), minlength=8).argmin())
    tokens, _, trace, report = generate([{"plugin": "expert-mask",
                                          "params": {"off": {"1": [busiest1]}, "on": {"3": [rarest3]}}}])
    assert busiest1 not in set(trace.ids[1].ravel().tolist())  # switched off in layer 1: never routed to
    assert (trace.ids[3] == rarest3).any(axis=1).all()  # forced on in layer 3: in every token's top-2
    assert (trace.weights[3].astype(np.float32) > 0).all()
    counts1 = Counter(trace.ids[1].ravel().tolist())
    assert sum(counts1.values()) == 2 * trace.num_tokens and len(set(map(tuple, trace.ids[1]))) > 1
    # layer 0 comes before any mask: the first (prefill) step routes exactly as unmasked
    first = int(trace.steps[0])
    assert int(base.steps[0]) == first
    assert np.array_equal(np.sort(trace.ids[0, :first], axis=1), np.sort(base.ids[0, :first], axis=1))
    assert not np.array_equal(trace.ids[1, :first], base.ids[1, :first])
    assert report["expert-mask"]["masked_layer_calls"] > 0
    assert tokens != plain[0]  # the busiest expert matters to this model


def test_a_mask_that_does_not_fit_the_model_is_refused_at_activation():
    text = refusal(plan_for(data([{"plugin": "expert-mask", "params": {"off": {"7": [1], "0": [9]}}}])))
    assert "moe[0].params: MoE plugin 'expert-mask' does not fit model" in text
    assert "(4 layers, 8 experts, top-2)" in text
    assert "layer(s) [7] do not exist or have no MoE block; MoE layers: 0..3" in text
    assert "off['0']: expert(s) [9] out of range; experts are 0..7" in text


@pytest.fixture(scope="module")
def dynamic():
    return generate([
        {"plugin": "dynamic-topk", "params": {"threshold": 0.8}},
        {"plugin": "expert-cache", "params": {"policy": "affinity", "prefetch": 1}},
        {"plugin": "affinity-placement", "params": {"devices": 4}},
    ])


def test_dynamic_topk_with_live_cache_and_placement_observers(dynamic):
    from vllm_graft.plugins.moe.affinity_placement import policy as P
    from vllm_graft.plugins.moe.expert_cache.policy import sets_from_trace, simulate

    tokens, _, trace, report = dynamic
    d = report["dynamic-topk"]
    active = trace.active()
    assert d["expert_evaluations"] == int(active.sum())  # what it kept = the weighted slots routed
    assert d["evaluations_topk"] == 2 * 4 * trace.num_tokens
    assert 0.05 < d["saved_share"] < 0.95
    assert active[..., 0].all()  # never below one expert
    assert all(len(tokens[i]) == NEW_TOKENS for i in range(len(PROMPTS)))
    sim = simulate(sets_from_trace(trace), 8, 2, "affinity", 1)
    assert report["expert-cache"]["hit_rate"] == round(sim.hit_rate, 4)
    assert report["expert-cache"]["accesses"] == sim.accesses == int(active.sum())
    A = P.affinity(trace.token_sets())
    assert report["affinity-placement"]["transfers_round_robin"] == P.volume(A, P.round_robin(4, 8, 4))
    assert report["affinity-placement"]["transfers_in_sample_optimum"] <= report["affinity-placement"]["transfers_round_robin"]


KERNEL_RUN = """
import json, sys
from tests.e2e.test_moe_schedulers import generate
tokens, _, trace, report = generate([{"plugin": "dynamic-topk", "params": {"threshold": 0.8, "kernel": "triton"}}])
trace.save(sys.argv[1])
print("RESULT " + json.dumps({"tokens": tokens, "report": report["dynamic-topk"]}))
"""


@pytest.mark.full  # a whole engine under TRITON_INTERPRET; the kernel alone: tests/unit/test_moe_dynamic_topk_kernel.py
def test_dynamic_topk_triton_kernel_in_the_engine_routes_as_the_reference(dynamic, tmp_path):
    """kernel: triton: the fused Triton routing kernel inside vLLM (CPU: under TRITON_INTERPRET=1,
    which must be set when the process starts, hence a child process) gives the reference
    path's greedy tokens and the same recorded routes."""
    import json
    import subprocess
    import sys

    from vllm_graft.plugins.moe.route_trace.reference import Trace

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run([sys.executable, "-c", KERNEL_RUN, str(tmp_path / "k.npz")], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    trace = Trace.load(tmp_path / "k.npz")
    ref_tokens, _, ref_trace, ref_report = dynamic
    assert got["tokens"] == ref_tokens
    assert np.array_equal(trace.ids, ref_trace.ids)
    assert np.abs(trace.weights.astype(np.float32) - ref_trace.weights.astype(np.float32)).max() < 1e-3
    assert got["report"]["expert_evaluations"] == ref_report["dynamic-topk"]["expert_evaluations"]
    assert got["report"]["path"] == "triton kernel" and got["report"]["kernel_calls"] > 0
    assert ref_report["dynamic-topk"]["path"] == "reference"
