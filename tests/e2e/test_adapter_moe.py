"""The MoE adapter in vLLM's CPU engine (in-process) on the bundled tiny Mixtral.

* the noop scheduler routes through vLLM's own MoE code path (counted) and gives plain
  vLLM's greedy tokens, bit for bit in the log-probabilities;
* a test-only scheduler that masks an expert in adjust_logits really changes the routing
  (a test-only observer records it), with vLLM's own top-k and with a plugin router;
* a model without MoE layers is refused;
* a plain engine built afterwards in the same process is plain vLLM again.
"""
from __future__ import annotations

from .engines import refusal  # first: the in-process engine's environment, set before vLLM loads

import gc  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from vllm_graft.hooks import Capabilities, DeploymentError, Kind, MoEScheduler, Registration, hookimpl  # noqa: E402
from vllm_graft.hooks import manager as manager_mod  # noqa: E402


pytestmark = pytest.mark.e2e

MODELS = Path(__file__).resolve().parents[2] / "models"
MIXTRAL = MODELS / "graft-tiny-mixtral"
LLAMA = MODELS / "graft-tiny-llama"
NUM_MOE_LAYERS = 4
NEW_TOKENS = 12
ENGINE = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True}
# Code prompts from tests/e2e/test_models.py (no near-ties along their greedy continuations).
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n"
    "    for arg in argv:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def read_config(path):\n    \"\"\"Return the parsed contents of the file at *path*.\"\"\"\n    with open(path",
]


# ------------------------------------------------------------------ test-only schedulers
class ExpertParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expert: int = Field(ge=0, description="the expert switched off in every MoE layer")


class MaskExpert(MoEScheduler):
    """Switches one expert off: its router logit becomes -inf before top-k."""

    def adjust_logits(self, layer_idx, router_logits):
        out = router_logits.clone()
        out[:, self.params.expert] = float("-inf")
        return out


class TraceRoutes(MoEScheduler):
    """Records, per layer, how often each expert was chosen, and the routing weights' sums."""

    def __init__(self, params):
        super().__init__(params)
        self.experts: dict[int, Counter] = {}
        self.weight_sums: list[float] = []

    def observe(self, layer_idx, topk_ids, topk_weights):
        self.experts.setdefault(layer_idx, Counter()).update(topk_ids.flatten().tolist())
        self.weight_sums += topk_weights.sum(-1).tolist()


class _TestSchedulers:
    @hookimpl
    def graft_register_moe_schedulers(self, register):
        register(Registration(
            name="test-mask", summary="switches one expert off (test)", paper="-", params=ExpertParams,
            impl=f"{__name__}:MaskExpert", capabilities=Capabilities(lossless=False)))
        register(Registration(
            name="test-trace", summary="records routing (test)", paper="-",
            impl=f"{__name__}:TraceRoutes", capabilities=Capabilities(lossless=True)))


@pytest.fixture(scope="module", autouse=True)
def registry_with_test_schedulers():
    """The process-wide registry (what the bridge validates additional_config against)
    with the installed plugins plus the two test schedulers."""
    pm = manager_mod.make_plugin_manager()
    pm.register(_TestSchedulers(), name="tests.e2e.test_adapter_moe")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(manager_mod, "_cached", (pm, pm.build_registry()))
        yield


# ------------------------------------------------------------------------------ engines
@dataclass
class Run:
    tokens: list[list[int]]
    logprobs: list[float]  # cumulative, per prompt
    prompt_lens: list[int]
    runners: list[str]  # "Runner/Router" class names of the model's MoE layers
    events: dict[tuple[str, str], int]  # (plugin, event) -> count, during generate()
    instances: dict[str, MoEScheduler]

    @property
    def tokens_fed(self) -> int:
        """Tokens the model ran per layer: each prompt once, each output token but the last."""
        return sum(self.prompt_lens) + sum(len(t) - 1 for t in self.tokens)


def plan_for(moe=None, model=MIXTRAL, engine=ENGINE):
    from vllm_graft.integration import plan

    data = {"model": str(model), "engine": dict(engine)}
    if moe:
        data["moe"] = moe
    return plan.plan_for(data)


def run(moe=None) -> Run:
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.runtime import RUNTIME

    plan = plan_for(moe)
    llm = LLM(**launch.llm_kwargs(plan, graft=bool(moe)), seed=0)
    try:
        RUNTIME.events.clear()  # count generate() only
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1), use_tqdm=False)
        runners = llm.apply_model(lambda model: sorted(
            f"{type(m).__name__}/{type(m.router).__name__}" for m in model.modules()
            if isinstance(m, MoERunnerInterface)))[0]
        events = {(name, ev): n for (kind, name, ev), n in RUNTIME.events.items() if kind == Kind.MOE}
        instances = {name: impl for (kind, name), impl in RUNTIME.instances.items() if kind == Kind.MOE}
    finally:
        del llm
        gc.collect()
    return Run([list(o.outputs[0].token_ids) for o in outs],
               [o.outputs[0].cumulative_logprob for o in outs],
               [len(o.prompt_token_ids) for o in outs], runners, events, instances)


