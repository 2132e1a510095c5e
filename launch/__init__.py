"""Starting vLLM with a plan and reading what it reports: the floor that the command line
(``cli/``), the measurement tools (``tools/``) and the conformance kit (``kit/``) stand on.

* :mod:`.engine`: a deployment's plan as vLLM's engine arguments, the CPU engine's environment
  defaults, an in-process engine, the ``vllm serve`` command line;
* :mod:`.reports`: the per-process reports the runtime writes, vLLM's ``/metrics`` text;
* :mod:`.exits`: the exit statuses every command shares (a leaf: it imports nothing).

It stands on :mod:`vllm_graft.integration` (the plan, the bridge's version check) and never on
the floors above it. vLLM's public ``LLM`` is imported only inside functions, so importing this
package loads no vLLM.
"""
