"""KV-compression deployments turn vLLM's async scheduling off (issue 32, breakage 2): with it
on (CUDA vLLM 0.33's default) the step's drops ride an AsyncGPUModelRunnerOutput the scheduler
reads a step late, and no block is ever freed. Left unset, vllm-graft sets it off with one
warning; asked for explicitly, the deployment is refused naming why and the fix."""
from __future__ import annotations

import logging
import types

import pytest

from vllm_graft.hooks import DeploymentError
from vllm_graft.integration import bridge
from vllm_graft.launch import engine as launch
from vllm_graft.integration.plan import plan_for


def _plan(platform, section, engine=None):
    model = str(launch.models_dir() / "graft-tiny-llama")
    return plan_for({"model": model, "platform": platform, "engine": engine or {}, **section})


def _args(**kw):
    base = {"async_scheduling": None, "attention_backend": None, "enforce_eager": False}
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_a_kv_compressor_turns_async_scheduling_off_with_one_warning(platform, caplog):
    bridge.RUNTIME.said.clear()  # said once per deployment
    for _ in range(2):
        args = _args()
        with caplog.at_level(logging.WARNING, logger="vllm_graft"):
            bridge._apply_engine_overrides(args, _plan(platform, {"kvcompress": {"plugin": "streaming"}}))
        assert args.async_scheduling is False
    said = [r.getMessage() for r in caplog.records if "async_scheduling=False" in r.getMessage()]
    assert len(said) == 1 and "AsyncGPUModelRunnerOutput" in said[0]


def test_async_scheduling_asked_for_on_the_command_line_is_refused_naming_the_fix():
    with pytest.raises(DeploymentError) as e:
        bridge._apply_engine_overrides(_args(async_scheduling=True),
                                       _plan("cuda", {"kvcompress": {"plugin": "h2o"}}))
    text = str(e.value)
    assert "engine.async_scheduling" in text and "--async-scheduling" in text and "scheduler" in text


def test_async_scheduling_in_the_deployment_is_refused_too():
    with pytest.raises(DeploymentError, match="async_scheduling"):
        bridge._apply_engine_overrides(_args(), _plan("cuda", {"kvcompress": {"plugin": "streaming"}},
                                                      engine={"async_scheduling": True}))


def test_other_kinds_leave_async_scheduling_to_vllm():
    args = _args()
    bridge._apply_engine_overrides(args, _plan("cuda", {"attention": {"plugin": "hydragen"}}))
    assert args.async_scheduling is None


def test_drops_on_an_async_output_go_on_the_output_it_wraps(monkeypatch):
    """vLLM 0.33's AsyncGPUModelRunnerOutput has no req_ids and keeps the step's output as
    _model_runner_output (what get_output() returns): the drops must land there, not be lost."""
    from vllm_graft.integration.adapters.kvcompress import channel
    from vllm_graft.integration.adapters.kvcompress import state as kv_state

    class Scored:
        def finalize(self):
            return {"r0": [1, 2]}

    state = kv_state.RUNTIME.kind_state(kv_state.Kind.KVCOMPRESS, kv_state.KVCompressState)
    monkeypatch.setattr(state, "active", types.SimpleNamespace(scored=Scored()))
    inner = types.SimpleNamespace(req_ids=["r0"])
    wrapped = types.SimpleNamespace(_model_runner_output=inner)  # the async wrapper
    out = channel._attach_drops(wrapped)
    assert out._model_runner_output.graft_kv_drops == {"r0": [1, 2]}
    plain = channel._attach_drops(types.SimpleNamespace(req_ids=["r0"]))
    assert plain.graft_kv_drops == {"r0": [1, 2]}
