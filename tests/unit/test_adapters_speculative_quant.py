"""The speculative and quant adapters' logic that needs no vLLM: the speculative_config they
ask for, the per-step drafting (request ids, budget, acceptance, finish), the runner glue,
and the quantised-tensor bookkeeping on a layer. The vLLM side: tests/e2e/."""
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from vllm_graft.hooks import Kind, NoParams, Proposer
from vllm_graft.integration.adapters.quant import engine as quant
from vllm_graft.integration.adapters.speculative import engine as speculative
from vllm_graft.integration.adapters.speculative.drafting import Drafting
from vllm_graft.integration.adapters.speculative.engine import GraftProposer

from .builds import vllm_loaded_by


# ------------------------------------------------------------------------------- config
class WithK(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_speculative_tokens: int = 7


def test_num_speculative_tokens_comes_from_params_else_the_default():
    assert speculative.num_speculative_tokens(NoParams()) == speculative.DEFAULT_NUM_SPECULATIVE_TOKENS == 4
    assert speculative.num_speculative_tokens(WithK()) == 7
    assert speculative.num_speculative_tokens(WithK(num_speculative_tokens=2)) == 2
    with pytest.raises(ValueError, match="positive integer"):
        speculative.num_speculative_tokens(WithK(num_speculative_tokens=0))


def test_speculative_config_names_an_importable_dotted_class():
    cfg = speculative.speculative_config(WithK())
    assert cfg == {"method": "custom_class", "num_speculative_tokens": 7,
                   "model": "vllm_graft.integration.adapters.speculative.engine.GraftProposer"}
    # vLLM's rule (config/speculative.py: _is_custom_proposer_path; custom_class_proposer.py
    # splits at the last dot): every dotted part an identifier, no colon.
    assert all(part.isidentifier() for part in cfg["model"].split("."))
    module, _, cls = cfg["model"].rpartition(".")
    assert getattr(sys.modules[module], cls) is GraftProposer


def test_engine_overrides_from_the_registry_entries():
    from vllm_graft.hooks import get_registry
    from vllm_graft.hooks.deployment import Enabled

    reg = get_registry()
    spec = Enabled(Kind.SPECULATIVE, reg.get(Kind.SPECULATIVE, "noop"), NoParams(), "speculative")
    q = Enabled(Kind.QUANT, reg.get(Kind.QUANT, "noop"), NoParams(), "quant")
    assert speculative.ADAPTER.engine_overrides([spec], None) == {
        "speculative_config": speculative.speculative_config(NoParams())}
    assert quant.ADAPTER.engine_overrides([q], None) == {"quantization": "graft-noop"}


def test_adapter_modules_import_without_vllm():
    code = ("import vllm_graft.integration.adapters.speculative.engine, "
            "vllm_graft.integration.adapters.quant.engine")
    assert vllm_loaded_by(code) == "[]"


# ----------------------------------------------------------------------------- drafting
class Echo(Proposer):
    """Drafts the last token ``n`` times (n from a table), records every call."""

    def __init__(self, n=9):
        super().__init__(NoParams())
        self.n, self.calls, self.verdicts, self.finished = n, [], [], []

    def propose(self, request_id, token_ids, max_tokens):
        self.calls.append((request_id, list(token_ids), max_tokens))
        return [token_ids[-1]] * self.n

    def accepted(self, request_id, num_accepted, num_verified):
        self.verdicts.append((request_id, num_accepted, num_verified))

    def finish(self, request_id):
        self.finished.append(request_id)


def make(plugin, k=3, max_model_len=100, vocab=50):
    counts = Counter()
    d = Drafting(plugin, "echo", k=k, max_model_len=max_model_len, vocab_size=vocab,
                 count=lambda ev, n: counts.update({ev: n}))
    return d, counts


def batch(rows, width=100):
    """token_ids (2-D int32, like vLLM's token_ids_cpu) and lengths for ``rows``."""
    ids = np.zeros((len(rows) + 2, width), dtype=np.int32)  # vLLM's array has spare rows
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return ids, np.array([len(r) for r in rows] + [0, 0], dtype=np.int32)


def test_each_row_is_proposed_from_its_own_sequence_under_its_request_id():
    p = Echo()
    d, counts = make(p)
    ids, n = batch([[1, 2, 3], [4, 5]])
    out = d.propose(["a", "b"], [[3], [5]], n, ids)
    assert out == [[3, 3, 3], [5, 5, 5]]  # cut to k=3
    assert p.calls == [("a", [1, 2, 3], 3), ("b", [4, 5], 3)]
    assert all(type(t) is int for _, seq, _ in p.calls for t in seq)
    assert counts == {"propose": 2, "drafted": 6}


def test_seeded_sampled_requests_keep_no_drafts_from_a_cross_request_proposer():
    # a seeded request's sampled tokens depend on its drafts; drafts from shared state would
    # make the same seed give different text run to run, so they are discarded (the plugin is
    # still asked, so it keeps learning)
    p = Echo()
    d, counts = make(p)
    ids, n = batch([[1, 2, 3], [4, 5]])
    assert d.propose(["a", "b"], [[3], [5]], n, ids, seeded=["b"]) == [[3, 3, 3], []]
    assert [c[0] for c in p.calls] == ["a", "b"]
    assert counts == {"propose": 2, "drafted": 3, "seeded_undrafted": 3}
    # a proposer whose drafts depend on the request alone keeps them
    q = Echo()
    q.per_request_drafts = True
    d, counts = make(q)
    assert d.propose(["a", "b"], [[3], [5]], n, ids, seeded=["b"]) == [[3, 3, 3], [5, 5, 5]]
    assert "seeded_undrafted" not in counts


def test_adaptive_forwards_per_request_drafts_of_its_inner_proposer():
    from vllm_graft.plugins.speculative.adaptive.reference import Adaptive

    inner = Echo()
    params = type("P", (), dict(num_speculative_tokens=4, fixed_cost_tokens=8.0, prior_acceptance=0.5,
                                decay=0.9, probe_every=16, learn_cost=True, measure_goodput=False,
                                per_request_length=False))()
    assert Adaptive(params, inner=inner).per_request_drafts is False
    inner.per_request_drafts = True
    assert Adaptive(params, inner=inner).per_request_drafts is True


def test_rows_mid_prefill_get_no_call_and_no_drafts():
    p = Echo()
    d, counts = make(p)
    ids, n = batch([[1, 2], [3, 4]])
    assert d.propose(["a", "b"], [[], [4]], n, ids) == [[], [4, 4, 4]]
    assert [c[0] for c in p.calls] == ["b"]


def test_budget_shrinks_at_the_length_limit():
    p = Echo()
    d, _ = make(p, k=4, max_model_len=10)
    ids, n = batch([list(range(8)), list(range(10))], width=10)
    assert d.propose(["a", "b"], [[7], [9]], n, ids) == [[7, 7], []]
    assert p.calls == [("a", list(range(8)), 2)]  # b is at the limit: not asked


def test_bad_drafts_are_refused_with_the_plugin_name():
    d, _ = make(Echo(), vocab=5)
    ids, n = batch([[1, 7]])
    with pytest.raises(ValueError, match="'echo' proposed"):
        d.propose(["a"], [[7]], n, ids)

    class Junk(Echo):
        def propose(self, request_id, token_ids, max_tokens):
            return ["x"]

    d, _ = make(Junk())
    with pytest.raises(ValueError, match=r"token ids in \[0, 50\)"):
        d.propose(["a"], [[7]], n, ids)


def test_a_step_the_plugin_says_it_drafts_nothing_asks_no_propose_but_reports_acceptance():
    """Proposer.begin_step returning False (adaptive with speculation off): no propose call
    (nor the copy of each row's tokens), every row gets no drafts, and what the previous step
    verified is still reported; None or True: propose as usual."""

    class Pausing(Echo):
        def __init__(self):
            super().__init__()
            self.drafting = False

        def begin_step(self, num_requests, num_tokens=0):
            return self.drafting

    p = Pausing()
    d, counts = make(p)
    d.step_started([], {"a": [9, 9, 9], "b": []})
    ids, n = batch([[1, 2, 3, 4], [5, 6]])
    assert d.propose(["a", "b"], [[2, 3, 4], [6]], n, ids) == [[], []]
    assert p.calls == [] and p.verdicts == [("a", 2, 3)]
    assert counts["undrafted_steps"] == 1 and "propose" not in counts
    p.drafting = True
    assert d.propose(["a", "b"], [[4], [6]], n, ids) == [[4, 4, 4], [6, 6, 6]]
    assert [c[0] for c in p.calls] == ["a", "b"] and counts["undrafted_steps"] == 1


def test_acceptance_is_reported_for_the_drafts_the_step_verified():
    p = Echo()
    d, counts = make(p)
    # step 1 verified 3 drafts of a (2 kept: 2 + 1 sampled tokens) and 2 of b (none kept);
    # c had none verified (e.g. its first decode step)
    d.step_started([], {"a": [9, 9, 9], "b": [1, 1], "c": []})
    ids, n = batch([[1, 2, 3, 4], [5, 6], [7]])
    d.propose(["a", "b", "c"], [[2, 3, 4], [6], [7]], n, ids)
    assert p.verdicts == [("a", 2, 3), ("b", 0, 2)]
    assert counts["verified"] == 5 and counts["accepted"] == 2
    # slots vLLM invalidated (-1) were not verified
    d.step_started([], {"a": [3, -1, -1]})
    d.propose(["a"], [[4]], *batch([[1, 2, 3, 4]])[::-1])
    assert p.verdicts[-1] == ("a", 0, 1)


def test_finished_requests_are_released_when_the_step_starts():
    p = Echo()
    d, counts = make(p)
    d.step_started(["x", "y"], {})
    d.step_started([], {})
    assert p.finished == ["x", "y"] and counts["finish"] == 2


class Mutating(Echo):
    """Keeps the list it is given and changes it, as a careless plugin might."""

    def propose(self, request_id, token_ids, max_tokens):
        drafts = super().propose(request_id, token_ids, max_tokens)
        token_ids.append(49)
        token_ids[0] = 48
        self.kept = token_ids
        return drafts


def test_each_call_gets_the_rows_tokens_read_incrementally_as_a_list_of_its_own():
    p = Mutating()
    d, _ = make(p)
    ids, n = batch([[1, 2, 3], [4, 5]])
    d.propose(["a", "b"], [[3], [5]], n, ids)
    # the step accepted tokens: vLLM appends them after the row's earlier tokens
    ids[0, 3:5] = [6, 7]
    n[0] = 5
    d.propose(["a", "b"], [[6, 7], [5]], n, ids)
    assert [c[1] for c in p.calls] == [[1, 2, 3], [4, 5], [1, 2, 3, 6, 7], [4, 5]]
    assert all(type(t) is int for _, seq, _ in p.calls for t in seq)
    # only the new tokens were read: what was kept is the row's prefix, not the plugin's edit
    assert d.rows["a"] == [1, 2, 3, 6, 7] and p.kept is not d.rows["b"]
    # the rows moved in the batch (b first now): each request id keeps its own tokens
    ids2, n2 = batch([[4, 5, 8], [1, 2, 3, 6, 7, 9]])
    d.propose(["b", "a"], [[8], [9]], n2, ids2)
    assert [c[1] for c in p.calls[-2:]] == [[4, 5, 8], [1, 2, 3, 6, 7, 9]]


def test_a_row_that_does_not_continue_what_was_kept_is_read_anew_and_an_ended_request_forgets_it():
    p = Echo()
    d, _ = make(p)
    ids, n = batch([[1, 2, 3, 4]])
    d.propose(["a"], [[4]], n, ids)
    for row in ([1, 2, 3, 8, 5], [7, 2, 3, 8, 5], [1, 2]):  # last kept token differs; first; shorter
        ids, n = batch([row])
        d.propose(["a"], [[row[-1]]], n, ids)
        assert p.calls[-1][1] == row and d.rows["a"] == row
    d.step_started(["a"], {})
    assert "a" not in d.rows


def test_more_rows_than_request_ids_is_an_error():
    d, _ = make(Echo())
    ids, n = batch([[1], [2]])
    with pytest.raises(RuntimeError, match="2 batch rows but only 1 request ids"):
        d.propose(["a"], [[1], [2]], n, ids)


# ------------------------------------------------------------------------- runner glue
class Runner:
    """Stands in for vLLM's model runner (which the proposer holds by weak reference)."""

    def __init__(self, drafter, req_ids=()):
        self.drafter, self.input_batch = drafter, SimpleNamespace(req_ids=list(req_ids))


def _proposer(plugin):
    gp = object.__new__(GraftProposer)  # skip __init__, which reads vLLM's config
    gp.drafting, _ = make(plugin)
    gp._runner = None
    gp.tree = None  # chains (tree verification: tests/unit/test_spec_tree_engine.py)
    return gp


def test_patched_update_states_binds_the_runner_and_finishes_requests():
    p = Echo()
    calls = []

    def original(runner, scheduler_output):
        calls.append(scheduler_output)
        return "vllm's result"

    wrapped = speculative._update_states_wrapper(original)
    runner = Runner(_proposer(p), ["r1"])
    out = SimpleNamespace(finished_req_ids={"r0"}, scheduled_spec_decode_tokens={})
    assert wrapped(runner, out) == "vllm's result" and calls == [out]
    assert p.finished == ["r0"]
    ids, n = batch([[1, 2]])
    assert runner.drafter.propose([[2]], n, ids, slot_mappings=None) == [[2, 2, 2]]
    assert p.calls[0][0] == "r1"  # the id came from the runner's batch


def test_patched_update_states_leaves_other_runners_alone():
    wrapped = speculative._update_states_wrapper(lambda runner, so: "ok")
    for drafter in (None, object()):
        assert wrapped(Runner(drafter), object()) == "ok"


def test_propose_without_the_patch_says_so():
    gp = _proposer(Echo())
    ids, n = batch([[1]])
    with pytest.raises(RuntimeError, match="patch applied"):
        gp.propose([[1]], n, ids)


# -------------------------------------------------------------------------------- quant
def test_quantization_name():
    assert quant.quantization_name("noop") == "graft-noop"


def test_check_quantized_refuses_what_cannot_be_kept_on_a_layer():
    w = torch.zeros(2, 2)
    assert quant.check_quantized({"q": w}, "p") == {"q": w}
    for bad, match in (({}, "non-empty dict"), ([w], "non-empty dict"),
                       ({"a.b": w}, "identifiers"), ({"q": [1]}, "must be tensors")):
        with pytest.raises(TypeError, match=match):
            quant.check_quantized(bad, "p")


def _layer():
    layer = torch.nn.Module()
    layer.register_parameter("weight", torch.nn.Parameter(torch.randn(4, 3), requires_grad=False))
    return layer


def test_a_plugin_that_keeps_the_weight_keeps_the_parameter():
    layer = _layer()
    w = layer.weight.data
    quant.install_tensors(layer, {"weight": w, "scale": torch.ones(4)})
    assert "weight" in layer._parameters
    t = quant.layer_tensors(layer)
    assert set(t) == {"weight", "scale"} and t["weight"] is w
    assert dict(layer.named_buffers()).keys() == {"graft_weight", "graft_scale"}
    # a view of the weight counts as keeping it
    layer2 = _layer()
    quant.install_tensors(layer2, {"t": layer2.weight.data.t()})
    assert "weight" in layer2._parameters


def test_a_plugin_that_replaces_the_weight_frees_it():
    layer = _layer()
    q = (layer.weight.data * 8).round().to(torch.int8)
    quant.install_tensors(layer, {"qweight": q, "scale": torch.full((4, 1), 1 / 8)})
    assert "weight" not in layer._parameters and not hasattr(layer, "weight")
    assert quant.layer_tensors(layer)["qweight"] is q
    layer.to(torch.float64)  # buffers follow module moves; layer_tensors reads them afresh
    assert quant.layer_tensors(layer)["scale"].dtype == torch.float64


def test_the_linear_op_runs_plugin_code_on_every_call_even_when_compiled():
    """vLLM compiles the model by default: the plugin must stay opaque to the compiler
    (arbitrary Python, counted per call), with a correct shape for the compiler."""
    import torch.nn.functional as F

    from vllm_graft.integration.runtime import RUNTIME

    class Method:  # stands in for the vLLM-facing linear method
        out_features, calls = 5, 0

        def compute(self, x, tensors, bias):
            self.calls += 1
            return F.linear(x, tensors[0], bias) if x.sum() > 0 else -F.linear(x, tensors[0], bias)

    method, key = Method(), 10**9
    RUNTIME.linear_methods[key] = method
    op = quant.quant_linear_op()
    assert op is quant.quant_linear_op()  # registered once per process
    w, b = torch.randn(5, 3), torch.randn(5)
    f = torch.compile(lambda x: op(x, [w], b, key) * 2, backend="aot_eager", fullgraph=True)
    for sign in (1, -1, 1):
        x = sign * torch.rand(4, 3)
        expected = (F.linear(x, w, b) if sign > 0 else -F.linear(x, w, b)) * 2
        torch.testing.assert_close(f(x), expected)
    assert method.calls == 3
    del RUNTIME.linear_methods[key]


def _dense_linear(weight_fn, host=True):
    """A PluginLinear (vLLM-free half) over a plugin whose ``dense_weight`` is ``weight_fn``;
    its host GEMM, when ``host``, records what it was handed."""
    from vllm_graft.integration.adapters.quant.linear import PluginLinear

    class Plugin:
        def quantize(self, w):
            return {"weight": w}

        def stored_tensors(self, out_features, in_features):
            return None

        def dense_weight(self, tensors):
            return weight_fn(tensors)

    class Linear(PluginLinear):
        handed = None

        def _host_gemm(self, layer, weight):
            if not host:
                return None
            self.handed = weight
            return SimpleNamespace(apply=lambda layer, x, bias=None: ("host", x))

    lin = Linear(Plugin(), "dense-test")
    lin.out_features, lin.in_features, lin.params_dtype = 4, 3, torch.float32
    return lin


def test_a_dense_weight_goes_to_the_host_gemm_and_apply_never_reaches_the_plugin():
    lin = _dense_linear(lambda t: t["weight"])
    layer = _layer()
    w = layer.weight.data
    lin.process_weights_after_loading(layer)
    assert lin.handed.data_ptr() == w.data_ptr() and lin.dense is not None  # the weight itself, no copy
    assert not any(n.startswith("graft_") for n, _ in layer.named_buffers())
    x = torch.randn(2, 3)
    assert lin.apply(layer, x) == ("host", x)


def test_no_dense_weight_or_no_host_gemm_keeps_the_plugin_route():
    for lin in (_dense_linear(lambda t: None), _dense_linear(lambda t: t["weight"], host=False)):
        layer = _layer()
        lin.process_weights_after_loading(layer)
        assert lin.dense is None and lin.names == ("weight",)
        assert "graft_weight" in dict(layer.named_buffers())


def test_a_dense_weight_of_the_wrong_shape_or_dtype_is_refused_naming_the_plugin():
    for bad, match in ((lambda t: t["weight"].t(), r"a \(3, 4\) torch.float32 tensor; expected a tensor of shape \(4, 3\)"),
                       (lambda t: t["weight"].double(), r"torch.float64 tensor.*in torch.float32"),
                       (lambda t: [1.0], "returned a list")):
        lin = _dense_linear(bad)
        with pytest.raises(ValueError, match="quant plugin 'dense-test': dense_weight\\(\\) returned"):
            lin.process_weights_after_loading(_layer())
        with pytest.raises(ValueError, match=match):
            _dense_linear(bad).process_weights_after_loading(_layer())


# ------------------------------------------------------------- the verify step's top-k
class Watcher(Echo):
    """Echo that asks for the target's top-2 and records what it is shown."""

    topk = 2

    def __init__(self):
        super().__init__(n=2)
        self.seen, self.steps = [], []

    def observe_topk(self, request_id, tokens, topk_ids):
        self.seen.append((request_id, list(tokens), np.asarray(topk_ids).tolist()))

    def begin_step(self, num_requests, num_tokens=0):
        self.steps.append((num_requests, num_tokens))


def test_topk_rows_reach_the_plugin_with_the_tokens_they_follow():
    p = Watcher()
    d, _ = make(p)
    assert d.topk == 2
    # a verified drafts [9, 8] (rows: before-step token, 9, 8 -> 3 rows), b had none (1 row),
    # c is mid-prefill (1 row, discarded)
    d.step_started([], {"a": [9, 8]}, 12)
    ids = np.arange(5 * 2).reshape(5, 2)
    d.logits_topk(ids, [3, 1, 1])
    tok, n = batch([[1, 2, 3, 9, 4], [5, 6, 7], [1, 1]])
    d.propose(["a", "b", "c"], [[9, 4], [7], []], n, tok)
    # a: 5 tokens now, 2 sampled this step, so the token before the step is tok[5-2-1] = 3
    assert p.seen == [("a", [3, 9, 8], [[0, 1], [2, 3], [4, 5]]), ("b", [6], [[6, 7]])]
    # begin_step got the batch size (rows with sampled tokens) and the step's tokens
    assert p.steps == [(2, 12)]
    # the top-k is used once: the next step without a new top-k shows nothing
    d.step_started([], {})
    d.propose(["b"], [[8]], *batch([[5, 6, 7, 8]])[::-1])
    assert len(p.seen) == 2


def test_topk_rows_that_do_not_add_up_are_dropped_and_invalid_drafts_cut_the_context():
    p = Watcher()
    d, _ = make(p)
    d.step_started([], {"a": [9, -1, -1]})
    d.logits_topk(np.zeros((3, 2), dtype=np.int64), [4])  # 4 rows claimed, 3 given
    assert d.pending_topk is None
    d.logits_topk(np.zeros((4, 2), dtype=np.int64), [4])
    tok, n = batch([[1, 2, 3]])
    d.propose(["a"], [[3]], n, tok)
    assert p.seen == [("a", [2, 9], [[0, 0], [0, 0]])]


def test_patched_sample_takes_topk_before_vllm_samples_only_when_asked():
    seen = []

    def original(runner, logits, meta):
        seen.append(logits.clone())
        logits.mul_(0)  # vLLM's samplers may change logits in place
        return "sampled"

    wrapped = speculative._sample_wrapper(original)
    logits = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.2, 0.3], [0.0, 0.1, 0.2]])
    gp = _proposer(Watcher())
    runner = Runner(gp, ["a"])
    meta = SimpleNamespace(num_draft_tokens=[2])
    assert wrapped(runner, logits, meta) == "sampled"
    ids, rows = gp.drafting.pending_topk
    assert ids.tolist() == [[1, 2], [0, 2], [2, 1]] and rows == [3]
    gp.drafting.pending_topk = None
    wrapped(runner, torch.tensor([[0.0, 1.0, 2.0], [3.0, 2.0, 1.0]]), None)  # no drafts: 1 row each
    assert gp.drafting.pending_topk[1] == [1, 1]
    # a plugin that did not ask (topk 0) and other runners: no top-k taken
    quiet = _proposer(Echo())
    wrapped(Runner(quiet, ["a"]), logits, meta)
    assert quiet.drafting.pending_topk is None
    assert wrapped(Runner(None), logits, meta) == "sampled"


def test_a_step_with_no_drafts_takes_the_plain_path_only_when_safe():
    """plain_step: no drafts scheduled, synchronous scheduling (asynchronous scheduling
    schedules placeholder drafts), and every KV cache group attention (a recurrent backend
    reads the previous step at an offset only the speculative path applies)."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from vllm_graft.integration.adapters.speculative.engine import plain_step

    def runner(*specs, async_scheduling=False):
        return SimpleNamespace(use_async_scheduling=async_scheduling, kv_cache_config=SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs]))

    attn = FullAttentionSpec.__new__(FullAttentionSpec)
    mamba = MambaSpec.__new__(MambaSpec)
    none, some = SimpleNamespace(scheduled_spec_decode_tokens={}), \
        SimpleNamespace(scheduled_spec_decode_tokens={"r": [1, 2]})
    assert plain_step(runner(attn), none)
    assert not plain_step(runner(attn), some)
    assert not plain_step(runner(attn, async_scheduling=True), none)
    assert not plain_step(runner(attn, mamba), none)
    assert not plain_step(runner(), none)  # no groups known: not assumed attention-only
