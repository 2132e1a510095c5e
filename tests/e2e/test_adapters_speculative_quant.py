"""The speculative and quant adapters in vLLM's CPU engine, on the bundled tiny Llama.

Each graft run enables plugins through ``LLM(additional_config={"graft": ...})`` (the route a
user takes) and is compared with plain vLLM on the same prompts: greedy tokens must be
identical, and the runtime's event counts prove that vLLM's own code path called the
plugin (quant: ``create_weights``/``process_weights_after_loading``/``apply`` of every linear
layer; speculative: vLLM's ``custom_class`` proposer, its verification and the runner
patch that supplies request ids and finished requests). A small real proposer (prompt
lookup) defined here shows drafts are verified, accepted in part, and change no token.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default check fails on small VMs

from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from vllm_graft.hooks import Capabilities, Kind, Proposer, Registration, hookimpl  # noqa: E402

from .test_models import PROMPTS  # noqa: E402  (chosen so that no greedy step is a near-tie)
from vllm_graft.integration.plan import plan_for  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"
ENGINE = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True}
NEW_TOKENS = 24
# One more prompt, long enough that prompt lookup finds n-grams to draft from.
PROMPTS = PROMPTS + [
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n"
    "    print(k)\nfor i in range(",
]


# ------------------------------------------------------------ a real proposer, for tests only
class LookupParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_speculative_tokens: int = Field(3, ge=1, description="drafts per step")
    max_ngram: int = Field(3, ge=1, description="longest suffix looked up")


class PromptLookup(Proposer):
    """Drafts what followed the latest earlier occurrence of the sequence's last n tokens
    (n = max_ngram..1): prompt-lookup decoding. Records every call for the assertions."""

    def __init__(self, params: LookupParams) -> None:
        super().__init__(params)
        self.calls: list[tuple[str, tuple[int, ...], int, list[int]]] = []
        self.verdicts: list[tuple[str, int, int]] = []
        self.finished: list[str] = []

    def propose(self, request_id, token_ids, max_tokens):
        assert isinstance(token_ids, list) and all(type(t) is int for t in token_ids)
        drafts: list[int] = []
        for n in range(min(self.params.max_ngram, len(token_ids) - 1), 0, -1):
            tail = token_ids[-n:]
            for start in range(len(token_ids) - n - 1, -1, -1):
                if token_ids[start:start + n] == tail:
                    drafts = token_ids[start + n:start + n + max_tokens]
                    break
            if drafts:
                break
        self.calls.append((request_id, tuple(token_ids), max_tokens, drafts))
        return drafts

    def accepted(self, request_id, num_accepted, num_verified):
        self.verdicts.append((request_id, num_accepted, num_verified))

    def finish(self, request_id):
        self.finished.append(request_id)


class _TestPlugins:
    @hookimpl
    def graft_register_spec_proposers(self, register):
        register(Registration(
            name="test-lookup", summary="prompt lookup (test only)", paper="-",
            params=LookupParams, impl=f"{__name__}:PromptLookup",
            capabilities=Capabilities(lossless=True)))


@pytest.fixture
def with_test_plugin(monkeypatch):
    """The process-wide registry with the installed plugins plus the test proposer."""
    from vllm_graft.hooks import make_plugin_manager
    from vllm_graft.hooks import manager as manager_mod

    pm = make_plugin_manager()
    pm.register(_TestPlugins(), name="test-lookup")
    monkeypatch.setattr(manager_mod, "_cached", (pm, pm.build_registry()))


# ---------------------------------------------------------------------------------- helpers
def _greedy(max_tokens: int = NEW_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@contextmanager
def engine(graft: dict | None, engine_args: dict = ENGINE, **overrides):
    """An in-process vLLM engine with the deployment sections ``graft`` (None: plain vLLM)."""
    from vllm_graft.launch import engine as launch

    plan = plan_for({"model": str(MODEL), "engine": engine_args, **(graft or {})})
    assert ("additional_config" in launch.llm_kwargs(plan, graft=graft is not None)) == (graft is not None)
    with launch.in_process_engine(plan, graft=graft is not None, seed=0, **overrides) as llm:
        yield llm


def _events(kind, name):
    from vllm_graft.integration.runtime import RUNTIME

    return RUNTIME.counts(kind, name)


def _linear_layers(llm):
    """(name, quant method class name, buffer names, has weight) of every LinearBase layer."""
    def inspect(model):
        from vllm.model_executor.layers.linear import LinearBase

        return [(n, type(m.quant_method).__name__, sorted(dict(m.named_buffers())), "weight" in m._parameters)
                for n, m in model.named_modules() if isinstance(m, LinearBase)]

    (layers,) = llm.apply_model(inspect)
    return layers


@pytest.fixture(scope="module")
def plain():
    """Plain vLLM's greedy tokens and its linear layers, computed once."""
    with engine(None) as llm:
        tokens = _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False))
        layers = _linear_layers(llm)
    assert all(len(t) == NEW_TOKENS for t in tokens)  # no early EOS: every step is compared
    return tokens, layers


