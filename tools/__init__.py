"""Measurement tools behind the ``vllm-graft`` sub-commands, split by kind.

``bench`` and ``workloads`` are the A/B benchmark every kind shares; ``attention/``,
``kvcompress/``, ``speculative/``, ``quant/`` and ``moe/`` hold each kind's own figures
(and ``calibrate`` the offline calibration passes). Each command module has
``add_command(subparsers)``; the CLI (:mod:`vllm_graft.cli.main`) registers them.
Tools start vLLM through :mod:`vllm_graft.launch.engine` and read plugins through the
registry; they import vLLM's public API (``vllm.LLM``, ``SamplingParams``) only inside
functions, so ``vllm-graft plugins`` stays fast.
"""
