"""How a deployment's MoE schedulers compose (MoEChain), with plain tensors: no vLLM.

Rules under test (hooks/contracts/moe.py, MoEScheduler; integration/adapters/moe/chain.py): every adjust_logits in list order,
then the LAST plugin overriding route routes (else the model's own top-k, on the adjusted
logits), then every observe in list order with the final routing.
"""
import pytest
import torch
from vllm_graft.hooks import MoEScheduler, NoParams
from vllm_graft.hooks.contracts import MOE_STEPS
from vllm_graft.integration.adapters.moe.chain import MoEChain
from vllm_graft.plugins.moe.noop.reference import TopK, softmax_topk

T, E, K = 6, 8, 2


def logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g)


class Log(list):
    """Calls in the order they happened: (plugin label, step, layer)."""


class Mask(MoEScheduler):
    def __init__(self, expert, log=None, label="mask"):
        super().__init__(NoParams())
        self.expert, self.log, self.label = expert, log, label

    def adjust_logits(self, layer_idx, router_logits):
        if self.log is not None:
            self.log.append((self.label, "adjust_logits", layer_idx, router_logits.clone()))
        out = router_logits.clone()
        out[:, self.expert] = float("-inf")
        return out


class Affine(MoEScheduler):
    """logits * scale + shift: two of these do not commute, so their order shows."""

    def __init__(self, scale, shift, log=None, label="affine"):
        super().__init__(NoParams())
        self.scale, self.shift, self.log, self.label = scale, shift, log, label

    def adjust_logits(self, layer_idx, router_logits):
        if self.log is not None:
            self.log.append((self.label, "adjust_logits", layer_idx, None))
        return router_logits * self.scale + self.shift


class LowestK(MoEScheduler):
    """Routes each token to its k LOWEST-logit experts, equal weights: unlike any top-k."""

    def __init__(self, log=None, label="lowest"):
        super().__init__(NoParams())
        self.log, self.label = log, label

    def route(self, layer_idx, router_logits, top_k, renormalize):
        if self.log is not None:
            self.log.append((self.label, "route", layer_idx, router_logits.clone()))
        ids = router_logits.topk(top_k, dim=-1, largest=False).indices  # int64
        return torch.full(ids.shape, 1.0 / top_k, dtype=torch.float64), ids


class Trace(MoEScheduler):
    def __init__(self, log=None, label="trace"):
        super().__init__(NoParams())
        self.log, self.label = log, label
        self.seen = []

    def observe(self, layer_idx, topk_ids, topk_weights):
        self.seen.append((layer_idx, topk_ids.clone(), topk_weights.clone()))
        if self.log is not None:
            self.log.append((self.label, "observe", layer_idx, None))


class MaskAndTrace(Mask, Trace):
    def __init__(self, expert, log=None, label="mask+trace"):
        Mask.__init__(self, expert, log, label)
        self.seen = []


class Nothing(MoEScheduler):
    pass


def model_topk_recording(calls):
    """The 'model's own top-k' (as vLLM's CPU router computes it), recording its input."""
    def topk(lg):
        calls.append(lg.clone())
        w, i = softmax_topk(lg, K, True)
        return w, i.int()
    return topk


class Counter:
    def __init__(self):
        self.events = {}

    def __call__(self, name, event, n):
        self.events[(name, event)] = self.events.get((name, event), 0) + n


# ---------------------------------------------------------------------------- the contract
def test_steps_a_class_implements_are_read_from_the_class():
    assert MOE_STEPS == ("adjust_logits", "route", "observe")
    assert [s for s in MOE_STEPS if Mask.implements(s)] == ["adjust_logits"]
    assert [s for s in MOE_STEPS if LowestK.implements(s)] == ["route"]
    assert [s for s in MOE_STEPS if Trace.implements(s)] == ["observe"]
    assert [s for s in MOE_STEPS if MaskAndTrace.implements(s)] == ["adjust_logits", "observe"]
    assert [s for s in MOE_STEPS if TopK.implements(s)] == ["route"]  # the noop plugin
    assert not any(Nothing.implements(s) for s in MOE_STEPS)
    with pytest.raises(ValueError, match="unknown MoE step 'routes'"):
        Mask.implements("routes")


