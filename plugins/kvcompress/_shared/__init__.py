"""Code several KV compressors use, laid out as a plugin is (nothing is registered here):

* :mod:`.policy`: the block planners of the eviction compressors (``streaming``, ``h2o``,
  ``snapkv``), pure Python;
* :mod:`.reference`: ``KVCompressor.attend`` of the scored compressors (``h2o``, ``snapkv``):
  exact attention with per-block mass (the attention kind's shared exact attention), or the
  Triton decode kernel with ``kernel: triton``;
* :mod:`.kernel`: that Triton decode kernel (imported only when chosen).
"""
