"""Self-speculation: a proposer that drafts with the target model itself (SWIFT's layer
skipping, Draft & Verify), and the vLLM-free description of that model it is given.

A :class:`SelfSpeculativeProposer` is a :class:`~.speculative.Proposer` (same calls, same
chain verification by vLLM) that also gets :meth:`~SelfSpeculativeProposer.attach_target`
once, after vLLM has loaded the model and before the first ``propose``. The speculative
adapter builds the :class:`TargetWeights` from vLLM's model (Llama architecture, unquantized,
one tensor-parallel rank): the target's own tensors and linear layers, shared, never copied;
it refuses, naming the problem and the fix, a model it cannot describe.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

from .base import P
from .speculative import Proposer


@dataclass
class TargetLayer:
    """One Llama-style decoder layer of the target (pre-norm: ``h += attn(norm(h))``, then
    ``h += mlp(norm(h))``).

    A *projection* is either a tensor ``W [out, in]`` (applied as ``x @ W.T``) or a callable
    ``x [T, in] -> [T, out]``. The vLLM adapter passes the target's own linear layers as
    callables: on the CPU vLLM repacks their weights for its GEMM kernels and frees the
    plain ``weight``, so calling the layer is the way to share them."""

    qkv: Any  #: projection to ``[T, (heads + 2 * kv_heads) * head_dim]``: q, then k, then v
    o: Any  #: projection ``[T, heads * head_dim] -> [T, hidden]``
    gate_up: Any  #: projection to ``[T, 2 * intermediate]``: gate, then up (SiLU(gate) * up)
    down: Any  #: projection ``[T, intermediate] -> [T, hidden]``
    #: RMSNorm before attention: its weight ``[hidden]``, or a callable ``x -> RMSNorm(x)``
    #: (the vLLM adapter passes the target's own RMSNorm layers: one fused op each on the CPU)
    input_norm: Any
    post_attention_norm: Any  #: RMSNorm before the MLP: weight ``[hidden]`` or callable


@dataclass
class TargetWeights:
    """A Llama-style target model as a self-speculative proposer sees it: plain tensors and
    callables, no vLLM type (shapes: ``T`` tokens). Attention is causal with
    ``num_kv_heads`` shared by groups of the ``num_heads`` query heads, scaled by
    ``head_dim ** -0.5``; rotary embeddings are NeoX-style (rotate halves) over the first
    ``rotary_dim`` dimensions of each head."""

    embed: Any  #: ``[vocab, hidden]`` tensor, or a callable ``ids [T] -> [T, hidden]``
    layers: list[TargetLayer]
    final_norm: Any  #: RMSNorm after the last layer: weight ``[hidden]`` or callable
    lm_head: Any  #: projection ``[T, hidden] -> [T, vocab]`` (logits)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    rope_theta: float = 10000.0
    #: the target's own table ``[max_positions, rotary_dim]`` (cos half, then sin half), which
    #: carries any RoPE scaling; ``None``: computed from :attr:`rope_theta`
    rope_cos_sin: Any = None
    rotary_dim: int | None = None  #: ``None``: ``head_dim``
    #: the target's own rotary op, ``(positions [T], q [T, heads * head_dim], k [T, kv_heads *
    #: head_dim]) -> (q, k)`` (may work in place); ``None``: the proposer rotates with the table
    rope: Any = None
    #: what built it, e.g. ``"vLLM LlamaForCausalLM"`` (for messages and ``describe()``)
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class SelfSpeculativeProposer(Proposer[P]):
    """A proposer that drafts with the target model (see the module docstring).

    ``attach_target`` comes once, before the first ``propose``; a proposer asked to
    ``propose`` without a target (e.g. built outside vLLM) should draft nothing."""

    #: read by the speculative adapter: describe the target and call :meth:`attach_target`
    needs_target_weights: bool = True

    @abstractmethod
    def attach_target(self, weights: TargetWeights) -> None:
        """The target model; raise ``ValueError`` naming the problem and the fix if it is
        one this proposer cannot draft with (too few layers, unsupported shapes)."""


__all__ = ["SelfSpeculativeProposer", "TargetLayer", "TargetWeights"]
