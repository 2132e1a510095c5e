"""Quant plugins on a device they cannot see (issue 32, part 3), without a GPU.

* Load: every tensor a quant plugin keeps on a layer (online ``quantize`` or a pre-quantised
  checkpoint's ``verify``/``load``) ends on the device of the layer's weight, as vLLM leaves
  the weight on the accelerator and creates nothing else there
  (``model_loader/utils.py: device_loading_context`` moves parameters only).
* Calls: the body of ``vllm_graft::quant_linear`` never mixes the device with host tensors and
  never syncs with the host (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``...) when vLLM
  calls it inside a CUDA graph capture, and does not count ``apply`` there.

The "device" is a marker, self-contained here (the suite's general fake-device mode lives in
``tests/fakedevice/``): :class:`OnDevice` is a CPU tensor whose ``device`` answers ``meta`` (a
device that is not the host; the plugins' CPU-only C++ paths then step aside, as on CUDA), and
whose ops raise :class:`DeviceMix` when they meet a host tensor of dim > 0 (CUDA raises the
same way). Under :class:`FakeDevice`, ``device=`` that device (factories, ``.to``) gives marked
tensors and ``.cpu()`` unmarked ones. :func:`host_syncs` counts the Python-level host syncs
anywhere (also inside the custom op's body, which a TorchFunctionMode does not see).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from vllm_graft.integration.adapters.quant import tensors as qtensors
from vllm_graft.integration.adapters.quant.checkpoint import stored_specs
from vllm_graft.integration.adapters.quant.linear import PluginLinear
from vllm_graft.integration.adapters.quant.tensors import BUFFER_PREFIX
from vllm_graft.integration.runtime import RUNTIME
from vllm_graft.hooks import Kind

FAKE = torch.device("meta")


class DeviceMix(RuntimeError):
    pass


_TO_HOST = {"cpu", "numpy", "tolist", "item", "__bool__", "__int__", "__float__", "__index__"}
_MAY_CROSS = {"to", "copy_", "__setitem__"}  # cross-device copies CUDA allows


def _name(func) -> str:
    return getattr(func, "__name__", "") or str(func)


def _mark(out):
    return tree_map(lambda t: t.as_subclass(OnDevice)
                    if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t, out)


class OnDevice(torch.Tensor):
    """A tensor "on the device" (its data is on the CPU)."""

    @property
    def device(self):  # noqa: D401 - what plugin code sees
        return FAKE

    @property
    def is_cuda(self):
        return False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        marked = any(isinstance(a, OnDevice) for a in leaves)
        name = _name(func)
        host = [tuple(a.shape) for a in leaves if not isinstance(a, OnDevice) and a.dim() > 0]
        if marked and host and name not in _MAY_CROSS:
            raise DeviceMix(f"{name}: a device tensor meets host tensor(s) {host}")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if name in _TO_HOST:  # a host copy (on the CPU, .cpu() returns the same object)
            return out.as_subclass(torch.Tensor) if isinstance(out, OnDevice) else out
        return _mark(out) if marked else out

    def __repr__(self, **kw):
        return f"OnDevice({self.as_subclass(torch.Tensor)!r})"


def _target(args, kwargs):
    """The device a ``.to``/factory call names (None: none)."""
    for a in (*args, kwargs.get("device")):
        if isinstance(a, (torch.device, str)):
            try:
                return torch.device(a)
            except RuntimeError:
                continue
    return None


class FakeDevice(TorchFunctionMode):
    """``device=meta`` in a factory, or ``.to(meta)``: a marked CPU tensor; ``.to("cpu")`` of a
    marked one: unmarked."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = _name(func)
        if name == "to":
            dev = _target(args[1:], kwargs)
            if dev is not None:
                self_, rest = args[0], [a if not isinstance(a, (torch.device, str)) else "cpu"
                                         for a in args[1:]]
                if "device" in kwargs:
                    kwargs["device"] = "cpu"
                with torch._C.DisableTorchFunctionSubclass():
                    out = torch.Tensor.to(self_, *rest, **kwargs)
                    if dev == FAKE:
                        return out.as_subclass(OnDevice)
                    return out.as_subclass(torch.Tensor)
        elif kwargs.get("device") is not None and torch.device(kwargs["device"]) == FAKE:
            kwargs["device"] = "cpu"
            with torch._C.DisableTorchFunctionSubclass():
                return _mark(func(*args, **kwargs))
        return func(*args, **kwargs)


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.clone().as_subclass(OnDevice)


