"""Quant plugins on a device they cannot see (issue 32, part 3), without a GPU.

* Load: every tensor a quant plugin keeps on a layer (online ``quantize`` or a pre-quantised
  checkpoint's ``verify``/``load``) ends on the device of the layer's weight, as vLLM leaves
  the weight on the accelerator and creates nothing else there
  (``model_loader/utils.py: device_loading_context`` moves parameters only).
* Calls: the body of ``vllm_graft::quant_linear`` never mixes the device with host tensors and
  never syncs with the host (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``...) when vLLM
  calls it inside a CUDA graph capture, and does not count ``apply`` there.

The device is the suite's fake CUDA device (:mod:`vllm_graft.kit.fakedevice`): CPU tensors
marked as on ``cuda:0``; an op that mixes one with a host tensor of dim > 0 raises
:class:`~vllm_graft.kit.fakedevice.DeviceMixError` (CUDA raises the same way), and host syncs on
device tensors are recorded. The op's body is called as the op runs it (``compute``), so the
mode sees inside it.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from vllm_graft.integration.adapters.plugin_calls import PluginRaised
from vllm_graft.integration.adapters.quant import tensors as qtensors
from vllm_graft.integration.adapters.quant.checkpoint import stored_specs
from vllm_graft.integration.adapters.quant.linear import PluginLinear
from vllm_graft.integration.adapters.quant.tensors import BUFFER_PREFIX
from vllm_graft.integration.runtime import RUNTIME
from vllm_graft.hooks import Kind
from vllm_graft.kit.fakedevice import FAKE as FAKE_DEVICE
from vllm_graft.kit.fakedevice import DeviceMixError, FakeDevice

#: The suite's fake device (vllm_graft.kit.fakedevice): one instance, so a tensor marked by
#: ``on_device`` stays marked in every ``with FD:`` block of a test.
FD = FakeDevice()
FAKE = FAKE_DEVICE


def on_device(t: torch.Tensor) -> torch.Tensor:
    return FD.put(t.clone())


def is_on_device(t) -> bool:
    return FD.is_marked(t)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    """A parameter on the device, as vLLM leaves a loaded weight."""
    return FD.put(torch.nn.Parameter(t, requires_grad=False))


@contextlib.contextmanager
def host_syncs():
    """The host syncs made on device tensors meanwhile (``.item()``, ``.tolist()``, ``bool(t)``,
    ``.cpu()``...), as the fake device records them."""
    seen: list[str] = []
    first = len(FD.syncs)
    try:
        yield seen
    finally:
        seen.extend(f"{s.op} at {s.where}" for s in FD.syncs[first:])


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
    layer.weight = _param(_weight(key))
    with FD:
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
            layer.register_parameter(tname, _param(torch.empty(0, dtype=getattr(torch, spec.dtype))))
            for i, sh in enumerate(shards):
                m._collect(tname, None, sh[tname], shard_id=i)
            continue
        p = _param(torch.empty(spec.shape, dtype=getattr(torch, spec.dtype)))
        layer.register_parameter(tname, p)

        def loader(param, loaded, shard_id, tname=tname):
            rows = [r * spec.shape[0] // m.out_features for r in SHARDS]
            start = sum(rows[:shard_id])
            param.data[start:start + rows[shard_id]] = loaded  # a host-to-device copy

        for i, sh in enumerate(shards):
            m._load_rows(tname, loader, p, sh[tname], shard_id=i)
    layer.weight = _param(torch.empty(0))  # the trap
    with FD:
        m.process_weights_after_loading(layer)
    return m, layer, w


def _plugin_buffers(layer):
    return {n: b for n, b in layer.named_buffers() if n.startswith(BUFFER_PREFIX)}


def test_the_fake_device_catches_what_cuda_refuses():
    d = on_device(torch.ones(4))
    with FD:
        with pytest.raises(DeviceMixError):
            d + torch.ones(4)
        with pytest.raises(DeviceMixError):
            torch.zeros(4)[FD.put(torch.arange(2))]
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
    with FD, host_syncs() as syncs:
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
    with FD:
        y = m.compute(on_device(x), [tensors[n] for n in m.names], None)
    host = {n: t.detach().clone() for n, t in tensors.items()}  # unmarked: the host's copy
    want = m.plugin.apply(host, x, None)
    torch.testing.assert_close(y.detach().clone(), want)
    if key.startswith("dfloat11"):  # lossless: the decoded weight is the original, bit for bit
        assert torch.equal(m.plugin.weight(host).view(torch.int16), w.view(torch.int16))


def test_through_the_op_on_the_host_counts_apply():
    """On the CPU engine nothing is captured: the op counts ``apply`` as before."""
    m, layer = _online_layer("w4a8")
    for n, b in list(layer.named_buffers()):
        layer.register_buffer(n, b.detach().clone(), persistent=False)  # unmarked: the host
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


def _host_built_layer():
    """The host-building plugin's method and a layer whose weight is on the device, loaded."""
    m = PluginLinear(_HostBuilt(), "hostbuilt", prefix="model.layers.0.mlp.down_proj")
    m.out_features, m.in_features, m.shard_rows, m.params_dtype = 6, IN, [6], torch.float32
    layer = torch.nn.Module()
    layer.weight = _param(torch.randn(6, IN))
    with FD:
        m.process_weights_after_loading(layer)
    return m, layer


