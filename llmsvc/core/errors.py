"""Errors the engine raises at admission time; the server maps each to a status code.

ValueError subclasses -> INVALID_ARGUMENT (LoRANotFoundError -> NOT_FOUND); DuplicateRequestError -> ALREADY_EXISTS;
QueueFullError -> RESOURCE_EXHAUSTED.
"""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field is out of range for this engine/model. `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PromptTooLongError(InvalidRequestError):
    """The prompt leaves no room for max(min_tokens, 1) generated tokens within `max_model_len` tokens."""

    def __init__(self, prompt_tokens: int, max_model_len: int, what: str = "the maximum context length",
                 min_tokens: int = 0) -> None:
        room = f"min_tokens={min_tokens} generated tokens" if min_tokens > 1 else "at least one generated token"
        super().__init__(
            "prompt",
            f"prompt has {prompt_tokens} tokens; {what} is {max_model_len} tokens "
            f"(prompt must be shorter, to leave room for {room})",
        )
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len


class LoRANotFoundError(InvalidRequestError):
    """The request names a LoRA adapter this engine does not serve (NOT_FOUND)."""

    def __init__(self, name: str, served: list[str]) -> None:
        known = ", ".join(served) if served else "none (start the server with --lora-modules NAME=PATH)"
        super().__init__("lora_name", f"no LoRA adapter named {name!r}; served: {known}")
        self.name = name


class LoRAAdminError(RuntimeError):
    """Loading or unloading a LoRA adapter was refused; `reason` says why (the server maps it:
    LORA_EXISTS -> ALREADY_EXISTS, LORA_SLOTS_FULL -> RESOURCE_EXHAUSTED, LORA_IN_USE and
    LORA_DISABLED -> FAILED_PRECONDITION, LORA_LOAD_FAILED -> INVALID_ARGUMENT)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class DuplicateRequestError(KeyError):
    """A request with this id is already in flight."""

    def __init__(self, request_id: str, why: str = "") -> None:
        super().__init__(request_id)
        self.request_id = request_id
        self.why = why  # which id collides, when it is a sample's ("0_foo" of an n>1 request "foo")

    def __str__(self) -> str:
        return f"request id {self.request_id!r} {self.why or 'is already in flight'}"


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting_requests`; retry later."""
