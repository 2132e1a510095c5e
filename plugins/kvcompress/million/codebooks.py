"""million's codebooks: the file ``vllm-graft calibrate million`` writes and the format reads,
k-means per sub-space (the calibration's and the ``gaussian`` codebooks'), and the checks of a
file against the model it is used on.

The file is a safetensors file with two float32 tensors, ``keys`` and ``values``, each
``[num_layers, num_kv_heads, M, 2**bits, sub_dim]`` (layer l, KV head h, sub-space m: its
centroids), and string metadata: ``format`` (:data:`FORMAT`), ``num_layers``, ``num_kv_heads``,
``head_size``, ``sub_dim``, ``bits``, ``model`` (the model folder's name), ``keys`` (which keys
were calibrated: ``post-rope``, as vLLM stores them) and ``calibration`` (JSON: what it was
calibrated on). The header is read without torch (:func:`read_header`), so deployment
validation can check a file against the model's config.

``gaussian`` (the parameter value, not a file): the same centroids for every layer, head and
sub-space, k-means of standard-normal samples. Data-free, for the conformance kit's random
K/V and tests of the format's mechanics; a model's K/V are not unit Gaussians (per-channel
scales, outlier channels), so on a model it is far worse than calibrated codebooks.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._shared.files import model_mismatch, read_format_header

if TYPE_CHECKING:
    import torch

FORMAT = "vllm-graft/million-codebooks/1"
GAUSSIAN = "gaussian"
CALIBRATE = "vllm-graft calibrate million --model MODEL --out FILE"


class CodebookError(ValueError):
    """A codebook file that is missing, unreadable, or made for another model or layout."""


def read_header(path: str | Path) -> dict[str, str]:
    """The file's metadata (a safetensors header's ``__metadata__``), read without torch."""
    return read_format_header(path, what="million codebook file", fmt=FORMAT, calibrate=CALIBRATE, error=CodebookError)


def mismatch(
    meta: dict[str, str],
    path: str,
    *,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
    head_size: int | None = None,
    sub_dim: int | None = None,
    bits: int | None = None,
) -> str | None:
    """Why the file (its header ``meta``) does not fit the model / parameters given, or None."""
    fix = f"calibrate codebooks on this model (`{CALIBRATE}`)"
    why = model_mismatch(
        meta,
        path,
        what="million codebook file",
        fix=fix,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
    )
    if why:
        return why
    for key, want in (("sub_dim", sub_dim), ("bits", bits)):
        if want is not None and int(meta.get(key, -1)) != want:
            return (
                f"million codebook file {path!r} holds codebooks of {key} {meta.get(key)}, the "
                f"parameters say {key} {want}: set params.{key}: {meta.get(key)}, or calibrate "
                f"with --{key.replace('_', '-')} {want}"
            )
    return None


def save(path: str | Path, keys: "torch.Tensor", values: "torch.Tensor", meta: dict[str, Any]) -> None:
    """Write a codebook file (``keys``/``values`` ``[L, H_kv, M, 2**bits, sub_dim]``)."""
    from safetensors.torch import save_file

    L, H, M, K, d = keys.shape
    header = {
        "format": FORMAT,
        "num_layers": str(L),
        "num_kv_heads": str(H),
        "head_size": str(M * d),
        "sub_dim": str(d),
        "bits": str(K.bit_length() - 1),
        **{k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()},
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({"keys": keys.float().contiguous(), "values": values.float().contiguous()}, str(path), metadata=header)


def load(path: str | Path) -> tuple["torch.Tensor", "torch.Tensor", dict[str, str]]:
    """``(keys, values, meta)`` of a codebook file (float32, on the CPU)."""
    from safetensors.torch import load_file

    meta = read_header(path)
    t = load_file(str(path))
    keys, values = t["keys"], t["values"]
    L, H, D = (int(meta[k]) for k in ("num_layers", "num_kv_heads", "head_size"))
    d, bits = int(meta["sub_dim"]), int(meta["bits"])
    want = (L, H, D // d, 1 << bits, d)
    if tuple(keys.shape) != want or tuple(values.shape) != want:
        raise CodebookError(
            f"million codebook file {str(path)!r}: tensors {tuple(keys.shape)}/{tuple(values.shape)}, "
            f"its header says {want}; the file is damaged: calibrate again (`{CALIBRATE}`)"
        )
    return keys, values, meta


# ---------------------------------------------------------------------------- k-means
def kmeans(x: "torch.Tensor", k: int, iters: int, seed: int = 0) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Lloyd's k-means of each group of ``x [G, N, d]`` (float32) into ``k`` centroids:
    ``(centroids [G, k, d], relative squared error [G])`` (the error of the last assignment,
    over the group's squared norm). Initialised on ``k`` distinct samples of each group
    (seeded); a cluster left empty is re-seeded on a random sample."""
    import torch

    G, N, d = x.shape
    if N < k:
        raise ValueError(f"k-means into {k} centroids needs at least {k} samples per group, got {N}")
    g = torch.Generator().manual_seed(seed)
    x = x.float()
    dev = x.device  # the seeded draws on the host generator, moved to the samples' device
    first = torch.rand(G, N, generator=g).argsort(dim=1)[:, :k].to(dev)
    c = torch.gather(x, 1, first[..., None].expand(G, k, d)).clone()
    err = torch.zeros(G, device=dev)
    for it in range(iters + 1):
        assign, err = _assign(x, c)
        if it == iters:
            break
        sums = torch.zeros(G, k, d, device=dev).scatter_add_(1, assign[..., None].expand(G, N, d), x)
        counts = torch.zeros(G, k, device=dev).scatter_add_(1, assign, torch.ones(G, N, device=dev))
        empty = counts == 0
        c = torch.where(empty[..., None], c, sums / counts.clamp(min=1)[..., None])
        if bool(empty.any()):
            gi, ki = empty.nonzero(as_tuple=True)
            c[gi, ki] = x[gi, torch.randint(N, (gi.numel(),), generator=g).to(dev)]
    norm = x.pow(2).sum(dim=(1, 2)).clamp(min=1e-30)
    return c, err / norm


def _assign(x: "torch.Tensor", c: "torch.Tensor", budget: int = 1 << 20) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Nearest centroid of every sample and the summed squared distance per group (in chunks
    of ``budget`` distances per group)."""
    import torch

    G, N, _ = x.shape
    k = c.shape[1]
    cn = (c * c).sum(-1)[:, None, :]  # [G, 1, k]
    xn = (x * x).sum(-1)  # [G, N]
    idx = torch.empty(G, N, dtype=torch.long, device=x.device)
    best = torch.empty(G, N, device=x.device)
    rows = max(1, budget // k)
    for g in range(G):
        for s in range(0, N, rows):
            xs = x[g : g + 1, s : s + rows]
            d2 = torch.baddbmm(cn[g : g + 1], xs, c[g : g + 1].transpose(1, 2), alpha=-2)  # |c|^2 - 2 x.c
            torch.min(d2[0], dim=-1, out=(best[g, s : s + rows], idx[g, s : s + rows]))
    return idx, (best + xn).clamp(min=0).sum(-1)


@lru_cache(maxsize=8)
def gaussian_centroids(sub_dim: int, bits: int) -> "torch.Tensor":
    """The ``gaussian`` codebook: ``[2**bits, sub_dim]`` k-means centroids of standard-normal
    samples (fixed seed: the same on every call and process)."""
    import torch

    k = 1 << bits
    g = torch.Generator().manual_seed(1234)
    samples = torch.randn(1, 48 * k, sub_dim, generator=g)
    c, _ = kmeans(samples, k, iters=20, seed=0)
    return c[0]
