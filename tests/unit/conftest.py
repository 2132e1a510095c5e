import json

import pytest

from vllm_graft.hooks import Environment, make_plugin_manager
from vllm_graft.hooks import manager as manager_mod

from . import sample_plugins


@pytest.fixture
def registry():
    """Installed plugins (the built-in noops) plus the sample plugins of this test package."""
    pm = make_plugin_manager(allow=None, trace=False)
    pm.register(sample_plugins, name="sample")
    return pm.build_registry()


@pytest.fixture
def cpu_env():
    names = {"dtype", "max_model_len", "quantization", "speculative_config", "attention_backend",
             "additional_config", "enforce_eager", "block_size", "load_format", "num_gpu_blocks_override",
             "kv_cache_memory_bytes", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
             "enable_expert_parallel"}
    return Environment(platform="cpu", vllm_version="0.32.0", engine_args=frozenset(names))


def _model(folder, arch, head_dim, dtype="float16"):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": [arch], "hidden_size": 4 * head_dim, "num_attention_heads": 4,
        "torch_dtype": dtype}))
    return folder


@pytest.fixture
def dense_model(tmp_path):
    return _model(tmp_path / "dense", "LlamaForCausalLM", 64)


@pytest.fixture
def moe_model(tmp_path):
    return _model(tmp_path / "moe", "MixtralForCausalLM", 64)


@pytest.fixture(autouse=True)
def _fresh_process_registry(monkeypatch):
    """Each test starts with no cached process-wide registry and no env switches."""
    monkeypatch.delenv("VLLM_GRAFT_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_GRAFT_TRACE", raising=False)
    manager_mod.reset()
    yield
    manager_mod.reset()
