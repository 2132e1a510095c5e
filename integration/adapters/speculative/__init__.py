"""speculative adapter. ``engine`` is the vLLM half (it holds ``ADAPTER`` and imports vLLM's
internals); the rest of the package is vLLM-free logic, testable without vLLM."""
