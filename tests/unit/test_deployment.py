"""Deployment validation: good files pass and explain themselves; each kind of bad input gets
its own message naming the field, the value and what is accepted."""
import json

import pytest

from vllm_graft.hooks import Deployment, DeploymentError, Environment, Kind, validate, validate_file
from vllm_graft.hooks.deployment import load_file, parse_json


def write(tmp_path, text, name="deploy.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------ good input
def test_empty_plugin_sections_is_plain_vllm(registry, cpu_env):
    plan = validate({"engine": {"dtype": "float32"}}, registry, cpu_env)
    assert plan.enabled == [] and plan.dtype == "float32" and plan.platform == "cpu"


def test_good_yaml_file_resolves_params_and_defaults(tmp_path, registry, cpu_env, moe_model):
    path = write(tmp_path, f"""
model: {moe_model.name}
engine: {{dtype: half, max_model_len: 2048}}
kvcompress:
  plugin: sample-evict
  params: {{window_blocks: 8}}
moe:
  plugin: sample-mask
  params: {{experts_off: [3]}}
""")
    plan = validate_file(path, registry, cpu_env)  # model path relative to the file's folder
    assert [(str(e.kind), e.name) for e in plan.enabled] == [("kvcompress", "sample-evict"), ("moe", "sample-mask")]
    evict = plan.by_kind("kvcompress")[0]
    assert evict.params.model_dump() == {"sink_blocks": 1, "window_blocks": 8}
    assert plan.dtype == "float16" and plan.model.architectures == ("MixtralForCausalLM",)
    assert plan.by_kind(Kind.MOE)[0].path == "moe"


def test_moe_accepts_a_list_of_composable_plugins(registry, cpu_env, moe_model):
    plan = validate({"model": str(moe_model), "moe": [{"plugin": "noop"}, {"plugin": "sample-mask"}]},
                    registry, cpu_env)
    assert [e.path for e in plan.enabled] == ["moe[0]", "moe[1]"]


def test_json_dict_route_round_trips(registry, cpu_env):
    dep = Deployment.model_validate({"kvcompress": {"plugin": "sample-evict", "params": {"sink_blocks": 0}}})
    again = validate(parse_json(dep.to_json()), registry, cpu_env)
    assert again.by_kind("kvcompress")[0].params.sink_blocks == 0


def test_dtype_auto_is_read_from_model_config(registry, cpu_env, dense_model):
    plan = validate({"model": str(dense_model)}, registry, cpu_env)
    assert plan.dtype == "float16" and plan.model.head_size == 64


def test_unknown_environment_is_noted_not_silent(registry):
    plan = validate({"kvcompress": {"plugin": "sample-evict"}, "engine": {"dtype": "float32"}},
                    registry, Environment())
    assert any("engine argument names not checked" in n for n in plan.notes)
    assert any("vLLM version checks skipped" in n for n in plan.notes)
    assert any("platform checks skipped" in n for n in plan.notes)


def test_hub_model_id_skips_model_checks_with_a_note(registry, cpu_env):
    plan = validate({"model": "meta-llama/Llama-3.1-8B"}, registry, cpu_env)
    assert plan.model is None and any("not a local folder" in n for n in plan.notes)


def test_example_deployments_are_valid(registry, cpu_env):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "deployments"
    files = sorted(root.glob("*.yaml"))
    assert files, "deployments/ holds example files"
    # million's codebooks and xquant's bases are calibrated files outside the clone: valid once made,
    # else told how
    def calibrated(stem: str, e: Exception) -> bool:
        return any(stem == f"kvcompress-{m}" and f"write it with `vllm-graft calibrate {m}" in str(e)
                   for m in ("million", "xquant"))

    for f in files:  # the bundled models they name are committed under models/
        try:
            plan = validate_file(f, registry, cpu_env)
        except DeploymentError as e:
            assert calibrated(f.stem, e), f"{f}: {e}"
            continue
        assert plan.model is not None, f"{f} names a local model folder"
    real = sorted((root / "smollm2").glob("*.yaml"))  # the real model: valid once fetched, else told to fetch it
    assert len(real) >= 20
    for f in real:
        try:
            plan = validate_file(f, registry, cpu_env)
        except DeploymentError as e:
            assert "vllm-graft models fetch smollm2-135m" in str(e) or calibrated(f.stem, e), f"{f}: {e}"
        else:
            assert plan.model is not None and plan.model.path.endswith("vllm-graft/models/smollm2-135m")
    shapes = sorted((root / "shapes").glob("*.yaml"))
    assert {f.stem for f in shapes} >= {f"noop-{k}" for k in ("attention", "kvcompress", "speculative",
                                                                "quant", "moe")}
    for f in shapes:  # realistic shapes without weights: they must ask for vLLM's dummy weights
        plan = validate_file(f, registry, cpu_env)
        assert plan.model is not None and "/models/shapes/" in plan.model.path.replace("\\", "/")
        assert plan.deployment.engine.get("load_format") == "dummy", f"{f} must set load_format: dummy"


def test_single_moe_mapping_is_reported_as_written(registry, cpu_env):
    found = problems({"moe": {"plugni": "noop"}}, registry, cpu_env)
    accepted = ", ".join(registry.names("moe"))  # the built-ins (grow with the project) + the samples
    assert found == [f"moe.plugin: required field is missing; accepted: {accepted}",
                     "moe.plugni: unknown field; accepted: plugin, params. Did you mean 'plugin'?"]


# ------------------------------------------------------------------------------ bad input
def problems(data, registry, env, **kw):
    with pytest.raises(DeploymentError) as info:
        validate(data, registry, env, **kw)
    return [str(p) for p in info.value.problems]


def only(data, registry, env, **kw):
    found = problems(data, registry, env, **kw)
    assert len(found) == 1, found
    return found[0]


BAD = {
    # name: (deployment, (fragments the single message must contain))
    "top level not a mapping": (["kvcompress"], ["(top level): must be a mapping", "accepted: model, platform"]),
    "unknown top-level field": ({"kv_compress": {"plugin": "noop"}},
                                ["kv_compress: unknown field", "Did you mean 'kvcompress'?"]),
    "unknown plugin": ({"kvcompress": {"plugin": "sample-evit"}},
                       ["kvcompress.plugin: unknown kvcompress plugin (got 'sample-evit')",
                        "accepted: adakv, d2o, expected-attention, h2o, keydiff, knorm, kv4", "sample-evict, snapkv, streaming", "Did you mean 'sample-evict'?"]),
    "plugin under the wrong kind": ({"attention": {"plugin": "sample-evict"}},
                                    ["attention.plugin: unknown attention plugin",
                                     "'sample-evict' is a kvcompress plugin: put it under `kvcompress:`"]),
    "missing plugin name": ({"kvcompress": {"params": {}}}, ["kvcompress.plugin: required field is missing",
                                                             "accepted: adakv, d2o, expected-attention, h2o, keydiff, knorm, kv4", "sample-evict, snapkv, streaming"]),
    "misspelt section key": ({"kvcompress": {"plugin": "noop", "parms": {}}},
                             ["kvcompress.parms: unknown field", "accepted: plugin, params", "Did you mean 'params'?"]),
    "unknown parameter": ({"kvcompress": {"plugin": "sample-evict", "params": {"window": 3}}},
                          ["kvcompress.params.window: unknown field", "accepted: sink_blocks, window_blocks",
                           "Did you mean 'window_blocks'?"]),
    "parameter wrong type": ({"kvcompress": {"plugin": "sample-evict", "params": {"window_blocks": "many"}}},
                             ["kvcompress.params.window_blocks: Input should be a valid integer",
                              "(got 'many')", "accepted: recent blocks kept"]),
    "parameter out of range": ({"kvcompress": {"plugin": "sample-evict", "params": {"sink_blocks": -1}}},
                               ["kvcompress.params.sink_blocks: Input should be greater than or equal to 0",
                                "(got -1)"]),
    "required parameter missing": ({"attention": {"plugin": "sample-sparse"}, "platform": "cuda"},
                                   ["attention.params.top_k: required field is missing",
                                    "accepted: blocks attended per step"]),
    "parameters for a plugin that takes none": ({"kvcompress": {"plugin": "noop", "params": {"bits": 4}}},
                                                ["kvcompress.params.bits: unknown field", "accepted: no fields at all"]),
    "two plugins where one is allowed": ({"kvcompress": [{"plugin": "noop"}, {"plugin": "sample-evict"}]},
                                         ["kvcompress: only one kvcompress plugin can be enabled at a time"]),
    "bad platform value": ({"platform": "tpu"}, ["platform: Input should be 'auto', 'cpu' or 'cuda'", "(got 'tpu')"]),
    "platform unsupported by plugin": ({"attention": {"plugin": "sample-sparse", "params": {"top_k": 2}}},
                                       ["attention.plugin: attention plugin 'sample-sparse' does not run on "
                                        "platform 'cpu'", "accepted: platforms cuda"]),
    "vllm version unsupported": ({"speculative": {"plugin": "sample-draft"}},
                                 ["speculative.plugin: speculative plugin 'sample-draft' does not support vLLM "
                                  "0.32.0", "accepted: vLLM >=0.33"]),
    "dtype unsupported by plugin": ({"engine": {"dtype": "bfloat16"}, "kvcompress": {"plugin": "sample-evict"}},
                                    ["kvcompress.plugin: kvcompress plugin 'sample-evict' does not support dtype "
                                     "'bfloat16'", "accepted: dtypes float32, float16"]),
    "unknown dtype": ({"engine": {"dtype": "float8"}}, ["engine.dtype: unknown dtype (got 'float8')"]),
    "engine argument owned by a section": ({"engine": {"quantization": "fp8"}, "quant": {"plugin": "noop"}},
                                           ["engine.quantization: conflicts with the `quant` section",
                                            "Remove engine.quantization or the `quant` section"]),
    "graft config set by hand": ({"engine": {"additional_config": {"graft": {}}}},
                                 ["engine.additional_config.graft: the deployment itself travels there"]),
    "incompatible combination": ({"moe": [{"plugin": "sample-mask"}, {"plugin": "sample-route"}]},
                                 ["moe[0].plugin: moe plugin 'sample-mask' cannot be combined with moe plugin "
                                  "'sample-route' (at moe[1])"]),
    "same plugin twice": ({"moe": [{"plugin": "noop"}, {"plugin": "noop"}]},
                          ["moe[1].plugin: plugin enabled twice (also at moe[0])"]),
    "model folder missing": ({"model": "./no/such/model"}, ["model: model folder does not exist",
                                                             "(got './no/such/model')"]),
    "unknown engine argument": ({"engine": {"max_model_length": 2048}},
                                ["engine.max_model_length: unknown vLLM engine argument (got 2048)",
                                 "Did you mean 'max_model_len'?"]),
    "model among engine arguments": ({"engine": {"model": "x"}},
                                     ["engine.model: the model is not an engine argument here",
                                      "Set it with the top-level `model` field"]),
    "engine not a mapping": ({"engine": ["dtype=float32"]}, ["engine: Input should be a valid dictionary"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_has_a_specific_message(case, registry, cpu_env):
    data, fragments = BAD[case]
    message = only(data, registry, cpu_env)
    for fragment in fragments:
        assert fragment in message, f"{case}: {fragment!r} not in {message!r}"


def test_messages_are_distinct():
    messages = [tuple(f) for _, f in BAD.values()]
    assert len(set(messages)) == len(messages) >= 15


def test_dtype_auto_on_a_float32_checkpoint_is_checked_as_the_bfloat16_vllm_computes_in(
        registry, cpu_env, tmp_path):
    """vLLM's dtype auto downcasts a float32 checkpoint (config/model.py _resolve_auto_dtype):
    sample-evict (float32, float16) is refused there, and accepted with dtype float32 set."""
    from tests.unit.conftest import _model

    model = str(_model(tmp_path / "fp32", "LlamaForCausalLM", 64, dtype="float32"))
    msg = only({"model": model, "kvcompress": {"plugin": "sample-evict"}}, registry, cpu_env)
    assert "does not support dtype 'bfloat16'" in msg and "float32 checkpoint in bfloat16" in msg
    validate({"model": model, "engine": {"dtype": "float32"}, "kvcompress": {"plugin": "sample-evict"}},
             registry, cpu_env)


def test_architecture_unsupported(registry, cpu_env, dense_model):
    msg = only({"model": str(dense_model), "moe": {"plugin": "noop"}}, registry, cpu_env)
    assert "moe.plugin: moe plugin 'noop' does not apply to model architecture LlamaForCausalLM" in msg
    assert "accepted: architectures MixtralForCausalLM" in msg


def test_head_size_unsupported(registry, dense_model):
    env = Environment(platform="cuda", vllm_version="0.33.0")
    msg = only({"model": str(dense_model), "attention": {"plugin": "sample-sparse", "params": {"top_k": 4}}},
               registry, env)
    assert "does not support head size 64" in msg and "accepted: head sizes 128" in msg


def test_folder_without_config(tmp_path, registry, cpu_env):
    (tmp_path / "m").mkdir()
    assert "folder has no config.json" in only({"model": str(tmp_path / "m")}, registry, cpu_env)


def test_every_problem_is_reported_at_once(registry, cpu_env):
    found = problems({"platfrom": "cpu", "kvcompress": {"plugin": "nope"},
                      "moe": {"plugin": "sample-mask", "params": {"experts_off": "all"}}}, registry, cpu_env)
    assert len(found) == 3
    assert any(p.startswith("platfrom:") for p in found)
    assert any(p.startswith("kvcompress.plugin:") for p in found)
    assert any(p.startswith("moe.params.experts_off:") for p in found)


# ------------------------------------------------------------------------------ files
def test_file_not_found(tmp_path, registry):
    with pytest.raises(DeploymentError, match="file not found"):
        validate_file(tmp_path / "missing.yaml", registry)


def test_invalid_yaml_names_line(tmp_path):
    path = write(tmp_path, "kvcompress:\n  plugin: noop\n params: [\n")
    with pytest.raises(DeploymentError, match=r"is not valid YAML at line 3"):
        load_file(path)


def test_empty_file(tmp_path):
    with pytest.raises(DeploymentError, match="is empty; accepted: a mapping with fields model"):
        load_file(write(tmp_path, "# nothing\n"))


def test_invalid_json():
    with pytest.raises(DeploymentError, match="is not valid JSON"):
        parse_json("{plugin: noop}")


def test_error_text_lists_count_and_source(tmp_path, registry, cpu_env):
    path = write(tmp_path, json.dumps({"quant": {"plugin": "q"}, "moe": {"plugin": "m"}}))
    with pytest.raises(DeploymentError) as info:
        validate_file(path, registry, cpu_env)
    text = str(info.value)
    assert text.startswith(f"{path}: 2 problems:")
    assert "  - quant.plugin: unknown quant plugin (got 'q')" in text


def test_engine_argument_names_read_from_installed_vllm():
    from vllm_graft.integration.env import detect_environment, engine_argument_names

    names = engine_argument_names()
    assert {"dtype", "max_model_len", "enforce_eager", "speculative_config"} <= names
    assert detect_environment().engine_args == names


# ----------------------------------------------------------------------------- parallelism
def test_plugins_not_run_under_tensor_parallelism_are_refused_with_the_fix(registry, cpu_env):
    from pathlib import Path

    llama = str(Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama")
    data = {"model": llama, "engine": {"dtype": "float32", "tensor_parallel_size": 2},
            "kvcompress": {"plugin": "sample-evict"}}  # declares no parallelism (the default: dp)
    with pytest.raises(DeploymentError) as info:
        validate(data, registry, cpu_env)
    (problem,) = info.value.problems
    assert problem.path == "kvcompress.plugin" and "has not been run under tensor_parallel_size=2" in str(problem)
    assert "Run with tensor_parallel_size: 1" in str(problem)
    # a plugin that says why it is not run under tensor parallelism: the refusal carries its reason
    xquant = {"plugin": "xquant", "params": {"bases": "identity"}}
    with pytest.raises(DeploymentError) as info:
        validate(dict(data, kvcompress=xquant), registry, cpu_env)
    assert "a tensor-parallel rank holds only its own heads' projection" in str(info.value)
    # declared and tested at two ranks (tests/e2e/test_tensor_parallel*.py): accepted
    for plugin in ("streaming", "h2o", "snapkv", "kv4"):
        validate(dict(data, kvcompress={"plugin": plugin}), registry, cpu_env)
    validate(dict(data, kvcompress=None, speculative={"plugin": "lookahead"}), registry, cpu_env)
    # one rank, or data parallelism (independent replicas): every plugin
    validate(dict(data, engine={"dtype": "float32", "data_parallel_size": 2}), registry, cpu_env)
    with pytest.raises(DeploymentError, match="enable_expert_parallel=True"):
        validate(dict(data, engine={"dtype": "float32", "enable_expert_parallel": True}), registry, cpu_env)


def test_parallelism_capability_accepts_only_vllms_kinds():
    from vllm_graft.hooks import Capabilities

    assert Capabilities(lossless=True).parallelism == ("dp",)
    with pytest.raises(ValueError, match="unknown parallelism"):
        Capabilities(lossless=True, parallelism=("tensor",))


def test_expert_parallelism_on_the_cpu_engine_is_refused_naming_vllms_crash(registry, cpu_env):
    from pathlib import Path

    mixtral = str(Path(__file__).resolve().parents[2] / "models" / "graft-tiny-mixtral")
    data = {"model": mixtral, "engine": {"dtype": "float32", "tensor_parallel_size": 2,
                                         "enable_expert_parallel": True},
            "moe": [{"plugin": "affinity-placement"}]}  # declares ep: only the platform refuses
    with pytest.raises(DeploymentError) as info:
        validate(data, registry, cpu_env)
    (problem,) = info.value.problems
    assert problem.path == "engine.enable_expert_parallel" and "crashes" in str(problem)
    assert "Run with enable_expert_parallel: false on cpu" in str(problem)
    gpu = Environment(platform="cuda", vllm_version="0.33.0", engine_args=cpu_env.engine_args | {"enable_eplb"})
    validate(dict(data, platform="cuda"), registry, gpu)


def test_affinity_placement_apply_needs_a_placement_vllm_can_place(registry, cpu_env):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    gpu = Environment(platform="cuda", vllm_version="0.33.0",
                      engine_args=cpu_env.engine_args | {"enable_eplb", "eplb_config"})
    placement = str(root / "deployments" / "placement-tiny-mixtral-4.json")  # 4 devices
    engine = {"dtype": "float32", "tensor_parallel_size": 4, "enable_expert_parallel": True, "enable_eplb": True}
    data = {"model": str(root / "models" / "graft-tiny-mixtral"), "platform": "cuda", "engine": engine,
            "moe": [{"plugin": "affinity-placement",
                     "params": {"devices": 4, "placement_file": placement, "apply": True}}]}
    plan = validate(data, registry, gpu)
    assert plan.enabled[0].params.apply

    def problems(**change):
        moe = dict(data["moe"][0], params={**data["moe"][0]["params"], **change.pop("params", {})})
        with pytest.raises(DeploymentError) as info:
            validate(dict(data, moe=[moe], **change), registry, gpu)
        return " | ".join(str(p) for p in info.value.problems)

    assert "needs placement_file" in problems(params={"placement_file": None})
    assert "set engine.enable_eplb: true" in problems(engine={k: v for k, v in engine.items() if k != "enable_eplb"})
    assert "devices is 4 but expert parallelism spans" in problems(engine={**engine, "tensor_parallel_size": 2})
    assert "num_redundant_experts to 0" in problems(engine={**engine, "eplb_config": {"num_redundant_experts": 2}})
    assert "vLLM's CPU engine cannot run" in problems(platform="cpu")


def test_every_plugin_declaring_tensor_parallelism_has_a_two_rank_case():
    """A plugin declares "tp" only if tests/e2e/test_tensor_parallel.py runs it at two ranks."""
    from pathlib import Path

    from vllm_graft.hooks import make_plugin_manager

    cases = (Path(__file__).resolve().parents[1] / "e2e" / "test_tensor_parallel.py").read_text()
    registry = make_plugin_manager(allow=None, trace=False).build_registry()
    declared = [(kind, e.name) for kind in Kind for e in registry.entries(kind)
                if "tp" in e.registration.capabilities.parallelism]
    assert len(declared) >= 20
    missing = [f"{kind}:{name}" for kind, name in declared if f'"plugin": "{name}"' not in cases]
    assert not missing, f"declare tp without a two-rank case: {missing}"


def test_dual_batch_overlap_is_refused_by_plugin_name(registry, cpu_env):
    """vLLM's --enable-dbo splits a step's rows into micro-batches; kvcompress maps row i to
    input_batch.req_ids[i] and caches its skips per step, and no plugin has run under it: the
    deployment is refused naming the plugin and the fix (the bridge passes --enable-dbo from vLLM's
    command line into the same validation)."""
    import dataclasses
    from pathlib import Path

    llama = str(Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama")
    data = {"model": llama, "engine": {"dtype": "float32"}, "kvcompress": {"plugin": "snapkv"}}
    cuda_env = dataclasses.replace(cpu_env, platform="cuda", engine_args=cpu_env.engine_args | {"enable_dbo"})
    validate(data, registry, cuda_env)
    with pytest.raises(DeploymentError) as info:
        validate(dict(data, engine={**data["engine"], "enable_dbo": True}), registry, cuda_env)
    (problem,) = info.value.problems
    assert problem.path == "kvcompress.plugin" and "'snapkv' has not been run under enable_dbo=True" in str(problem)
    assert "Run with enable_dbo: false" in str(problem)


def test_pipeline_parallelism_in_eager_mode_on_the_cpu_engine_is_refused(registry, cpu_env):
    from pathlib import Path

    llama = str(Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama")
    data = {"model": llama, "engine": {"dtype": "float32", "pipeline_parallel_size": 2},
            "kvcompress": {"plugin": "streaming"}}  # run at two stages (tests/e2e/test_tensor_parallel.py)
    validate(data, registry, cpu_env)
    with pytest.raises(DeploymentError) as info:
        validate(dict(data, engine={**data["engine"], "enforce_eager": True}), registry, cpu_env)
    (problem,) = info.value.problems
    assert problem.path == "engine.pipeline_parallel_size" and "enforce_eager" in str(problem)
    with pytest.raises(DeploymentError, match="has not been run under pipeline_parallel_size=2"):
        validate(dict(data, kvcompress={"plugin": "h2o"}), registry, cpu_env)  # its stages disagree
