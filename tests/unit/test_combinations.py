"""Plugin combinations the adapters cannot run, refused at validation (before any engine starts)
with the fix named, where validation knows enough: one test per rule. The adapters keep their
own start-up checks as a backstop (e.g. tests/unit/test_spec_tree_engine.py)."""
from pathlib import Path

import pytest

from vllm_graft.hooks import DeploymentError, validate
from vllm_graft.integration.plan import plan_for

LLAMA = str(Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama")
TREE = {"plugin": "token-recycling", "params": {"tree": True}}


def problems(data, registry, env):
    with pytest.raises(DeploymentError) as e:
        validate({"model": LLAMA, **data}, registry, env)
    return {p.path: p for p in e.value.problems}


@pytest.mark.parametrize("other", [{"attention": {"plugin": "noop"}}, {"kvcompress": {"plugin": "streaming"}}])
def test_tree_drafting_is_refused_with_an_attention_or_kvcompress_plugin(registry, cpu_env, other):
    (kind,) = other
    found = problems({"speculative": TREE, **other}, registry, cpu_env)
    p = found["speculative.params.tree"]
    assert "cannot be combined with" in p.message and f"{kind} plugin {other[kind]['plugin']!r}" in p.message
    assert "tree: false" in p.hint and f"leave {kind} out" in p.hint
    # each alone, or chains with the other plugin, are fine
    validate({"model": LLAMA, "speculative": TREE}, registry, cpu_env)
    validate({"model": LLAMA, "speculative": {**TREE, "params": {"tree": False}}, **other}, registry, cpu_env)


@pytest.mark.parametrize("arg", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_tree_drafting_is_refused_on_more_than_one_rank(registry, cpu_env, arg):
    found = problems({"speculative": TREE, "engine": {arg: 2}}, registry, cpu_env)
    p = found[f"engine.{arg}"]
    assert "tree verification runs on one rank" in p.message and p.value == 2
    assert f"{arg}: 1" in p.hint and "speculative.params.tree: false" in p.hint


def test_tree_drafting_on_more_ranks_given_by_vllm_flags_is_refused_too():
    """The bridge's route: the parallelism comes from vLLM's own flags (engine_args)."""
    with pytest.raises(DeploymentError, match="tree verification runs on one rank"):
        plan_for({"speculative": TREE}, engine_model=LLAMA, engine_args={"tensor_parallel_size": 2})


def test_a_per_head_compressor_is_refused_with_a_storage_format(registry, cpu_env):
    found = problems({"kvcompress": [{"plugin": "adakv"}, {"plugin": "kv4"}]}, registry, cpu_env)
    p = found["kvcompress[0].plugin"]
    assert "'adakv' cannot be combined with kvcompress plugin 'kv4'" in p.message
    assert p.hint == "Enable only one of them"
