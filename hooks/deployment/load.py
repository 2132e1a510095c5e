"""Reading a deployment (YAML file or JSON), and the facts validation reads from a model's
config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..registry import MODEL_FEATURES
from .problems import DeploymentError, Problem
from .schema import DTYPE_ALIASES, Deployment


# ---------------------------------------------------------------------------- loading
def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a deployment YAML (or JSON) file into a dict, with errors naming the file."""
    p = Path(path)
    source = str(path)
    if not p.exists():
        raise DeploymentError(
            [
                Problem(
                    source,
                    "file not found",
                    hint="Pass the path of a deployment YAML file; examples are in deployments/",
                )
            ],
            source,
        )
    if p.is_dir():
        raise DeploymentError([Problem(source, "is a folder, not a deployment file")], source)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DeploymentError([Problem(source, f"cannot be read: {e}")], source) from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e)
        raise DeploymentError(
            [Problem(source, f"is not valid YAML{where}: {what}", hint="Check indentation and quoting there")], source
        ) from e
    if data is None:
        raise DeploymentError(
            [Problem(source, "is empty", accepted="a mapping with fields " + ", ".join(Deployment.model_fields))],
            source,
        )
    return data


def parse_json(text: str, source: str = "graft config") -> dict[str, Any]:
    """Parse the JSON form (``--additional-config`` / environment variable)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DeploymentError([Problem(source, f"is not valid JSON: {e}")], source) from e


# ---------------------------------------------------------------------------- model facts
@dataclass(frozen=True)
class ModelInfo:
    """What validation reads from a local model folder's config.json."""

    path: str
    architectures: tuple[str, ...]
    head_size: int | None
    dtype: str | None
    #: attention features of :data:`~vllm_graft.hooks.registry.MODEL_FEATURES` it uses, each
    #: with the config.json setting that shows it
    features: tuple[tuple[str, str], ...] = ()
    num_layers: int | None = None  # decoder layers (num_hidden_layers)
    num_kv_heads: int | None = None  # KV heads per layer (num_key_value_heads, else the query heads)

    @classmethod
    def read(cls, folder: Path) -> "ModelInfo":
        cfg = json.loads((folder / "config.json").read_text())
        head = cfg.get("head_dim")
        if head is None and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
            head = cfg["hidden_size"] // cfg["num_attention_heads"]
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        layers = text.get("num_hidden_layers")
        kv_heads = text.get("num_key_value_heads") or text.get("num_attention_heads")
        return cls(
            str(folder),
            tuple(cfg.get("architectures") or ()),
            head,
            DTYPE_ALIASES.get(str(dtype)) if dtype else None,
            model_features(cfg),
            layers if isinstance(layers, int) else None,
            kv_heads if isinstance(kv_heads, int) else None,
        )


def model_features(cfg: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """``(feature, evidence)`` pairs for the attention features a config.json asks for."""
    nested = cfg.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else {}
    c = {**cfg, **text}
    out: list[tuple[str, str]] = []
    window = c.get("sliding_window")
    if window and c.get("use_sliding_window", True):
        out.append(("sliding_window", f"sliding_window={window}"))
    elif "sliding_attention" in (c.get("layer_types") or ()):
        out.append(("sliding_window", "layer_types has sliding_attention"))
    if c.get("kv_lora_rank"):
        out.append(("mla", f"kv_lora_rank={c['kv_lora_rank']}"))
    if c.get("is_encoder_decoder"):
        out.append(("encoder_attention", "is_encoder_decoder=true"))
    elif c.get("model_type") in ("bert", "roberta", "xlm-roberta", "distilbert", "modernbert"):
        out.append(("encoder_attention", f"model_type={c['model_type']}"))
    if c.get("alibi") or (c.get("attn_config") or {}).get("alibi") or c.get("model_type") == "bloom":
        out.append(("alibi", "alibi" if c.get("model_type") != "bloom" else "model_type=bloom"))
    if c.get("attn_logit_softcapping"):
        out.append(("soft_cap", f"attn_logit_softcapping={c['attn_logit_softcapping']}"))
    if c.get("model_type") == "gpt_oss":
        out.append(("attention_sinks", "model_type=gpt_oss"))
    return tuple(f for f in out if f[0] in MODEL_FEATURES)
