"""Pruned MoE slots are not computed in vLLM's CPU engine, and the output does not change.

A routing plugin marks a slot it prunes with weight 0; the MoE adapter's ``GraftRoutedExperts``
then runs vLLM's expert path on the kept (token, expert) pairs only
(``integration/adapters/moe/skip.py``). Checked here on vLLM's real layers and kernel:

* the layer output with the skip equals the weight-0 route (the same layer, the same routing,
  pruned slots computed with weight 0) bit for bit in float32 (to float32 rounding on CPUs
  without AVX-512: ``BIT_EXACT``), through the whole MoE layer with
  dynamic-topk's routing and through the experts with hand-made routings (a pruned first slot,
  a token with no kept slot);
* in half precision (vLLM's ``cpu_fused_moe`` directly): tokens with one kept slot bit for bit,
  the others within the rounding of their dtype;
* bundled tiny-mixtral with dynamic-topk: greedy tokens and log-probabilities identical with the
  skip in every layer call, with the default minimum (32 pruned slots per call) and without it,
  and the skipped slots counted equal the evaluations dynamic-topk saved.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import gc  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from vllm_graft.integration.plan import plan_for  # noqa: E402

pytestmark = pytest.mark.e2e

MIXTRAL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-mixtral"
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n"
    "    for arg in argv:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def read_config(path):\n    \"\"\"Return the parsed contents of the file at *path*.\"\"\"\n    with open(path",
]
NEW_TOKENS = 24
#: vLLM's float32 CPU MoE kernel gave a token's row bit for bit whatever other rows a call held on
#: the AVX-512 machines these tests were written on; on an AVX2 CPU (AMD EPYC) its sums differ in
#: the last bits (up to ~5e-7 of values ~1) with the rows a call holds, so there the skip is
#: checked to float32 rounding instead of bit for bit.
BIT_EXACT = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit where the kernel is (AVX-512), else within float32 rounding of the values."""
    if BIT_EXACT:
        return torch.equal(a, b)
    return bool(((a - b).abs() <= 8 * torch.finfo(torch.float32).eps * b.abs().amax().clamp(min=1.0)).all())


def _layers(llm, cls):
    return llm.apply_model(lambda model: [m for m in model.modules() if isinstance(m, cls)])[0]


@pytest.fixture(scope="module")
def engine():
    """tiny-mixtral with dynamic-topk (defaults): (llm, runners, routed experts, plugin instance)."""
    from vllm import LLM
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from vllm_graft.hooks import Kind
    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.adapters.moe.engine import GraftMoERunner, GraftRoutedExperts
    from vllm_graft.integration.runtime import RUNTIME

    plan = plan_for({"model": str(MIXTRAL),
                     "engine": {"dtype": "float32", "max_model_len": 512},
                     "moe": [{"plugin": "dynamic-topk"}]})
    llm = LLM(**launch.llm_kwargs(plan), seed=0)
    runners = sorted(_layers(llm, MoERunner), key=lambda m: m.layer_name)
    experts = sorted(_layers(llm, GraftRoutedExperts), key=lambda m: m.layer_name)
    assert len(runners) == len(experts) == 4 and all(isinstance(r, GraftMoERunner) for r in runners)
    assert [r.routed_experts for r in runners] == experts
    try:
        yield llm, runners, experts, RUNTIME.instances[(Kind.MOE, "dynamic-topk")]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _generate(llm):
    from vllm import SamplingParams

    from vllm_graft.hooks import Kind
    from vllm_graft.integration.runtime import RUNTIME

    inst = RUNTIME.instances[(Kind.MOE, "dynamic-topk")]
    inst.reset_stats()
    RUNTIME.events.clear()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1),
                        use_tqdm=False)
    events = RUNTIME.counts(Kind.MOE, "dynamic-topk")
    return ([list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].cumulative_logprob for o in outs],
            events, inst.describe())


def test_greedy_tokens_identical_with_and_without_the_skip_and_skips_counted(engine):
    from vllm_graft.integration.adapters.moe.engine import SKIP_MIN_DEFAULT

    llm, _, experts, _ = engine
    assert all(e.graft_skip and e.graft_skip_min == SKIP_MIN_DEFAULT for e in experts)
    runs = {}
    try:
        for name, on, least in (("always", True, 1), ("default", True, SKIP_MIN_DEFAULT), ("off", False, 1)):
            for e in experts:
                e.graft_skip, e.graft_skip_min = on, least
            runs[name] = _generate(llm)
    finally:
        for e in experts:
            e.graft_skip, e.graft_skip_min = True, SKIP_MIN_DEFAULT
    tokens, logprobs, events, described = runs["always"]
    assert all(len(t) == NEW_TOKENS for t in tokens)
    for name in ("default", "off"):
        assert runs[name][0] == tokens
        if BIT_EXACT:
            assert runs[name][1] == logprobs  # bit for bit
        else:  # the sums' last bits (see BIT_EXACT), over 24 tokens' log-probabilities
            assert runs[name][1] == pytest.approx(logprobs, rel=1e-6, abs=1e-5)
        assert runs[name][3]["expert_evaluations"] == described["expert_evaluations"]
    saved = described["evaluations_topk"] - described["expert_evaluations"]
    assert saved > 0.2 * described["evaluations_topk"]
    # always: every slot dynamic-topk pruned was left out of the kernel, and only those
    assert events["slots_skipped"] == saved
    assert events["slots_computed"] <= described["expert_evaluations"]
    # default: the prefill step's layer calls (3 prompts) skip, the decode steps (3 tokens) do not
    assert 0 < runs["default"][2]["slots_skipped"] < saved
    assert "slots_skipped" not in runs["off"][2] and "slots_computed" not in runs["off"][2]