def test_a_plugin_that_builds_on_the_host_gets_device_buffers():
    m, layer = _host_built_layer()
    with FD:
        bufs = _plugin_buffers(layer)
        assert bufs and all(is_on_device(b) for b in bufs.values()), \
            [n for n, b in bufs.items() if not is_on_device(b)]
        tensors = qtensors.layer_tensors(layer)
        y = m.compute(on_device(torch.randn(2, IN)), [tensors[n] for n in m.names], None)
    assert is_on_device(y)


def test_without_the_adapter_moving_them_host_built_buffers_fail_on_the_device(monkeypatch):
    """The fix put back: with the adapter keeping what the plugin built where it was built, the
    buffers stay on the host and the first call mixes them with device activations."""
    import vllm_graft.integration.adapters.quant.linear as qlinear

    for module in (qtensors, qlinear):
        monkeypatch.setattr(module, "follow_device", lambda tensors, device: tensors)
    m, layer = _host_built_layer()
    with FD:
        assert not any(is_on_device(b) for b in _plugin_buffers(layer).values())
        tensors = qtensors.layer_tensors(layer)
        with pytest.raises(PluginRaised) as caught:  # the adapter names the plugin, the cause is kept
            m.compute(on_device(torch.randn(2, IN)), [tensors[n] for n in m.names], None)
        assert isinstance(caught.value.__cause__, DeviceMixError)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("out_in", [(16, 32), (12, 20)])
def test_w4a8_int_mm_path_takes_cuda_s_shapes(rows, out_in):
    """CUDA's ``torch._int_mm`` refuses 16 rows or fewer and columns not a multiple of 8 (the fake
    device raises as CUDA does, :data:`~vllm_graft.kit.fakedevice.CUDA_LIMITS`): w4a8's default
    path (``cpu_weights: int8``) pads to its shapes on the device and gives the emulation's result
    bit for bit, for decode batches and CUDA-graph capture sizes 1-16 too."""
    from vllm_graft.plugins.quant.w4a8 import W4A8Params
    from vllm_graft.plugins.quant.w4a8.reference import W4A8, emulate

    out, n = out_in
    plugin = W4A8(W4A8Params(group_size=8))
    g = torch.Generator().manual_seed(rows)
    stored = plugin.quantize(torch.randn(out, n, generator=g) * 0.05)
    x = torch.randn(rows, n, generator=g)
    want = emulate(x, stored, 8)
    with FD:
        tensors = plugin.load({k: [on_device(v)] for k, v in stored.items()}, [out])
        assert "weight_int8" in tensors
        y = plugin.apply(tensors, on_device(x), None)
        assert is_on_device(y)
    assert tuple(y.shape) == (rows, out)
    assert torch.equal(y.detach().clone(), want)
    # without the padding, CUDA's kernel refuses the call: the fake device says so
    from vllm_graft.kit.fakedevice import CudaLimitError

    if rows <= 16:
        with FD, pytest.raises(CudaLimitError, match="greater than 16"):
            torch._int_mm(on_device(torch.zeros(rows, 8, dtype=torch.int8)), on_device(torch.zeros(8, 8, dtype=torch.int8)))
