"""xquant's bases: the file ``vllm-graft calibrate xquant`` writes from a model's weights and
the format reads, and the checks of a file against the model it is used on.

For each decoder layer, the singular value decomposition of the key and value projections,
``W = U diag(S) Vh`` (``W`` the ``[H_kv * D, hidden]`` weight of ``k_proj`` / ``v_proj``; ``U``
``[n, n]`` with ``n = H_kv * D``, which needs ``hidden >= n``, as every GQA model has), and the
projection's bias (zeros without one). The latent the format caches is ``X Vh^T``: the part
of the layer input X that K (or V) depends on, ``n`` values per token instead of X's ``hidden``,
obtained from the key vLLM hands the cache as ``(K - b) U diag(1/S)`` and turned back into the
key by ``latent diag(S) U^T + b`` (XQuant's variant for GQA models, Tomar et al. 2025). Keys
go through this before RoPE, so the file also records the model's rotary embedding
(``rope_theta``; NeoX-style halves over the whole head, the only kind this format re-applies).

The file is a safetensors file with float32 tensors ``k_u``, ``v_u`` ``[L, n, n]``, ``k_s``,
``v_s``, ``k_bias``, ``v_bias`` ``[L, n]``, and string metadata: ``format`` (:data:`FORMAT`),
``num_layers``, ``num_kv_heads``, ``head_size``, ``hidden_size``, ``rope_theta``, ``model``.

``identity`` (the parameter value, not a file): no latent and no RoPE round trip; K and V are
quantised as vLLM hands them (post-RoPE), per token. For the conformance kit's random K/V, and
the ablation that shows what the latent is worth on a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._shared.files import model_mismatch, read_format_header

if TYPE_CHECKING:
    import torch

FORMAT = "vllm-graft/xquant-bases/1"
IDENTITY = "identity"
CALIBRATE = "vllm-graft calibrate xquant --model MODEL --out FILE"
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
TENSORS = ("k_u", "k_s", "k_bias", "v_u", "v_s", "v_bias")


class BasesError(ValueError):
    """A bases file that is missing, unreadable, or made for another model; or a model the
    format cannot rematerialise keys for."""


def read_header(path: str | Path) -> dict[str, str]:
    """The file's metadata, read without torch."""
    return read_format_header(path, what="xquant bases file", fmt=FORMAT, calibrate=CALIBRATE, error=BasesError)


def mismatch(meta: dict[str, str], path: str, **model: int | None) -> str | None:
    """Why the file (its header ``meta``) does not fit the model whose ``num_layers``,
    ``num_kv_heads`` and ``head_size`` are given (None: not checked), or None."""
    return model_mismatch(meta, path, what="xquant bases file", fix=f"write it for this model (`{CALIBRATE}`)", **model)


# ------------------------------------------------------------------- from a model folder
def rope_of(config: dict[str, Any], where: str) -> float:
    """The model's RoPE base; BasesError for a rotary embedding the format cannot re-apply."""
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise BasesError(f"xquant: {where} is a {arch}; the format rematerialises keys of {', '.join(ARCHITECTURES)}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        raise BasesError(
            f"xquant: {where} uses RoPE scaling {kind!r}; the format re-applies plain RoPE only "
            "(keys are cached before RoPE): use kv4 for this model"
        )
    if config.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise BasesError(f"xquant: {where} rotates part of each head (partial_rotary_factor); use kv4")
    theta = config.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise BasesError(f"xquant: {where}'s config.json names no rope_theta")
    return float(theta)


def _weights(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise BasesError(f"xquant: {folder} has no safetensors weights")
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            out.update({k: f for k in st.keys()})
    return out


def compute(model: str | Path) -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
    """``(tensors, metadata)`` of the bases of the model folder ``model`` (its config and its
    ``k_proj`` / ``v_proj`` weights, in float64 for the decomposition)."""
    import torch
    from safetensors import safe_open

    folder = Path(model).expanduser()
    config = json.loads((folder / "config.json").read_text())
    theta = rope_of(config, str(folder))
    L, H, Hkv = config["num_hidden_layers"], config["num_attention_heads"], config.get("num_key_value_heads")
    Hkv = Hkv or H
    hidden = config["hidden_size"]
    D = config.get("head_dim") or hidden // H
    n = Hkv * D
    if hidden < n:
        raise BasesError(
            f"xquant: {folder} has hidden size {hidden} < {Hkv} KV heads x {D} = {n}: its latent would be "
            "larger than its keys; use kv4"
        )
    where = _weights(folder)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in TENSORS}
    for layer in range(L):
        for p in ("k", "v"):
            name = f"model.layers.{layer}.self_attn.{p}_proj"
            if f"{name}.weight" not in where:
                raise BasesError(f"xquant: {folder} has no {name}.weight (a fused qkv_proj is not read yet)")
            with safe_open(str(where[f"{name}.weight"]), "pt") as st:
                w = st.get_tensor(f"{name}.weight").double()
            bias = torch.zeros(n, dtype=w.dtype, device=w.device)  # the weight's (read on the host)
            if f"{name}.bias" in where:
                with safe_open(str(where[f"{name}.bias"]), "pt") as st:
                    bias = st.get_tensor(f"{name}.bias").double()
            u, s, _ = torch.linalg.svd(w, full_matrices=False)  # w [n, hidden] = u diag(s) vh
            if float(s.min()) <= float(s.max()) * 1e-6:
                raise BasesError(
                    f"xquant: {name}.weight is rank-deficient (singular values down to {float(s.min()):.3g})"
                )
            out[f"{p}_u"].append(u.float())
            out[f"{p}_s"].append(s.float())
            out[f"{p}_bias"].append(bias.float())
    meta = {
        "format": FORMAT,
        "num_layers": str(L),
        "num_kv_heads": str(Hkv),
        "head_size": str(D),
        "hidden_size": str(hidden),
        "rope_theta": repr(theta),
        "model": folder.name,
    }
    return {k: torch.stack(v).contiguous() for k, v in out.items()}, meta


def save(path: str | Path, tensors: dict[str, "torch.Tensor"], meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def load(path: str | Path) -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
    """``(tensors, meta)`` of a bases file (float32, on the CPU)."""
    from safetensors.torch import load_file

    meta = read_header(path)
    t = load_file(str(path))
    L, n = int(meta["num_layers"]), int(meta["num_kv_heads"]) * int(meta["head_size"])
    for k in TENSORS:
        want = (L, n, n) if k.endswith("_u") else (L, n)
        if k not in t or tuple(t[k].shape) != want:
            got = tuple(t[k].shape) if k in t else "missing"
            raise BasesError(
                f"xquant bases file {str(path)!r}: {k} is {got}, its header says {want}; write it again (`{CALIBRATE}`)"
            )
    return t, meta
