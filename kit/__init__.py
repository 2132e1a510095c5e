"""The kit for plugin authors: the conformance pytest plugin (:mod:`.conformance`) and the
scaffold behind ``vllm-graft new-plugin`` (:mod:`.scaffold`). It reads plugins only through
the registry and never imports vLLM at import time."""