@pytest.fixture(scope="module")
def plain():
    r = run()
    assert r.runners == ["MoERunner/CPURouter"] * NUM_MOE_LAYERS
    assert r.events == {}
    return r


@pytest.fixture(scope="module")
def noop(plain):
    """The noop router, with a test-only observer recording what it routed."""
    return run([{"plugin": "noop"}, {"plugin": "test-trace"}])


# -------------------------------------------------------------------------------- tests
def test_layer_index_from_the_layer_name():
    from vllm_graft.integration.adapters.moe.checks import MoEAdapterError, layer_index

    assert layer_index("model.layers.3.block_sparse_moe.experts") == 3
    assert layer_index("language_model.model.layers.12.mlp.experts") == 12
    assert layer_index("blocks.7.moe") == 7
    with pytest.raises(MoEAdapterError, match="model.experts"):
        layer_index("model.experts")


def test_noop_routes_every_layer_and_step_and_matches_plain_vllm(plain, noop):
    assert noop.runners == ["GraftMoERunner/GraftRouter"] * NUM_MOE_LAYERS
    assert noop.tokens == plain.tokens
    assert noop.logprobs == plain.logprobs  # same routing weights, bit for bit
    steps = max(len(t) for t in noop.tokens)  # one prefill step for all prompts, then decodes
    assert noop.events == {
        ("noop", "route"): NUM_MOE_LAYERS * steps,  # one call per MoE layer and forward step
        ("noop", "tokens"): NUM_MOE_LAYERS * noop.tokens_fed,
        ("test-trace", "observe"): NUM_MOE_LAYERS * steps,
        ("test-trace", "tokens"): NUM_MOE_LAYERS * noop.tokens_fed,
    }
    trace = noop.instances["test-trace"]
    assert sorted(trace.experts) == list(range(NUM_MOE_LAYERS))  # layer index from the name
    for layer, chosen in trace.experts.items():
        assert sum(chosen.values()) == 2 * noop.tokens_fed  # top-2 for every token
        assert set(chosen) <= set(range(8))
    assert min(trace.weight_sums) == pytest.approx(1.0) and max(trace.weight_sums) == pytest.approx(1.0)


def test_masking_an_expert_changes_routing_with_vllms_topk_and_with_a_plugin_router(plain, noop):
    own = noop.instances["test-trace"].experts  # the noop routes as vLLM does (test above)
    expert = sum(own.values(), Counter()).most_common(1)[0][0]  # the busiest expert
    assert all(own[layer][expert] > 0 for layer in own)

    # no plugin routes: vLLM's own top-k routes the masked logits
    masked = run([{"plugin": "test-mask", "params": {"expert": expert}}, {"plugin": "test-trace"}])
    assert masked.runners == ["GraftMoERunner/GraftRouter"] * NUM_MOE_LAYERS
    assert ("test-mask", "route") not in masked.events and ("test-trace", "route") not in masked.events
    assert masked.events[("test-mask", "adjust_logits")] == masked.events[("test-trace", "observe")] > 0
    trace = masked.instances["test-trace"].experts
    assert sorted(trace) == list(range(NUM_MOE_LAYERS))
    for layer, chosen in trace.items():
        assert chosen[expert] == 0, f"layer {layer} still routes to masked expert {expert}"
        assert sum(chosen.values()) == 2 * masked.tokens_fed
    assert masked.tokens != plain.tokens  # the busiest expert matters to this model

    # the same mask in front of the noop router: the noop routes the masked logits, exactly
    # as vLLM's own top-k did
    routed = run([{"plugin": "test-mask", "params": {"expert": expert}}, {"plugin": "noop"},
                  {"plugin": "test-trace"}])
    assert routed.events[("noop", "route")] == routed.events[("test-mask", "adjust_logits")] > 0
    assert routed.instances["test-trace"].experts == trace
    assert routed.tokens == masked.tokens and routed.logprobs == masked.logprobs


def test_a_model_without_moe_layers_is_refused():
    from vllm import LLM
    from vllm.model_executor.custom_op import op_registry_oot

    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.runtime import RUNTIME

    text = refusal(plan_for([{"plugin": "test-trace"}], model=LLAMA))
    assert "MoE plugin 'test-trace' needs a model with MoE layers" in text
    assert "graft-tiny-llama (LlamaForCausalLM) has none" in text
    assert "Remove the `moe:` section" in text
    assert "MoERunner" not in op_registry_oot and not RUNTIME.active

    with pytest.raises(DeploymentError, match="engine.enforce_eager: MoE plugins run Python"):
        LLM(**launch.llm_kwargs(plan_for([{"plugin": "noop"}], engine={**ENGINE, "enforce_eager": False})))
    assert "MoERunner" not in op_registry_oot and not RUNTIME.active


def test_a_plain_engine_afterwards_is_plain_vllm(plain):
    from vllm.model_executor.custom_op import op_registry_oot

    from vllm_graft.integration.runtime import RUNTIME

    again = run()
    assert again.runners == ["MoERunner/CPURouter"] * NUM_MOE_LAYERS
    assert again.tokens == plain.tokens
    assert again.events == {} and not RUNTIME.active
    assert "MoERunner" not in op_registry_oot
