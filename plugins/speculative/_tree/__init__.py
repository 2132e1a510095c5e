"""Primitives for *tree* speculative decoding (SpecInfer, Medusa, Token Recycling's static
trees), laid out as a plugin is, for the proposers to share (nothing is registered here, and
nothing here imports vLLM):

* :mod:`.tree`: :class:`DraftTree`, a proposer's candidate continuations as one tree (tokens,
  parents in topological order, depths, ancestor mask, root-to-leaf paths), built from token
  chains that share prefixes or from Token Recycling's ``(token, parent)`` pairs;
* :mod:`.reference`: :func:`tree_attention`, one verify pass's attention for one sequence (paged
  context plus the node's ancestors-or-self) in plain PyTorch, the oracle; and
  :func:`verify_pass_attention`, the same pass with its keys already in the cache (as in
  vLLM's engine), the engine's CPU path;
* :mod:`.kernel`: the same attention as a Triton kernel (imported only when wanted, so that
  ``TRITON_INTERPRET`` can be set first);
* :mod:`.verify`: accepting a path of the tree, greedily (:func:`verify_greedy`) or losslessly
  under sampling by recursive rejection sampling (:func:`verify_sampling`).
"""

from .reference import tree_attention, verify_pass_attention
from .tree import DraftTree, ancestor_mask, first_path, is_chain, merge_chains
from .verify import Verdict, verify_greedy, verify_sampling

__all__ = [
    "DraftTree",
    "Verdict",
    "ancestor_mask",
    "first_path",
    "is_chain",
    "merge_chains",
    "tree_attention",
    "verify_greedy",
    "verify_pass_attention",
    "verify_sampling",
]