def _routing(inst, logits, top_k=2):
    w, ids = inst.route(0, logits, top_k, True)
    return w.float().contiguous(), ids.int().contiguous()


def test_moe_layer_output_with_the_skip_is_the_weight0_route_bit_for_bit(engine):
    """The whole MoE layer (vLLM's runner: router with dynamic-topk, then the experts)."""
    from vllm.forward_context import set_forward_context

    llm, runners, _, inst = engine
    torch.manual_seed(0)
    for runner in runners:
        T, H = 200, runner.routed_experts.hidden_size
        x = torch.randn(T, H)
        logits = torch.randn(T, 8) * 3
        w, _ = _routing(inst, logits)
        assert 0 < int((w == 0).sum()) < T  # some tokens pruned, some not
        exp = runner.routed_experts
        with torch.inference_mode(), set_forward_context(None, llm.llm_engine.vllm_config):
            exp.graft_skip = True
            skipped = runner._forward_impl(x, logits, None)
            exp.graft_skip = False
            full = runner._forward_impl(x, logits, None)
            exp.graft_skip = True
        assert skipped.dtype == full.dtype == torch.float32
        assert _same(skipped, full), (skipped - full).abs().max()


def test_experts_skip_any_weight0_slot_exactly(engine):
    """Hand-made routings through vLLM's RoutedExperts: a pruned first slot, a pruned second,
    a token with no kept slot, a token with both; top-2 and a top-3 routing."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from vllm_graft.integration.adapters.moe.skip import run_kept

    _, _, experts, _ = engine
    exp = experts[1]
    torch.manual_seed(1)
    for k in (2, 3):
        T = 64
        x = torch.randn(T, exp.hidden_size)
        ids = torch.stack([torch.randperm(8)[:k] for _ in range(T)]).int()
        w = torch.rand(T, k)
        w = w / w.sum(-1, keepdim=True)
        w[0::4, 0] = 0  # pruned first slot
        w[1::4, k - 1] = 0  # pruned last slot
        w[2, :] = 0  # nothing kept
        calls = []

        def rows(xr, wr, ir):
            calls.append(int(xr.shape[0]))
            return exp._graft_rows(xr, wr, ir)

        with torch.inference_mode():
            out, kept = run_kept(x, w.contiguous(), ids, rows)
            full = RoutedExperts.forward_modular(exp, x, w.contiguous(), ids)
        assert calls == [kept] and kept == int((w != 0).sum()) < T * k  # one kernel call, kept rows only
        assert _same(out, full), (out - full).abs().max()
        assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_one_kept_slot_exact_others_within_rounding(dtype):
    """vLLM's CPU kernel directly: half-precision rows come back rounded, so only tokens that
    keep one slot are bit-identical; the others are within their dtype's rounding."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    from vllm_graft.integration.adapters.moe.skip import run_kept

    torch.manual_seed(2)
    T, H, I, E = 96, 256, 128, 8
    w13 = cpu_prepack_moe_weight((torch.randn(E, 2 * I, H) * 0.05).to(dtype), "vec")
    w2 = cpu_prepack_moe_weight((torch.randn(E, H, I) * 0.05).to(dtype), "vec")
    x = torch.randn(T, H).to(dtype)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)]).int()
    w = torch.rand(T, 2)
    w = w / w.sum(-1, keepdim=True)
    one = torch.arange(T) % 3 != 0
    w[one, 1] = 0

    def kernel(xr, wr, ir):
        out = torch.empty(xr.shape[0], H, dtype=dtype)
        cpu_fused_moe(out, xr, w13, w2, None, None, wr.contiguous(), ir.contiguous(), "silu", "vec")
        return out

    out, kept = run_kept(x, w.contiguous(), ids, kernel)
    full = kernel(x, w.contiguous(), ids)
    assert kept == T + int((~one).sum())
    assert torch.equal(out[one], full[one])
    # per token, relative to its largest output (a sum of two rounded rows vs one rounding)
    a, b = out[~one].float(), full[~one].float()
    rel = ((a - b).abs().amax(-1) / b.abs().amax(-1)).max()
    assert rel <= 2 * torch.finfo(dtype).eps, rel
