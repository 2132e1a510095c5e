"""Quant plugin names and pre-quantised checkpoints, free of vLLM (and of torch).

Pre-quantised checkpoints (written by ``vllm-graft quantize``, ``tools/quant/quantize.py``):
``config.json`` has ``"quantization_config": {"quant_method": "graft-<plugin>", "graft_format":
1, "params": {...}, "embeddings": bool}``; vLLM detects it without a flag and calls
``from_config(that dict)`` (checked by :func:`checkpoint_config`). The bridge enables the
plugin with the checkpoint's params when no deployment (or one without ``quant``) is given
(:func:`checkpoint_deployment`); a deployment's different params are refused
(:func:`check_checkpoint_params`). Each quantised layer stores the plugin's
``stored_tensors(out, in)`` (checked by :func:`stored_specs`), named in the checkpoint as
:func:`checkpoint_tensor_name` says. How they are loaded: :mod:`.linear`.
"""

from __future__ import annotations

from typing import Any

from ....hooks import QuantMethod

#: ``--quantization`` names of quant plugins are ``graft-<plugin>``.
PREFIX = "graft-"
#: Version of the checkpoint layout written by ``vllm-graft quantize``.
CHECKPOINT_FORMAT = 1
#: vLLM's fused linear layers and the checkpoint layers whose shards they hold, in order.
FUSED_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def quantization_name(plugin_name: str) -> str:
    """The ``--quantization`` name of a quant plugin."""
    return PREFIX + plugin_name


def checkpoint_config(config: Any, quant_name: str) -> dict[str, Any]:
    """A checkpoint's ``quantization_config`` for ``quant_name``, checked: ``{"quant_method",
    "graft_format", "params", "embeddings"}`` (what ``vllm-graft quantize`` writes)."""
    where = f"config.json quantization_config (quant_method {quant_name!r})"
    if not isinstance(config, dict):
        raise ValueError(f"{where}: must be a mapping, got {type(config).__name__}")
    method = config.get("quant_method")
    if method != quant_name:
        raise ValueError(f"{where}: quant_method is {method!r}; this checkpoint is not {quant_name!r}'s")
    fmt = config.get("graft_format")
    if fmt != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{where}: graft_format is {fmt!r}, this vllm-graft reads format "
            f"{CHECKPOINT_FORMAT}; rewrite the checkpoint with `vllm-graft quantize`"
        )
    params = config.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"{where}: params must be a mapping, got {params!r}")
    embeddings = config.get("embeddings", False)
    if not isinstance(embeddings, bool):
        raise ValueError(f"{where}: embeddings must be true or false, got {embeddings!r}")
    unknown = sorted(set(config) - {"quant_method", "graft_format", "params", "embeddings"})
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {unknown}; the fields are quant_method, graft_format, params, embeddings"
        )
    return {"quant_method": method, "graft_format": fmt, "params": params, "embeddings": embeddings}


def check_checkpoint_params(plugin: QuantMethod, name: str, checkpoint: dict[str, Any]) -> None:
    """The deployment's plugin must be the one the checkpoint was written with."""
    have, want = plugin.checkpoint_params(), checkpoint["params"]
    if have != want:
        raise ValueError(
            f"the checkpoint was quantised by {name!r} with params {want}, but the deployment "
            f"enables it with {have}; drop quant.params from the deployment (they are read from "
            "the checkpoint) or give the same values"
        )


def stored_specs(plugin: QuantMethod, name: str, out_features: int, in_features: int) -> dict[str, Any]:
    """``plugin.stored_tensors(out, in)``, checked, or an error if the plugin cannot load
    pre-quantised checkpoints."""
    from ....hooks import StoredTensor

    specs = plugin.stored_tensors(out_features, in_features)
    if specs is None:
        raise ValueError(
            f"quant plugin {name!r} quantises online only (no stored_tensors): it "
            "cannot load a pre-quantised checkpoint; use the unquantised model"
        )
    if not isinstance(specs, dict) or not specs:
        raise TypeError(f"quant plugin {name!r}: stored_tensors() must return a non-empty dict")
    for tname, spec in specs.items():
        if not (isinstance(tname, str) and tname.isidentifier()) or tname == "weight":
            raise TypeError(
                f"quant plugin {name!r}: stored tensor name {tname!r} must be an identifier other than 'weight'"
            )
        if not isinstance(spec, StoredTensor):
            raise TypeError(
                f"quant plugin {name!r}: stored_tensors()[{tname!r}] must be a StoredTensor, got {type(spec).__name__}"
            )
        if spec.ragged and tuple(spec.shape) != (-1,):
            raise TypeError(f"quant plugin {name!r}: ragged tensor {tname!r} must have shape (-1,)")
        if not spec.ragged and (not spec.shape or spec.shape[0] % out_features):
            raise TypeError(
                f"quant plugin {name!r}: stored tensor {tname!r} {spec.shape}: dim 0 "
                f"must be a multiple of the {out_features} output rows"
            )
    return specs


def checkpoint_tensor_name(prefix: str, tname: str, idx: int | None, n_shards: int) -> str:
    """The checkpoint name of stored tensor ``tname`` of layer ``prefix`` (vLLM's name), for
    shard ``idx`` of a fused layer: ``model.layers.0.self_attn.qkv_proj`` shard 1 ->
    ``model.layers.0.self_attn.k_proj.<tname>``."""
    head, _, last = prefix.rpartition(".")
    parts = FUSED_LAYERS.get(last)
    if idx is not None and parts is not None and len(parts) == n_shards:
        return f"{head + '.' if head else ''}{parts[idx]}.{tname}"
    if idx is not None and n_shards > 1:
        return f"{prefix}.{tname} (shard {idx})"
    return f"{prefix}.{tname}" if prefix else tname


def model_checkpoint_quant(model: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a local model folder's ``config.json`` if it names a
    vllm-graft method (``graft-<plugin>``), else None."""
    import json
    from pathlib import Path

    if not model:
        return None
    path = Path(str(model)) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if isinstance(q, dict) and str(q.get("quant_method", "")).startswith(PREFIX):
        return q
    return None


def checkpoint_deployment(model: Any) -> dict[str, Any] | None:
    """The deployment that a pre-quantised vllm-graft checkpoint implies when none is given:
    its quant plugin, with the params it was written with."""
    q = model_checkpoint_quant(model)
    if q is None:
        return None
    params = q.get("params") if isinstance(q.get("params"), dict) else {}
    return {"quant": {"plugin": str(q["quant_method"])[len(PREFIX) :], "params": params}}


__all__ = [
    "PREFIX",
    "CHECKPOINT_FORMAT",
    "FUSED_LAYERS",
    "quantization_name",
    "checkpoint_config",
    "check_checkpoint_params",
    "stored_specs",
    "checkpoint_tensor_name",
    "model_checkpoint_quant",
    "checkpoint_deployment",
]
