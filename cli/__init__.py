"""The `vllm-graft` command line: the commands (:mod:`.main`), starting vLLM with a deployment
(:mod:`.launch`, :mod:`.engine_commands`), the bundled models (:mod:`.models`) and the doctor
(:mod:`.doctor`). Nothing here is loaded by vLLM: that is :mod:`vllm_graft.integration`."""
