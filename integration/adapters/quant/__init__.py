"""quant adapter. ``engine`` holds ``ADAPTER`` and imports without vLLM; ``vllm_method`` is the
vLLM half (vLLM's config and linear-method classes), imported by ``engine`` when it activates;
the rest of the package is vLLM-free logic, testable without vLLM."""