# ------------------------------------------------------------------------------------ quant
#: the noop through vllm-graft's opaque op (the route of every plugin without a dense weight)
NOOP_OP = {"plugin": "noop", "params": {"host_gemm": False}}


def _quant_noop(section: dict):
    """One engine with the quant noop ``section``: (greedy tokens, linear layers, events after
    load, events after generation)."""
    with engine({"quant": section}) as llm:
        assert llm.llm_engine.vllm_config.model_config.quantization == "graft-noop"
        after_load = dict(_events(Kind.QUANT, "noop"))
        got = _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False))
        return got, _linear_layers(llm), after_load, _events(Kind.QUANT, "noop")


def test_quant_noop_matches_plain_and_runs_every_linear_layer(plain):
    plain_tokens, plain_layers = plain
    got, layers, after_load, events = _quant_noop(NOOP_OP)
    assert got == plain_tokens
    # every linear layer (and only those) went through the plugin, once each
    assert [n for n, *_ in layers] == [n for n, *_ in plain_layers]
    assert {cls for _, cls, _, _ in layers} == {"GraftLinearMethod"}
    assert {cls for _, cls, _, _ in plain_layers} == {"UnquantizedLinearMethod"}
    assert all(bufs == ["graft_weight"] and has_w for _, _, bufs, has_w in layers)  # noop keeps it
    assert events["quantize"] == len(layers) == 16  # 4 decoder layers x qkv, o, gate_up, down
    # generation itself called apply: every linear layer at least once per decode step
    assert events["apply"] - after_load.get("apply", 0) >= len(layers) * NEW_TOKENS
    assert "dense" not in events


def test_quant_noop_default_hands_every_layer_to_vllms_dense_gemm(plain):
    """The noop's default (``host_gemm``): its dense weight goes to vLLM's own unquantised
    linear method (oneDNN prepacked on this CPU), so no call goes through the plugin."""
    plain_tokens, plain_layers = plain
    got, layers, _, events = _quant_noop({"plugin": "noop"})
    assert got == plain_tokens
    assert [n for n, *_ in layers] == [n for n, *_ in plain_layers]
    assert {cls for _, cls, _, _ in layers} == {"GraftLinearMethod"}
    # as plain vLLM leaves them: no graft buffers; the weight as vLLM's dispatch left it
    assert [(bufs, has_w) for _, _, bufs, has_w in layers] == \
        [(bufs, has_w) for _, _, bufs, has_w in plain_layers]
    assert all(not any(b.startswith("graft_") for b in bufs) for _, _, bufs, _ in layers)
    assert events["quantize"] == events["dense"] == len(layers) == 16
    assert "apply" not in events


# ------------------------------------------------------------------------------ speculative
def test_speculative_noop_matches_plain_and_is_called_every_step(plain):
    plain_tokens, _ = plain
    with engine({"speculative": {"plugin": "noop"}}) as llm:
        spec = llm.llm_engine.vllm_config.speculative_config
        assert (spec.method, spec.num_speculative_tokens) == ("custom_class", 4)  # the default
        got = _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False))
        first = _events(Kind.SPECULATIVE, "noop")
        # vLLM tells its runner about finished requests at the next step: run one more
        llm.generate(PROMPTS[:1], _greedy(1), use_tqdm=False)
        second = _events(Kind.SPECULATIVE, "noop")
    assert got == plain_tokens
    # no drafts, so one step per token, and the plugin is asked after each of them
    assert first["propose"] == sum(len(t) for t in got)
    assert "drafted" not in first and "verified" not in first
    # and with no drafts scheduled every step takes vLLM's plain path (no rejection sampler)
    assert first["plain_steps"] >= max(len(t) for t in got)
    assert "finish" not in first
    assert second["finish"] == len(PROMPTS)


