"""The target model for a self-speculative proposer: vLLM's loaded model described as a
:class:`~vllm_graft.hooks.contracts.target.TargetWeights` (no vLLM type in it).

Built in :meth:`~.engine.GraftProposer.load_model` (vLLM passes the model it just loaded,
``v1/worker/cpu_model_runner.py: CPUModelRunner.load_model``) for a plugin that sets
``needs_target_weights``. What it reads of vLLM's Llama (``model_executor/models/llama.py``):

* ``model.model.embed_tokens`` (``VocabParallelEmbedding``): passed as the callable
  ``model.embed_input_ids``;
* per layer ``model.model.layers[i]``: ``input_layernorm`` and ``post_attention_layernorm``
  (vLLM's ``RMSNorm`` layers, called: one fused op each); ``self_attn.qkv_proj`` (q, k, v fused),
  ``self_attn.o_proj``, ``mlp.gate_up_proj`` (gate, up fused), ``mlp.down_proj`` as callables
  ``x -> layer(x)[0]``: on the CPU vLLM repacks each linear layer's weight for its GEMM
  (``layers/utils.py: dispatch_cpu_unquantized_gemm``, which frees the plain ``weight``), so
  calling the layer is the one way to share the weights;
* ``model.model.norm`` (called); ``model.compute_logits`` as the LM head (vocabulary padding,
  tied embeddings and ``logit_scale`` handled by vLLM);
* ``self_attn.rotary_emb`` (called, ``(positions, q, k) -> (q, k)``: vLLM's rotary op with the
  target's own table and scaling) and its ``cos_sin_cache``.

Refused, naming the problem and the fix (before the first step, so the engine fails to
start rather than draft wrongly): an architecture other than ``LlamaForCausalLM``, more than
one tensor-parallel or pipeline rank, quantized linear layers, biases, non-NeoX rotary
embeddings, sliding-window layers.
"""

from __future__ import annotations

from typing import Any

from vllm_graft.hooks import TargetLayer, TargetWeights

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

    def project(x: Any, _layer: Any = layer) -> Any:
        out = _layer(x)
        return out[0] if isinstance(out, tuple) else out

    return project


def _norm(norm: Any) -> Any:
    """vLLM's RMSNorm layer as a callable ``x -> norm(x)`` (one fused op on the CPU)."""
    if getattr(norm, "has_weight", True) is False or not callable(norm):
        raise _refuse(f"{type(norm).__name__} is not an RMSNorm with a weight", "choose another proposer")
    return norm


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
                input_norm=_norm(layer.input_layernorm),
                post_attention_norm=_norm(layer.post_attention_layernorm),
            )
        )
    if not layers:
        raise _refuse("the model has no decoder layers on this rank", "run on one rank")
    first = inner.layers[0].self_attn
    rope = first.rotary_emb
    return TargetWeights(
        embed=model.embed_input_ids,
        layers=layers,
        final_norm=_norm(inner.norm),
        lm_head=model.compute_logits,
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        rms_norm_eps=float(cfg.rms_norm_eps),
        vocab_size=int(cfg.vocab_size),
        rope_cos_sin=rope.cos_sin_cache,
        rotary_dim=int(getattr(rope, "rotary_dim", first.head_dim)),
        rope=rope,
        source=f"vLLM {name} ({vllm_config.model_config.model})",
    )
