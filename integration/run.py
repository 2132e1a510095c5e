"""`vllm-graft demo`, `generate` and `serve` (being written)."""


def add_command(sub) -> None:
    pass
