"""Fault-injecting test plugins, one per kind, for the fault-injection tests
(``tests/e2e/test_faults.py``, ``tests/unit/test_faults_unit.py``). Each is a working plugin
(plain attention, keep every block, no drafts, full-precision linear, softmax top-k) until a
fault is switched on; then its hot-path method misbehaves in that one way.

The fault: ``FAULT.mode`` (set by an in-process test between calls; the plugin instance lives
in the test's process) or else the plugin's ``fault`` parameter (a deployment's params reach
every vLLM process). ``FAULT.calls`` counts hot-path calls while a fault is on.

Registered as the e2e tests register test plugins: :class:`FaultPlugins` is a hookimpl object
added to a plugin manager whose registry replaces the process-wide one
(``manager._cached``); :func:`registry_with_faults` does that. Processes vLLM spawns build
their registry from entry points: :func:`install_entry_point` gives them one.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from pydantic import Field

from vllm_graft.hooks import (
    AttentionMethod,
    Capabilities,
    KVCompressor,
    MoEScheduler,
    Params,
    Proposer,
    QuantMethod,
    Registration,
    hookimpl,
)
from vllm_graft.plugins.attention._shared import paged_attention
from vllm_graft.plugins.moe.noop.reference import softmax_topk

#: seconds a ``slow`` plugin sleeps per hot-path call
SLOW_S = 0.02


class _Fault:
    """The fault switched on in this process (None: the plugin's ``fault`` parameter)."""

    mode: str | None = None
    calls: int = 0


FAULT = _Fault()


def _mode(params) -> str:
    return FAULT.mode if FAULT.mode is not None else params.fault


def _on(params, *modes: str) -> str | None:
    mode = _mode(params)
    if mode in modes:
        FAULT.calls += 1
        if mode == "slow":
            time.sleep(SLOW_S)
        return mode
    return None


class FaultParams(Params):
    fault: str = Field("none", description="the fault to inject (none: behave)")


# ------------------------------------------------------------------------------- attention
class FaultAttention(AttentionMethod):
    """Plain paged attention (``_shared.paged_attention``). Faults: ``raise`` (forward raises),
    ``raise_plan`` (plan raises), ``shape`` (one head short), ``dtype`` (integer output),
    ``not_tensor`` (returns None), ``slow``."""

    def plan(self, batch):
        if _on(self.params, "raise_plan"):
            raise RuntimeError("injected fault in plan")
        return None

    def forward(self, query, kv_cache, batch, layer, plan=None):
        mode = _on(self.params, "raise", "shape", "dtype", "not_tensor", "slow")
        if mode == "raise":
            raise RuntimeError("injected fault in forward")
        if mode == "not_tensor":
            return None
        out = paged_attention(query, kv_cache, batch, layer)
        if mode == "shape":
            return out[:, :-1]
        if mode == "dtype":
            return out.to(torch.int32)
        return out


# ------------------------------------------------------------------------------ kvcompress
class FaultKeep(KVCompressor):
    """Keeps every block. Faults: ``raise``, ``out_of_range`` (adds block ``num_blocks``),
    ``unsorted`` (descending), ``drop_last`` (drops the block being written), ``drop_pinned``
    (drops the blocks shared through the prefix cache), ``differs`` (not a function of its view:
    the first call for a request and length drops block 0, a second call with the same view,
    the worker's after the scheduler's, keeps it), ``slow``."""

    def keep(self, view):
        n = view.num_blocks
        mode = _on(self.params, "raise", "out_of_range", "unsorted", "drop_last", "drop_pinned", "differs",
                   "slow")
        if mode == "differs":
            seen = self.__dict__.setdefault("_seen", set())
            first = (view.request_id, view.num_tokens) not in seen
            seen.add((view.request_id, view.num_tokens))
            return list(range(1, n)) if first and n >= 2 and 0 not in view.pinned else list(range(n))
        if mode == "raise":
            raise RuntimeError("injected fault in keep")
        if mode == "out_of_range":
            return list(range(n + 1))
        if mode == "unsorted":
            return list(range(n))[::-1]
        if mode == "drop_last":
            return list(range(n - 1))
        if mode == "drop_pinned":
            return [i for i in range(n) if i not in view.pinned]
        return list(range(n))


# ------------------------------------------------------------------------------ speculative
class SpecParams(FaultParams):
    num_speculative_tokens: int = Field(2, ge=1, description="drafts per step")


class FaultProposer(Proposer):
    """Drafts the sequence's last token again (valid ids; mostly rejected). Faults: ``raise``,
    ``too_many`` (three more drafts than asked), ``oov`` (an id past the vocabulary),
    ``not_list`` (returns None), ``string`` (returns a str of digits), ``slow``."""

    def propose(self, request_id, token_ids, max_tokens):
        mode = _on(self.params, "raise", "too_many", "oov", "not_list", "string", "slow")
        if mode == "raise":
            raise RuntimeError("injected fault in propose")
        if mode == "oov":
            return [10**9]
        if mode == "not_list":
            return None
        if mode == "string":
            return "12"
        n = max_tokens + 3 if mode == "too_many" else max_tokens
        return [token_ids[-1]] * n


# ----------------------------------------------------------------------------------- quant
class FaultQuant(QuantMethod):
    """Full precision through the plugin route (``F.linear``). Faults: ``raise``, ``shape``
    (one output feature short), ``dtype`` (float64 output), ``slow``."""

    def quantize(self, weight):
        return {"weight": weight}

    def apply(self, tensors, x, bias):
        mode = _on(self.params, "raise", "shape", "dtype", "slow")
        if mode == "raise":
            raise RuntimeError("injected fault in apply")
        out = F.linear(x, tensors["weight"], bias)
        if mode == "shape":
            return out[..., :-1]
        if mode == "dtype":
            return out.double()
        return out


# ------------------------------------------------------------------------------------- moe
class FaultRouter(MoEScheduler):
    """Softmax top-k. Faults: ``raise``, ``ids_high`` (ids shifted past the layer's experts),
    ``ids_negative``, ``topk_shape`` (one slot too many), ``slow``."""

    def route(self, layer_idx, router_logits, top_k, renormalize):
        mode = _on(self.params, "raise", "ids_high", "ids_negative", "topk_shape", "slow")
        if mode == "raise":
            raise RuntimeError("injected fault in route")
        if mode == "topk_shape":
            return softmax_topk(router_logits, top_k + 1, renormalize)
        weights, ids = softmax_topk(router_logits, top_k, renormalize)
        if mode == "ids_high":
            ids = ids + router_logits.shape[-1]
        elif mode == "ids_negative":
            ids = ids - router_logits.shape[-1]
        return weights, ids


# ---------------------------------------------------------------------------- registration
KINDS = {  # registration hook -> (name, class, parameter model)
    "graft_register_attention": ("fault-attention", "FaultAttention", FaultParams),
    "graft_register_kv_compressors": ("fault-kvcompress", "FaultKeep", FaultParams),
    "graft_register_spec_proposers": ("fault-speculative", "FaultProposer", SpecParams),
    "graft_register_quant_methods": ("fault-quant", "FaultQuant", FaultParams),
    "graft_register_moe_schedulers": ("fault-moe", "FaultRouter", FaultParams),
}


def _register(register, hook: str, **caps) -> None:
    name, cls, params = KINDS[hook]
    register(Registration(name=name, summary=f"{cls}: injects faults (test only)", paper="-", params=params,
                          impl=f"{__name__}:{cls}", capabilities=Capabilities(lossless=True, **caps)))


class FaultPlugins:
    @hookimpl
    def graft_register_attention(self, register):
        _register(register, "graft_register_attention")

    @hookimpl
    def graft_register_kv_compressors(self, register):
        _register(register, "graft_register_kv_compressors")

    @hookimpl
    def graft_register_spec_proposers(self, register):
        _register(register, "graft_register_spec_proposers")

    @hookimpl
    def graft_register_quant_methods(self, register):
        _register(register, "graft_register_quant_methods")

    @hookimpl
    def graft_register_moe_schedulers(self, register):
        _register(register, "graft_register_moe_schedulers", architectures=("MixtralForCausalLM",))


PLUGIN = FaultPlugins()


def install_entry_point(folder) -> str:
    """Write a distribution into ``folder`` whose ``vllm_graft`` entry point is :data:`PLUGIN`
    and return ``folder``: on ``PYTHONPATH`` it makes every process vLLM spawns find the fault
    plugins as an installed third-party package would (nothing is pip-installed)."""
    from pathlib import Path

    info = Path(folder) / "vllm_graft_faults-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-graft-faults\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm_graft]\nfaults = {__name__}:PLUGIN\n")
    return str(folder)


def registry_with_faults():
    """(plugin manager, registry) with the installed plugins plus the fault plugins; set it as
    ``vllm_graft.hooks.manager._cached`` (monkeypatch) for the bridge to validate against."""
    from vllm_graft.hooks import manager as manager_mod

    pm = manager_mod.make_plugin_manager()
    pm.register(FaultPlugins(), name="tests.unit.fault_plugins")
    return pm, pm.build_registry()


__all__ = ["FAULT", "PLUGIN", "FaultPlugins", "install_entry_point", "registry_with_faults", "SLOW_S"]