def test_speculative_real_proposer_drafts_are_verified(plain, with_test_plugin):
    plain_tokens, _ = plain
    lookup = {"speculative": {"plugin": "test-lookup", "params": {"num_speculative_tokens": 3}}}
    with engine(lookup, per_request_spec_decode_metrics="summary") as llm:
        from vllm_graft.integration.runtime import RUNTIME

        spec = llm.llm_engine.vllm_config.speculative_config
        assert (spec.method, spec.num_speculative_tokens) == ("custom_class", 3)  # from params
        outputs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
        events = _events(Kind.SPECULATIVE, "test-lookup")
        plugin = RUNTIME.instances[(Kind.SPECULATIVE, "test-lookup")]
        calls, verdicts = list(plugin.calls), list(plugin.verdicts)
        llm.generate(PROMPTS[:1], _greedy(1), use_tqdm=False)  # delivers the finishes
        finished = list(plugin.finished)
    got = _tokens(outputs)
    assert got == plain_tokens  # drafts never change greedy output

    # The plugin saw each request's prompt + output so far (on the last step possibly a few
    # accepted tokens past max_tokens, which vLLM then cuts), under one id per request.
    sequences = {tuple(o.prompt_token_ids) + tuple(o.outputs[0].token_ids): len(o.prompt_token_ids)
                 for o in outputs}
    ids_of_sequence: dict[tuple[int, ...], set[str]] = {}
    for request_id, token_ids, budget, drafts in calls:
        assert budget == 3 and len(drafts) <= 3
        (seq,) = [s for s in sequences if s[:len(token_ids)] == token_ids[:len(s)]]
        assert sequences[seq] < len(token_ids) <= len(seq) + 3
        ids_of_sequence.setdefault(seq, set()).add(request_id)
    assert len(ids_of_sequence) == len(PROMPTS)
    assert all(len(ids) == 1 for ids in ids_of_sequence.values())
    ids = {i for ids in ids_of_sequence.values() for i in ids}
    assert set(finished) == ids  # every request was finished, once
    assert len(finished) == len(ids)

    # drafts were made, verified by the target, and partly kept
    assert events["propose"] == len(calls)
    assert events["drafted"] == sum(len(c[3]) for c in calls) > 0
    assert 0 < events["accepted"] < events["verified"] <= events["drafted"]
    assert events["propose"] < sum(len(t) for t in got)  # accepted drafts saved steps
    assert sum(a for _, a, _ in verdicts) == events["accepted"]
    assert sum(v for _, _, v in verdicts) == events["verified"]
    # ... and vLLM's own per-request figures agree with what the adapter counted
    metrics = [o.outputs[0].spec_decode_metrics for o in outputs]
    assert all(m is not None for m in metrics)
    assert sum(m.num_draft_tokens for m in metrics) == events["verified"]
    assert sum(j * c for m in metrics for j, c in enumerate(m.histogram)) == events["accepted"]


# ------------------------------------------------- both, compiled, then plain again
def test_both_kinds_compiled_then_plain_vllm_is_unchanged(plain):
    """Both noop plugins under vLLM's default torch.compile (no enforce_eager): the quant
    plugin runs, and is counted, on every call inside the compiled graph; then a plain
    engine in the same process is plain vLLM again."""
    from vllm.config import CompilationMode
    from vllm.model_executor.layers import quantization as q

    from vllm_graft.integration.patches import PATCHES
    from vllm_graft.integration.runtime import RUNTIME

    plain_tokens, plain_layers = plain
    compiled = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}
    with engine({"speculative": {"plugin": "noop"}, "quant": NOOP_OP}, compiled) as llm:
        assert llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
        assert "graft-noop" in q.QUANTIZATION_METHODS
        assert {p.owner for p in PATCHES.applied()} >= {"adapters.speculative"}
        before = _events(Kind.QUANT, "noop").get("apply", 0)
        got = _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False))
        quant_events = _events(Kind.QUANT, "noop")
        assert quant_events["quantize"] == 16
        assert quant_events["apply"] - before >= 16 * NEW_TOKENS
        assert _events(Kind.SPECULATIVE, "noop")["propose"] == sum(len(t) for t in got)
    assert got == plain_tokens

    with engine(None) as llm:  # no deployment: the bridge deactivates the previous one
        assert RUNTIME.plan is None and not RUNTIME.events
        assert {p.owner for p in PATCHES.applied()} <= {"bridge"}
        assert "graft-noop" not in q.QUANTIZATION_METHODS
        vcfg = llm.llm_engine.vllm_config
        assert vcfg.speculative_config is None and vcfg.model_config.quantization is None
        again = _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False))
        layers = _linear_layers(llm)
    assert again == plain_tokens
    assert layers == plain_layers
    assert not RUNTIME.events  # nothing of ours ran