def test_defaults_are_identity_nothing_and_no_routing():
    s, lg = Nothing(NoParams()), logits()
    assert s.adjust_logits(0, lg) is lg
    assert s.observe(0, torch.zeros(T, K, dtype=torch.int32), torch.zeros(T, K)) is None
    with pytest.raises(NotImplementedError, match="model's own top-k"):
        s.route(0, lg, K, True)


def test_a_route_only_plugin_written_for_the_old_contract_still_works():
    class OldStyle(MoEScheduler):
        def route(self, layer_idx, router_logits, top_k, renormalize):
            return softmax_topk(router_logits, top_k, renormalize)

    w, ids = MoEChain([("old", OldStyle(NoParams()))])(0, logits(), K, True, lambda lg: pytest.fail("not used"))
    ref_w, ref_ids = softmax_topk(logits(), K, True)
    assert torch.equal(ids, ref_ids.int()) and torch.equal(w, ref_w)


# ------------------------------------------------------------------------------ composition
def test_without_a_router_the_model_routes_the_adjusted_logits():
    calls, lg = [], logits()
    chain = MoEChain([("mask", Mask(3))])
    assert not chain.routes and chain.router is None
    w, ids = chain(0, lg, K, True, model_topk_recording(calls))
    assert len(calls) == 1 and torch.isinf(calls[0][:, 3]).all()  # the model saw the mask
    assert not (ids == 3).any()
    assert torch.isfinite(lg).all()  # the caller's logits were not modified in place
    w_ref, ids_ref = softmax_topk(calls[0], K, True)
    assert torch.equal(ids, ids_ref.int()) and torch.equal(w, w_ref)


def test_adjust_logits_run_in_list_order_each_on_the_previous_output():
    lg = logits()
    double_then_shift = MoEChain([("a", Affine(2.0, 0.0)), ("b", Affine(1.0, 5.0))])
    shift_then_double = MoEChain([("b", Affine(1.0, 5.0)), ("a", Affine(2.0, 0.0))])
    seen = []
    double_then_shift(0, lg, K, True, model_topk_recording(seen))
    shift_then_double(0, lg, K, True, model_topk_recording(seen))
    torch.testing.assert_close(seen[0], lg * 2 + 5)
    torch.testing.assert_close(seen[1], (lg + 5) * 2)


def test_the_last_router_in_the_list_routes_and_earlier_ones_are_not_called():
    log = Log()
    first, last = LowestK(log, "first"), TopK(NoParams())
    chain = MoEChain([("first", first), ("noop", last)])
    assert chain.router == ("noop", last) and chain.overruled == ["first"]
    w, ids = chain(0, logits(), K, True, lambda lg: pytest.fail("a plugin routes"))
    assert log == []  # `first` never ran
    ref_w, ref_ids = softmax_topk(logits(), K, True)
    assert torch.equal(ids, ref_ids.int()) and torch.equal(w, ref_w)

    chain = MoEChain([("noop", last), ("lowest", LowestK())])  # now the other way round
    w, ids = chain(0, logits(), K, True, lambda lg: pytest.fail("a plugin routes"))
    assert torch.equal(ids, logits().topk(K, largest=False).indices.int())


def test_full_order_adjust_then_route_then_observe_wherever_the_plugins_stand():
    """Observers listed before the mask and router still see the final routing; the router
    routes the masked logits."""
    log = Log()
    trace = Trace(log, "trace")
    mask_trace = MaskAndTrace(0, log, "mask+trace")
    chain = MoEChain([("trace", trace), ("mask", Mask(7, log, "mask")), ("lowest", LowestK(log, "lowest")),
                      ("mask+trace", mask_trace)])
    assert chain.participants == ["trace", "mask", "lowest", "mask+trace"]
    w, ids = chain(5, logits(), K, True, lambda lg: pytest.fail("a plugin routes"))
    assert [(label, step, layer) for label, step, layer, _ in log] == [
        ("mask", "adjust_logits", 5), ("mask+trace", "adjust_logits", 5), ("lowest", "route", 5),
        ("trace", "observe", 5), ("mask+trace", "observe", 5)]
    routed_on = log[2][3]
    assert torch.isinf(routed_on[:, 7]).all() and torch.isinf(routed_on[:, 0]).all()
    # a lowest-logit router picks the two -inf experts for every token: it got the masked logits
    assert ((ids == 7) | (ids == 0)).all()
    for observer in (trace, mask_trace):
        (layer, seen_ids, seen_w), = observer.seen
        assert layer == 5 and torch.equal(seen_ids, ids) and torch.equal(seen_w, w)