def is_on_device(t) -> bool:
    return isinstance(t, OnDevice)


@contextlib.contextmanager
def host_syncs():
    """Count the host syncs made from Python anywhere (custom op bodies included)."""
    seen: list[str] = []
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def recorder(n, orig):
        def f(self, *a, **k):
            seen.append(n)
            return orig(self, *a, **k)
        return f

    for n, orig in saved.items():
        setattr(torch.Tensor, n, recorder(n, orig))
    try:
        yield seen
    finally:
        for n, orig in saved.items():
            setattr(torch.Tensor, n, orig)


# ------------------------------------------------------------------------------ the plugins
def _plugins():
    from vllm_graft.plugins.quant.dfloat11 import DFloat11Params
    from vllm_graft.plugins.quant.dfloat11.reference import DFloat11
    from vllm_graft.plugins.quant.noop import FullPrecisionParams
    from vllm_graft.plugins.quant.noop.reference import FullPrecision
    from vllm_graft.plugins.quant.squeezellm import SqueezeLLMParams
    from vllm_graft.plugins.quant.squeezellm.reference import SqueezeLLM
    from vllm_graft.plugins.quant.w4a8 import W4A8Params
    from vllm_graft.plugins.quant.w4a8.reference import W4A8

    return {
        "noop": lambda: FullPrecision(FullPrecisionParams(host_gemm=False)),
        "dfloat11": lambda: DFloat11(DFloat11Params(chunk=16)),
        "dfloat11-torch": lambda: DFloat11(DFloat11Params(chunk=16, cpu_decoder="torch")),
        "w4a8": lambda: W4A8(W4A8Params(group_size=8)),
        "w4a8-packed": lambda: W4A8(W4A8Params(group_size=8, cpu_weights="packed")),
        "squeezellm": lambda: SqueezeLLM(SqueezeLLMParams(kmeans_iters=2, outliers=0.05)),
        "squeezellm-packed": lambda: SqueezeLLM(SqueezeLLMParams(kmeans_iters=2, outliers=0.05,
                                                                 cpu_weights="packed")),
    }


PLUGINS = list(_plugins())
SHARDS = [8, 4, 4]  # a fused q/k/v layer
IN = 32


def _dtype(key):
    return torch.bfloat16 if key.startswith("dfloat11") else torch.float32


def _method(key, prequantized=False):
    plugin = _plugins()[key]()
    m = PluginLinear(plugin, key.split("-")[0], prefix="model.layers.0.self_attn.qkv_proj",
                     prequantized=prequantized)
    m.out_features, m.in_features, m.shard_rows = sum(SHARDS), IN, list(SHARDS)
    m.params_dtype = _dtype(key)
    return m


def _weight(key):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(sum(SHARDS), IN, generator=g) * 0.05).to(_dtype(key))


def _online_layer(key):
    """What vLLM hands ``process_weights_after_loading``: a layer whose loaded ``weight`` is on
    the device."""
    m = _method(key)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(on_device(_weight(key)), requires_grad=False)
    with FakeDevice():
        m.process_weights_after_loading(layer)
    return m, layer


