"""Errors the Engine raises to its callers (the HTTP layer maps them to status codes)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine could not serve a request (a subprocess failed, or the engine is stopped)."""


class EngineStartError(EngineError):
    """The subprocesses did not come up (one died while loading, or Ready did not arrive)."""


class EngineDeadError(EngineError):
    """A subprocess died while serving; every in-flight request fails with this."""


class RequestTimedOut(EngineError):
    """The request's deadline passed before it produced a token (a 503, code request_timeout).
    One that times out while generating ends instead, with finish_reason "timeout"."""


class ContextLengthExceeded(ValueError):
    """prompt + max_new_tokens is more than the model's context (a 400 for the client)."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_length = context_length
        super().__init__(
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_tokens + max_new_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_new_tokens} for the completion). Please reduce the prompt or max_tokens."
        )


class KVCacheTooSmall(ValueError):
    """The request could never fit in the KV pool, however empty (a 400 rather than a wait)."""


class GrammarBroken(RuntimeError):
    """A request's grammar could not go on in the worker (it rejected a token sampled under its
    own mask, or did not compile there): the request fails rather than ending as if complete.
    Not the client's fault: a 500."""
