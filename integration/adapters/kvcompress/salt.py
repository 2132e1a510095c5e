"""The prefix-cache salt of a lossy kvcompress deployment (see "Prefix-cache salt" in the
package doc), vLLM-free: the salt itself and the ``Request.__init__`` wrapper that puts it in
front of every request's ``cache_salt`` (installed by the adapter's ``install_patch``)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from . import state as _state
from .plan import KVCompressError
from .state import VERSIONS


def cache_salt(name: str, params: Any) -> str:
    """The prefix-cache salt of a lossy compressor with its parameters: KV computed while
    blocks were evicted differs from plain KV of the same tokens, so its block hashes must
    never match a plain request's (nor those of another compressor or budget)."""
    dumped = params.model_dump_json() if hasattr(params, "model_dump_json") else repr(params)
    return f"vllm-graft/kvcompress/{name}/{dumped}"


def composition_salt(plugins: Sequence[tuple[str, Any, bool]]) -> str | None:
    """The prefix-cache salt of a deployment's kvcompress plugins ``(name, params, lossless)``
    (an eviction compressor and/or a storage format): the lossy ones' salts joined with
    ``+``, so kv4 KV never matches plain KV, nor streaming-only KV, nor kv4 at other
    parameters; None when every plugin is lossless."""
    lossy = [cache_salt(name, params) for name, params, lossless in plugins if not lossless]
    return "+".join(lossy) if lossy else None


def salted(user_salt: str | None, salt: str | None) -> str | None:
    """A request's ``cache_salt`` with the compressor's salt in front (the user's salt, if
    any, stays part of it, so requests salted differently still never share)."""
    if salt is None:
        return user_salt
    return salt if not user_salt else f"{salt}|{user_salt}"


def request_salt(salt: str, request_id: Any) -> str:
    """The salt of one request of a merging compressor: its blocks are shared with no other
    request (a merged block's KV no longer matches its tokens' hash)."""
    return f"{salt}/request={request_id}"


def request_init_wrapper(original: Callable) -> Callable:
    """The patch of ``Request.__init__``: the active lossy deployment's salt goes in front of
    the request's ``cache_salt`` (:func:`salted`)."""
    import inspect

    signature = inspect.signature(original)
    if "cache_salt" not in signature.parameters:
        raise KVCompressError(
            "vllm-graft kvcompress: vllm.v1.request.Request takes no 'cache_salt'; this vLLM "
            f"hashes prefix-cache blocks differently from the one the adapter was written for ({VERSIONS})"
        )

    def __init__(self, *args, **kwargs):
        state = _state.get_active()
        if state is not None and (state.salt is not None or state.salt_per_request):
            bound = signature.bind(self, *args, **kwargs)
            salt = state.salt
            if state.salt_per_request:  # merged blocks match no token hash: share none of them
                salt = request_salt(salt or cache_salt(state.name, None), bound.arguments.get("request_id"))
            bound.arguments["cache_salt"] = salted(bound.arguments.get("cache_salt"), salt)
            return original(*bound.args, **bound.kwargs)
        return original(self, *args, **kwargs)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__
