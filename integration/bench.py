"""`vllm-graft bench`: the A/B benchmark (being written)."""


def add_command(sub) -> None:
    pass
