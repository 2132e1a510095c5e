"""The bridge to vLLM: the only package of vllm-graft that imports vllm.

Importing this package does not import vLLM; each adapter imports it when used, so the
CLI's `plugins` and `check` stay fast.
"""