def test_observers_see_the_models_own_routing_when_no_plugin_routes():
    trace, calls = Trace(), []
    w, ids = MoEChain([("trace", trace)])(2, logits(), K, True, model_topk_recording(calls))
    (layer, seen_ids, seen_w), = trace.seen
    assert layer == 2 and torch.equal(seen_ids, ids) and torch.equal(seen_w, w)
    assert torch.equal(calls[0], logits())  # nothing adjusted


# ------------------------------------------------------------------------- outputs, counts
def test_plugin_routing_is_converted_to_float32_and_int32_contiguous():
    w, ids = MoEChain([("lowest", LowestK())])(0, logits(), K, True, None)
    assert (w.dtype, ids.dtype) == (torch.float32, torch.int32)
    assert w.is_contiguous() and ids.is_contiguous()


@pytest.mark.parametrize("bad,error,match", [
    (lambda lg, k: (torch.ones(T, k + 1), torch.zeros(T, k + 1, dtype=torch.long)), ValueError,
     r"'bad': route returned weights \(6, 3\) and ids \(6, 3\); both must be \[T, top_k\] = \[6, 2\]"),
    (lambda lg, k: (torch.ones(T, k), torch.zeros(T, k)), TypeError, "integer ids"),
    (lambda lg, k: (torch.ones(T, k, dtype=torch.long), torch.zeros(T, k, dtype=torch.long)), TypeError,
     "floating weights"),
])
def test_bad_routing_is_refused_naming_the_plugin(bad, error, match):
    class Bad(MoEScheduler):
        def route(self, layer_idx, router_logits, top_k, renormalize):
            return bad(router_logits, top_k)

    with pytest.raises(error, match=match):
        MoEChain([("bad", Bad(NoParams()))])(0, logits(), K, True, None)


def test_adjust_logits_must_keep_the_shape():
    class Drop(MoEScheduler):
        def adjust_logits(self, layer_idx, router_logits):
            return router_logits[:, :-1]

    with pytest.raises(ValueError, match=r"'drop': adjust_logits returned shape \(6, 7\) for logits of shape \(6, 8\)"):
        MoEChain([("drop", Drop(NoParams()))])(0, logits(), K, True, model_topk_recording([]))


def test_counts_per_plugin_and_layer_call():
    count = Counter()
    chain = MoEChain([("lowest", LowestK()), ("mask", Mask(1)), ("noop", TopK(NoParams())),
                      ("trace", Trace())], count=count)
    for layer in range(4):
        chain(layer, logits(layer), K, True, None)
    assert count.events == {
        ("mask", "adjust_logits"): 4, ("mask", "tokens"): 4 * T,
        ("noop", "route"): 4, ("noop", "tokens"): 4 * T,
        ("trace", "observe"): 4, ("trace", "tokens"): 4 * T,
    }  # 'lowest' is overruled by 'noop': never called, never counted


def test_chains_that_would_do_nothing_are_refused():
    with pytest.raises(TypeError, match="MoE plugin 'idle': Nothing overrides none of adjust_logits, route, observe"):
        MoEChain([("mask", Mask(0)), ("idle", Nothing(NoParams()))])
    with pytest.raises(TypeError, match="'x': .* is not a vllm_graft.hooks.MoEScheduler"):
        MoEChain([("x", object())])
    with pytest.raises(ValueError, match="at least one"):
        MoEChain([])


# ----------------------------------------------------------------------------- the noop
@pytest.mark.parametrize("renormalize", [True, False])
def test_noop_softmax_topk_is_softmax_then_topk(renormalize):
    """The noop computes on the top-k logits (as vLLM's CPU router does); the result is the
    textbook definition: softmax over all experts, top-k, optionally divided by the sum."""
    lg = torch.randn(1000, E, generator=torch.Generator().manual_seed(1)) * 3
    w, ids = softmax_topk(lg, K, renormalize)
    probs = lg.softmax(-1)
    ref_w, ref_ids = probs.topk(K, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
    assert w.dtype == torch.float32


def test_noop_computes_in_float32_for_half_logits():
    lg = logits().half()
    w, ids = softmax_topk(lg, K, True)
    assert w.dtype == torch.float32
    assert torch.equal(ids, lg.float().topk(K).indices)
