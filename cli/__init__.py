"""The `vllm-graft` command line: the commands (:mod:`.main`), the engine commands
(:mod:`.engine_commands`, standing on :mod:`vllm_graft.launch`), the bundled models
(:mod:`.models`) and the doctor (:mod:`.doctor`). Nothing here is loaded by vLLM: that is
:mod:`vllm_graft.integration`."""
