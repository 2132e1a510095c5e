"""Code several KV compressors use, laid out as a plugin is (nothing is registered here):

* :mod:`.policy`: the block planners of the eviction compressors (``streaming``, ``h2o``,
  ``snapkv``, ``adakv``, and ``keep_top`` of ``tova``, ``knorm``, ``keydiff``), pure Python;
* :mod:`.params`: the parameters of the keep-the-top-blocks compressors, and the checks of
  sink, recent and held blocks against the budget that the eviction compressors share;
* :mod:`.reference`: the shared attention with per-block mass the worker runs for a scored
  compressor that implements no ``attend`` (the attention kind's shared exact attention), or
  the Triton decode kernel with ``kernel: triton``;
* :mod:`.kernel`: that Triton decode kernel (imported only when chosen);
* :mod:`.keys`: block scores read from the keys in the cache (``knorm``, ``keydiff``).
"""
