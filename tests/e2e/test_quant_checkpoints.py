"""Pre-quantised checkpoints in vLLM's CPU engine: `vllm-graft quantize dfloat11` on the
bundled tiny Llama, loaded with a plain ``LLM(model=OUT)`` (no deployment: the checkpoint's
``quantization_config`` names the plugin), gives plain vLLM's greedy tokens in bfloat16, and
bit-identical logprobs where vLLM's bf16 GEMM is torch's own (on a CPU with AMX tiles vLLM uses
its own kernels, and the logprobs agree to rounding); broken checkpoints fail naming the tensor."""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from .test_models import PROMPTS  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"
ENGINE = {"max_model_len": 512, "enforce_eager": True, "seed": 0}
NEW_TOKENS = 24
TOP_LOGPROBS = 5


@pytest.fixture(scope="module")
def df11(tmp_path_factory):
    from vllm_graft.tools.quant.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "df11"
    report = quantize_checkpoint("dfloat11", str(MODEL), str(out), {}, dtype="bfloat16", log=lambda *a: None)
    print(json.dumps(report))
    return out


def _run(model, **kw):
    """(token ids, top-5 logprobs per step, linear-layer summary, events) of one engine."""
    from vllm import LLM, SamplingParams

    from vllm_graft.integration.runtime import RUNTIME

    llm = LLM(model=str(model), **ENGINE, **kw)
    try:
        out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                   logprobs=TOP_LOGPROBS))
        toks = [list(o.outputs[0].token_ids) for o in out]
        lps = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in out]

        def inspect(m):
            return sorted({type(mod.quant_method).__name__ for _, mod in m.named_modules()
                           if hasattr(mod, "quant_method")})

        (methods,) = llm.apply_model(inspect)
        events = RUNTIME.counts("quant", "dfloat11") if RUNTIME.active else {}
        return toks, lps, methods, dict(events)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def test_dfloat11_checkpoint_gives_plain_bf16_tokens(df11):
    """Greedy tokens identical to plain vLLM bf16; logprobs bit-identical where vLLM multiplies bf16
    weights with torch's own matmul, within rounding where it uses its AMX kernels."""
    plain_toks, plain_lps, _, _ = _run(MODEL, dtype="bfloat16")
    toks, lps, methods, events = _run(df11)
    assert methods == ["GraftLinearMethod"]  # every linear layer, embed_tokens and lm_head
    # 4 layers x (qkv, o, gate_up, down) + embed_tokens + lm_head, loaded from stored tensors
    assert events.get("load") == 18 and "quantize" not in events
    assert events.get("apply", 0) > 0 and events.get("embed", 0) > 0
    assert toks == plain_toks
    if not _host_bf16_gemm_is_torchs():
        # vLLM's CPU engine multiplies bf16 weights with its own AMX kernels (sgl-kernel's
        # weight_packed_linear, oneDNN) where the CPU has AMX tiles; dfloat11 multiplies its
        # decoded (bit-identical) weight with torch's F.linear. Same weights, another kernel's
        # summation order: the logprobs agree to rounding, not to the bit.
        worst = max(abs(a[t] - b[t]) for x, y in zip(lps, plain_lps) for a, b in zip(x, y)
                    for t in a.keys() & b.keys())
        print(f"dfloat11: host bf16 GEMM is vLLM's AMX kernel; max |logprob diff| {worst:.2e}")
        assert worst < 0.05
        return
    assert lps == plain_lps  # the top-5 logprobs of every step, as floats: bit-identical
    print(f"dfloat11: {sum(map(len, toks))} greedy tokens and their top-{TOP_LOGPROBS} logprobs "
          "identical to plain vLLM bf16")


def _host_bf16_gemm_is_torchs() -> bool:
    """Whether vLLM's CPU engine computes an unquantised bf16 linear layer with torch's own
    matmul (as dfloat11 does), rather than its AMX kernels (``check_cpu_sgl_kernel`` and the
    oneDNN path both take AMX tiles where the CPU has them)."""
    import torch

    return not torch.cpu._is_amx_tile_supported()


