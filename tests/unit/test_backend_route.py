"""Which vLLM attention backend vllm-graft's attention/kvcompress adapters install, per platform
(no engine): CPU_ATTN overridden on CPU (the stock-derived class, or the generic one when
VLLM_GRAFT_ATTENTION_BACKEND=generic), vLLM's own backends on CUDA (tests/unit/test_cuda_backends.py)
with no engine argument asked, and a clear refusal elsewhere."""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from vllm_graft.launch import engine as launch
from vllm_graft.integration.adapters import adapter_for
from vllm_graft.integration.plan import plan_for

# vLLM (hence triton) is imported by the tests, not at collection: the kernel test modules
# collected after this one set TRITON_INTERPRET before triton is first imported.


def _vllm():
    pytest.importorskip("vllm")
    platforms = importlib.import_module("vllm.platforms")
    registry = importlib.import_module("vllm.v1.attention.backends.registry")
    backend = importlib.import_module("vllm_graft.integration.adapters.backend")
    custom = importlib.import_module("vllm_graft.integration.adapters.custom_backend")
    importlib.import_module("vllm_graft.integration.adapters.cuda_backends")  # before faking CUDA
    return platforms, registry.AttentionBackendEnum, backend, custom


def _platform(kind: str):
    return SimpleNamespace(is_cpu=lambda: kind == "cpu", is_cuda=lambda: kind == "cuda",
                           device_name=kind)


@pytest.mark.parametrize("kind, env, member, path", [
    ("cpu", "", "CPU_ATTN", "BACKEND_PATH"),
    ("cpu", "generic", "CPU_ATTN", "GENERIC_CPU_PATH"),
    ("cuda", "", "CUSTOM", "GENERIC_PATH"),
    ("cuda", "generic", "CUSTOM", "GENERIC_PATH"),
])
def test_route_per_platform(monkeypatch, kind, env, member, path):
    platforms, enum, backend, custom = _vllm()
    monkeypatch.setattr(platforms, "current_platform", _platform(kind))
    monkeypatch.setenv(backend.BACKEND_ENV, env)
    module = backend if path == "BACKEND_PATH" else custom
    table = backend.routes()
    assert table[enum[member]] == getattr(module, path)
    if kind == "cuda":  # vLLM's own backends carry the seams; CUSTOM is the fallback
        assert {m.name: table[m] for m in table if m.name in backend.CUDA_PATHS} == backend.CUDA_PATHS


def test_route_refuses_other_platforms_and_bad_env(monkeypatch):
    platforms, _, backend, _ = _vllm()
    monkeypatch.setattr(platforms, "current_platform", _platform("tpu"))
    with pytest.raises(NotImplementedError, match="CPU engine and on CUDA.*'tpu'"):
        backend.routes()
    monkeypatch.setattr(platforms, "current_platform", _platform("cpu"))
    monkeypatch.setenv(backend.BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match="expected 'generic'"):
        backend.routes()


def test_install_registers_and_uninstall_restores(monkeypatch):
    platforms, AttentionBackendEnum, backend, custom_backend = _vllm()
    monkeypatch.setattr(platforms, "current_platform", _platform("cuda"))
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    assert not backend.SEAMS.owners
    backend.install("test")
    try:
        assert AttentionBackendEnum.CUSTOM.get_path() == custom_backend.GENERIC_PATH
        assert AttentionBackendEnum.CUSTOM.get_class() is custom_backend.GraftAttentionBackend
        assert custom_backend.GraftAttentionBackend.get_name() == "CUSTOM"
    finally:
        backend.uninstall("test")
    with pytest.raises(ValueError):  # CUSTOM without a registration
        AttentionBackendEnum.CUSTOM.get_path()


@pytest.mark.parametrize("section", [{"attention": {"plugin": "hydragen"}},
                                     {"kvcompress": {"plugin": "streaming"}}])
def test_deployments_leave_the_backend_to_vllm(section):
    model = str(launch.models_dir() / "graft-tiny-llama")
    for platform, expected in (("cuda", {}), ("cpu", {})):
        plan = plan_for({"model": model, "platform": platform, **section})
        (e,) = plan.enabled
        got = adapter_for(e.kind).engine_overrides(plan.enabled, plan)
        got.pop("async_scheduling", None)  # kvcompress: tests/unit/test_async_scheduling.py
        assert got == expected


def test_generic_impl_refuses_unsupported_layers():
    custom_backend = _vllm()[3]
    with pytest.raises(NotImplementedError, match="sliding window"):
        custom_backend.GraftAttentionImpl(4, 64, 0.125, 2, sliding_window=128)
    with pytest.raises(NotImplementedError, match="KV-cache dtype 'fp8'"):
        custom_backend.GraftAttentionImpl(4, 64, 0.125, 2, kv_cache_dtype="fp8")
