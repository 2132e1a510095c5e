"""The target model for a self-speculative proposer: vLLM's loaded model described as a
:class:`~vllm_graft.hooks.contracts.target.TargetWeights` (no vLLM type in it).

Built in :meth:`~.engine.GraftProposer.load_model` (vLLM passes the model it just loaded,
``v1/worker/cpu_model_runner.py: CPUModelRunner.load_model``) for a plugin that sets
``needs_target_weights``. What it reads of vLLM's Llama (``model_executor/models/llama.py``):

* ``model.model.embed_tokens`` (``VocabParallelEmbedding``): passed as the callable
  ``model.embed_input_ids``;
* per layer ``model.model.layers[i]``: ``input_layernorm`` and ``post_attention_layernorm``
  (vLLM's ``RMSNorm`` layers: their weights, shared, applied by vLLM's C++ ``rms_norm`` kernel
  where it is loaded; called outside vLLM's compiled graph the layers would run their eager
  PyTorch path, several ops each); ``self_attn.qkv_proj`` (q, k, v fused),
  ``self_attn.o_proj``, ``mlp.gate_up_proj`` (gate, up fused), ``mlp.down_proj`` as callables
  ``x -> layer.quant_method.apply(layer, x)`` (the layer's GEMM without the module call; one
  rank, so the tensor-parallel forward around it has nothing to do): on the CPU vLLM repacks each
  linear layer's weight for its GEMM (``layers/utils.py: dispatch_cpu_unquantized_gemm``, which
  frees the plain ``weight``), so its own GEMM is the one way to share the weights;
* ``model.model.norm`` (its weight, likewise); ``model.compute_logits`` as the LM head (vocabulary padding,
  tied embeddings and ``logit_scale`` handled by vLLM);
* ``self_attn.rotary_emb`` (``(positions, q, k) -> (q, k)``: vLLM's rotary op) and its
  ``cos_sin_cache``, the table that carries the target's RoPE scaling (``swift`` rotates with the
  table, once per forward for all layers, and calls the op only where there is none).

Refused, naming the problem and the fix (before the first step, so the engine fails to
start rather than draft wrongly): an architecture other than ``LlamaForCausalLM``, more than
one tensor-parallel or pipeline rank, quantized linear layers, biases, non-NeoX rotary
embeddings, sliding-window layers.
"""

from __future__ import annotations

from typing import Any

import torch

from ....hooks import TargetLayer, TargetWeights

SUPPORTED = ("LlamaForCausalLM",)


class TargetUnsupported(ValueError):
    """vLLM's model is not one a self-speculative proposer can draft with."""


def _refuse(what: str, fix: str) -> TargetUnsupported:
    return TargetUnsupported(f"vllm-graft self-speculative proposer: {what}; {fix}")


def _linear(layer: Any, name: str) -> Any:
    method = type(getattr(layer, "quant_method", None)).__name__
    if method != "UnquantizedLinearMethod":
        raise _refuse(
            f"{name} is quantized ({method})",
            "serve the unquantized model, or choose a proposer that does not draft with the target's weights",
        )
    if getattr(layer, "bias", None) is not None:
        raise _refuse(f"{name} has a bias", "choose another proposer for this model")

    # the layer's own GEMM (its quant method's apply: on the CPU vLLM's repacked oneDNN weight),
    # without the module call and the tensor-parallel forward around it (one rank: nothing to do)
    def project(x: Any, _layer: Any = layer, _apply: Any = layer.quant_method.apply) -> Any:
        return _apply(_layer, x)

    return project


class _FusedRMSNorm:
    """An RMSNorm as vLLM's own C++ kernel (``torch.ops._C.rms_norm``): one op, where calling the
    layer outside vLLM's compiled graph runs its eager PyTorch path (several ops)."""

    def __init__(self, weight: torch.Tensor, eps: float, op: Any) -> None:
        self.weight, self.eps, self.op = weight, eps, op

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self.op(out, x.contiguous(), self.weight, self.eps)
        return out


def _norm(norm: Any, eps: float) -> Any:
    """vLLM's RMSNorm layer, its weight shared (not copied): applied by vLLM's C++ kernel where
    it is loaded (:class:`_FusedRMSNorm`), else given as the weight tensor (the proposer applies
    it in one ``F.rms_norm`` op). The layer itself (called) where it is not a plain RMSNorm with
    the model's epsilon."""
    if getattr(norm, "has_weight", True) is False or not callable(norm):
        raise _refuse(f"{type(norm).__name__} is not an RMSNorm with a weight", "choose another proposer")
    weight = getattr(norm, "weight", None)
    plain = getattr(norm, "variance_size_override", None) is None and getattr(norm, "variance_epsilon", eps) == eps
    if not (isinstance(weight, torch.Tensor) and plain):
        return norm
    op = getattr(torch.ops._C, "rms_norm", None) if hasattr(torch.ops, "_C") else None
    return weight.data if op is None else _FusedRMSNorm(weight.data, eps, op)


def target_weights(model: Any, vllm_config: Any) -> TargetWeights:
    """Describe vLLM's loaded ``model`` (see the module docstring)."""
    name = type(model).__name__
    if name not in SUPPORTED:
        raise _refuse(
            f"the target is {name}, but only {', '.join(SUPPORTED)} can be described",
            "choose another speculative plugin for this model",
        )
    par = vllm_config.parallel_config
    if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
        raise _refuse(
            f"tensor_parallel_size={par.tensor_parallel_size}, pipeline_parallel_size="
            f"{par.pipeline_parallel_size}: each rank holds part of the model",
            "run on one rank (data parallelism is fine)",
        )
    cfg = vllm_config.model_config.hf_config
    eps = float(cfg.rms_norm_eps)
    inner = model.model
    layers = []
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn.attn, "sliding_window", None):
            raise _refuse(f"layer {i} uses sliding-window attention", "choose another proposer")
        if attn.num_heads != attn.total_num_heads:
            raise _refuse("the attention heads are sharded", "run on one rank")
        r = attn.rotary_emb
        if not getattr(r, "is_neox_style", True) or not hasattr(r, "cos_sin_cache"):
            raise _refuse(
                f"layer {i}'s rotary embedding ({type(r).__name__}) is not NeoX-style with a cos/sin table",
                "choose another proposer",
            )
        p = f"model.layers.{i}."
        layers.append(
            TargetLayer(
                qkv=_linear(attn.qkv_proj, p + "self_attn.qkv_proj"),
                o=_linear(attn.o_proj, p + "self_attn.o_proj"),
                gate_up=_linear(mlp.gate_up_proj, p + "mlp.gate_up_proj"),
                down=_linear(mlp.down_proj, p + "mlp.down_proj"),
                input_norm=_norm(layer.input_layernorm, eps),
                post_attention_norm=_norm(layer.post_attention_layernorm, eps),
            )
        )
    if not layers:
        raise _refuse("the model has no decoder layers on this rank", "run on one rank")
    first = inner.layers[0].self_attn
    rope = first.rotary_emb
    return TargetWeights(
        embed=model.embed_input_ids,
        layers=layers,
        final_norm=_norm(inner.norm, eps),
        lm_head=model.compute_logits,
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        rms_norm_eps=eps,
        vocab_size=int(cfg.vocab_size),
        rope_cos_sin=rope.cos_sin_cache,
        rotary_dim=int(getattr(rope, "rotary_dim", first.head_dim)),
        rope=rope,
        source=f"vLLM {name} ({vllm_config.model_config.model})",
    )