def _prequantized_layer(key):
    """A pre-quantised checkpoint as vLLM loads it: fixed-shape stored tensors are parameters
    created on the device (``with target_device:``) and filled by the weight loader; ragged ones
    arrive from the checkpoint reader on the host, per shard."""
    m = _method(key, prequantized=True)
    specs = stored_specs(m.plugin, m.name, m.out_features, m.in_features)
    m.specs, m.seen, m.parts = specs, {n: set() for n in specs}, {n: {} for n in specs}
    layer = torch.nn.Module()
    w = _weight(key)
    shards = [m.plugin.quantize(part) for part in torch.split(w, SHARDS, 0)]  # on the host
    for tname, spec in specs.items():
        if spec.ragged:  # an empty placeholder parameter, its shards kept by _collect
            layer.register_parameter(tname, torch.nn.Parameter(
                on_device(torch.empty(0, dtype=getattr(torch, spec.dtype))), requires_grad=False))
            for i, sh in enumerate(shards):
                m._collect(tname, None, sh[tname], shard_id=i)
            continue
        p = torch.nn.Parameter(on_device(torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))),
                               requires_grad=False)
        layer.register_parameter(tname, p)

        def loader(param, loaded, shard_id, tname=tname):
            rows = [r * spec.shape[0] // m.out_features for r in SHARDS]
            start = sum(rows[:shard_id])
            param.data[start:start + rows[shard_id]] = loaded  # a host-to-device copy

        for i, sh in enumerate(shards):
            m._load_rows(tname, loader, p, sh[tname], shard_id=i)
    layer.weight = torch.nn.Parameter(on_device(torch.empty(0)), requires_grad=False)  # the trap
    with FakeDevice():
        m.process_weights_after_loading(layer)
    return m, layer, w


def _plugin_buffers(layer):
    return {n: b for n, b in layer.named_buffers() if n.startswith(BUFFER_PREFIX)}


def test_the_fake_device_catches_what_cuda_refuses():
    d = on_device(torch.ones(4))
    with pytest.raises(DeviceMix):
        d + torch.ones(4)
    with pytest.raises(DeviceMix):
        torch.zeros(4)[torch.arange(2).as_subclass(OnDevice)]
    with FakeDevice():
        assert is_on_device(torch.zeros(3, device=d.device)) and is_on_device(d + 1)
        assert is_on_device(torch.ones(2).to(d.device)) and not is_on_device(d.cpu())
        assert d.device == FAKE


@pytest.mark.parametrize("key", PLUGINS)
def test_online_quantised_tensors_follow_the_weight(key):
    m, layer = _online_layer(key)
    bufs = _plugin_buffers(layer)
    assert bufs and set(bufs) == {BUFFER_PREFIX + n for n in m.names}
    host = [n for n, b in bufs.items() if not is_on_device(b)]
    assert not host, f"{key}: buffers left on the host: {host}"


@pytest.mark.parametrize("key", [k for k in PLUGINS if k != "noop"])
def test_prequantized_tensors_follow_the_weight(key):
    m, layer, _ = _prequantized_layer(key)
    bufs = _plugin_buffers(layer)
    assert bufs
    host = [n for n, b in bufs.items() if not is_on_device(b)]
    assert not host, f"{key}: buffers left on the host: {host}"


@pytest.mark.parametrize("key", PLUGINS)
@pytest.mark.parametrize("prequantized", [False, True])
def test_apply_on_the_device_without_host_syncs_under_capture(key, prequantized, monkeypatch):
    """vLLM calls the op inside a CUDA-graph capture: the body must not sync with the host, nor
    make a host tensor that meets the device; its event is ``captured``, not ``apply``."""
    if prequantized and key == "noop":
        pytest.skip("noop quantises online only")
    m, layer, *_ = _prequantized_layer(key) if prequantized else _online_layer(key)
    monkeypatch.setattr(qtensors, "capturing", lambda x: True)
    import vllm_graft.integration.adapters.quant.linear as qlinear

    monkeypatch.setattr(qlinear, "capturing", lambda x: True)
    x = on_device(torch.randn(3, IN).to(m.params_dtype))
    before = RUNTIME.counts(Kind.QUANT, m.name)
    tensors = qtensors.layer_tensors(layer)
    with FakeDevice(), host_syncs() as syncs:
        y = m.compute(x, [tensors[n] for n in m.names], None)  # the op's body, as the op runs it
    assert syncs == [], f"{key}: host syncs inside the op body: {syncs}"
    assert is_on_device(y) and tuple(y.shape) == (3, sum(SHARDS))
    after = RUNTIME.counts(Kind.QUANT, m.name)
    assert after.get("apply", 0) == before.get("apply", 0)
    assert after.get("captured", 0) == before.get("captured", 0) + 1


@pytest.mark.parametrize("key", ["dfloat11-torch", "squeezellm-packed", "w4a8-packed"])
def test_device_path_computes_what_the_host_path_does(key):
    """The device-side code (multi-shard dfloat11 decode without a count read on the host)
    gives the layer the host computes."""
    m, layer, w = _prequantized_layer(key)
    x = torch.randn(5, IN).to(m.params_dtype)
    tensors = qtensors.layer_tensors(layer)
    with FakeDevice():
        y = m.compute(on_device(x), [tensors[n] for n in m.names], None)
    host = {n: t.as_subclass(torch.Tensor) for n, t in tensors.items()}
    want = m.plugin.apply(host, x, None)
    torch.testing.assert_close(y.as_subclass(torch.Tensor), want)
    if key.startswith("dfloat11"):  # lossless: the decoded weight is the original, bit for bit
        assert torch.equal(m.plugin.weight(host).view(torch.int16), w.view(torch.int16))


def test_through_the_op_on_the_host_counts_apply():
    """On the CPU engine nothing is captured: the op counts ``apply`` as before."""
    m, layer = _online_layer("w4a8")
    for n, b in list(layer.named_buffers()):
        layer.register_buffer(n, b.as_subclass(torch.Tensor), persistent=False)
    before = RUNTIME.counts(Kind.QUANT, m.name).get("apply", 0)
    with host_syncs() as syncs:
        m.apply(layer, torch.randn(2, IN), None)
    assert syncs == []
    assert RUNTIME.counts(Kind.QUANT, m.name).get("apply", 0) == before + 1


class _HostBuilt:
    """A third-party-style method that builds its tensors with NumPy (on the host), as many do:
    the adapter, not the plugin, puts them on the weight's device."""

    def __new__(cls):
        import numpy as np

        from vllm_graft.hooks import QuantMethod
        from vllm_graft.plugins.quant.noop import FullPrecisionParams

        class HostBuilt(QuantMethod):
            def quantize(self, weight):
                w = weight.detach().cpu().numpy()
                return {"w": torch.from_numpy(np.ascontiguousarray(w)),
                        "rows": torch.from_numpy(np.arange(w.shape[0]))}

            def apply(self, tensors, x, bias):
                return torch.nn.functional.linear(x, tensors["w"][tensors["rows"]], bias)

        return HostBuilt(FullPrecisionParams(host_gemm=False))


def test_a_plugin_that_builds_on_the_host_gets_device_buffers():
    m = PluginLinear(_HostBuilt(), "hostbuilt", prefix="model.layers.0.mlp.down_proj")
    m.out_features, m.in_features, m.shard_rows, m.params_dtype = 6, IN, [6], torch.float32
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(on_device(torch.randn(6, IN)), requires_grad=False)
    with FakeDevice():
        m.process_weights_after_loading(layer)
        bufs = _plugin_buffers(layer)
        assert bufs and all(is_on_device(b) for b in bufs.values()), \
            [n for n, b in bufs.items() if not is_on_device(b)]
        tensors = qtensors.layer_tensors(layer)
        y = m.compute(on_device(torch.randn(2, IN)), [tensors[n] for n in m.names], None)
    assert is_on_device(y)