def _variant(src: Path, dst: Path, edit_state=None, edit_cfg=None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_state:
        st = load_file(str(dst / "model.safetensors"))
        edit_state(st)
        save_file(st, str(dst / "model.safetensors"))
    if edit_cfg:
        c = json.loads((dst / "config.json").read_text())
        edit_cfg(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def _flip(st):
    t = st["model.layers.2.mlp.up_proj.exponents"].clone()
    t[len(t) // 2] ^= 0x10
    st["model.layers.2.mlp.up_proj.exponents"] = t


def _unquantised(st):
    import torch

    for k in [k for k in st if k.startswith("model.layers.0.self_attn.q_proj.")]:
        del st[k]
    st["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(256, 256, dtype=torch.bfloat16)


BROKEN = {
    "missing": (dict(edit_state=lambda st: st.pop("model.layers.1.self_attn.k_proj.exponents")),
                r"model\.layers\.1\.self_attn\.k_proj\.exponents: missing from the checkpoint"),
    "corrupt": (dict(edit_state=_flip),
                r"model\.layers\.2\.mlp\.up_proj\.exponents.*CRC-32 does not match"),
    "shape": (dict(edit_state=lambda st: st.update({
        "model.layers.0.self_attn.o_proj.sign_mantissa":
            st["model.layers.0.self_attn.o_proj.sign_mantissa"][:, :200].contiguous()})),
              r"model\.layers\.0\.self_attn\.o_proj\.sign_mantissa: shape \(256, 200\), expected \(256, 256\)"),
    "dtype": (dict(edit_state=lambda st: st.update({
        "lm_head.chunk_offsets": st["lm_head.chunk_offsets"].to(__import__("torch").int64)})),
              r"lm_head\.chunk_offsets: stored as torch\.int64"),
    "unquantised": (dict(edit_state=_unquantised),
                    r"model\.layers\.0\.self_attn\.q_proj\.weight: an unquantised weight"),
    "other-method-params": (dict(edit_cfg=lambda c: c["quantization_config"].update(params={"bits": 4})),
                            r"quant\.params\.bits: unknown field"),
    "online-only-method": (dict(edit_cfg=lambda c: c["quantization_config"].update(
        quant_method="graft-noop", params={})), r"'noop' quantises online only"),
}


#: CI runs these three (a missing, a corrupt tensor, a wrong parameter); the rest with GRAFT_FULL=1
SHORT = ("missing", "corrupt", "other-method-params")


@pytest.mark.parametrize("case", [c if c in SHORT else pytest.param(c, marks=pytest.mark.full) for c in sorted(BROKEN)])
def test_broken_checkpoint_fails_naming_the_tensor(df11, tmp_path, case):
    from vllm import LLM

    edits, pattern = BROKEN[case]
    path = _variant(df11, tmp_path / case, **edits)
    with pytest.raises(Exception, match=pattern) as info:
        llm = LLM(model=str(path), **ENGINE)
        llm.llm_engine.engine_core.shutdown()  # pragma: no cover - reached only on failure
    print(case, "->", str(info.value).splitlines()[-1][:200])
    del info
    gc.collect()


# ------------------------------------------------------------------ lossy methods, loaded
def _heldout_nll(model, **kw):
    """Mean NLL of 2 held-out windows of 256 tokens (prompt_logprobs), and the events."""
    from vllm import LLM, SamplingParams

    from vllm_graft.tools.quant.quantize import corpus_text
    from vllm_graft.integration.runtime import RUNTIME

    llm = LLM(model=str(model), **ENGINE, **kw)
    try:
        ids = llm.get_tokenizer()(corpus_text("heldout", 20_000)).input_ids
        windows = [ids[i * 256:(i + 1) * 256] for i in range(2)]
        out = llm.generate([{"prompt_token_ids": w} for w in windows],
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        nll = [-lp[t].logprob for w, o in zip(windows, out) for t, lp in zip(w[1:], o.prompt_logprobs[1:])]
        events = {k: dict(RUNTIME.counts("quant", k)) for k in ("squeezellm", "w4a8", "slim-llm")} if RUNTIME.active else {}
        return sum(nll) / len(nll), events
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def fp16_nll():
    return _heldout_nll(MODEL, dtype="float16")[0]


@pytest.mark.parametrize("method,params", [
    ("squeezellm", {"bits": 4, "kmeans_iters": 5, "calibration_tokens": 1024}),
    ("w4a8", {}),
    ("slim-llm", {"bits": 4, "calibration_tokens": 1024}),
])
def test_lossy_checkpoint_loads_and_stays_close_to_fp16(tmp_path, fp16_nll, method, params):
    import math

    from vllm_graft.tools.quant.quantize import quantize_checkpoint

    out = tmp_path / method
    quantize_checkpoint(method, str(MODEL), str(out), params, log=lambda *a: None)
    nll, events = _heldout_nll(out)
    assert events[method].get("load") == 16 and events[method].get("apply", 0) > 0
    change = math.exp(nll - fp16_nll) - 1
    print(f"{method} {params}: held-out perplexity {math.exp(nll):.3f} vs fp16 {math.exp(fp16_nll):.3f} "
          f"({100 * change:+.2f}%, 2 windows of 256 tokens)")
    assert change < 0.10
