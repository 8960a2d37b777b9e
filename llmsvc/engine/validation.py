"""The request rules every front end shares (offline LLM, gRPC server), written once. Torch-free.

A violation raises InvalidRequestError naming the SamplingParams field, with an index where one
element is at fault ("stop[1]", "logit_bias[7]", "prompt_token_ids[3]"), or PromptTooLongError.
The server runs the same functions and only maps those names onto proto field paths.

Room for output: a request fits when prompt + max(min_tokens, 1) <= max_len (it can generate its
min_tokens, and at least one token), and an explicit max_tokens fits when prompt + max_tokens <= max_len.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmsvc.core.errors import InvalidRequestError, PromptTooLongError
from llmsvc.sampling_params import SamplingParams, SamplingParamsError

MAX_SEED = 2 ** 63  # seeds are drawn and hashed as signed 64-bit integers


@dataclass(frozen=True)
class RequestLimits:
    """What one engine accepts. max_len: tokens (prompt + output) one request may hold."""

    vocab_size: int  # 0: unknown, token ids are not range-checked
    max_len: int
    max_n: int = 16
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_logprobs: int = 20
    # what max_len is, for the PROMPT_TOO_LONG message
    max_len_source: str = "the maximum context length"
    eos_token_ids: tuple[int, ...] = ()  # what min_tokens keeps from being sampled (unless ignore_eos)


def make_sampling_params(**kw) -> SamplingParams:
    """SamplingParams.unverified(**kw) for a door (admission verifies them); a field of the wrong
    type raised as InvalidRequestError."""
    try:
        return SamplingParams.unverified(**kw)
    except SamplingParamsError as e:
        raise InvalidRequestError(e.field, e.why) from None


def check_sampling_params(params: SamplingParams, limits: RequestLimits) -> None:
    """The rules that need no prompt: SamplingParams.verify() with this engine's logprobs cap
    (params may have changed since they were built), then the limits of the model."""
    try:
        params.verify(limits.max_logprobs)
    except SamplingParamsError as e:
        raise InvalidRequestError(e.field, e.why) from None
    if params.n > limits.max_n:
        raise InvalidRequestError("n", f"must be in [1, {limits.max_n}], got {params.n}")
    if params.seed is not None and params.seed >= MAX_SEED:
        raise InvalidRequestError("seed", f"must be < 2^63, got {params.seed}")
    vocab = limits.vocab_size
    if vocab and params.top_k > vocab:
        raise InvalidRequestError("top_k", f"must be <= vocab_size ({vocab}), got {params.top_k}")
    if vocab:
        for tok in params.logit_bias or {}:
            if tok >= vocab:
                raise InvalidRequestError("logit_bias", f"token id {tok} is out of range [0, {vocab})")
        for seq in params.bad_words_token_ids or ():
            if any(t >= vocab for t in seq):
                raise InvalidRequestError("bad_words_token_ids", f"token ids must be < vocab_size ({vocab})")
        for i, tok in enumerate(params.allowed_token_ids or ()):
            if tok >= vocab:
                raise InvalidRequestError(f"allowed_token_ids[{i}]", f"token id {tok} is out of range [0, {vocab})")
    L = limits.max_len
    if params.max_tokens is not None and params.max_tokens >= L:
        raise InvalidRequestError("max_tokens", f"must be < max_model_len ({L}), got {params.max_tokens}")
    if params.min_tokens >= L:
        raise InvalidRequestError("min_tokens", f"must be < max_model_len ({L}), got {params.min_tokens}")
    if params.bad_words and len(params.bad_words) > limits.max_stop_strings:
        raise InvalidRequestError("bad_words", f"at most {limits.max_stop_strings} words, got {len(params.bad_words)}")
    for i, word in enumerate(params.bad_words or ()):  # tokenized at admission: bounded like a stop string
        if len(word) > limits.max_stop_string_chars:
            raise InvalidRequestError(f"bad_words[{i}]", f"must be at most {limits.max_stop_string_chars} characters")
    if len(params.stop) > limits.max_stop_strings:
        raise InvalidRequestError("stop", f"at most {limits.max_stop_strings} stop strings, got {len(params.stop)}")
    for i, stop in enumerate(params.stop):
        if len(stop) > limits.max_stop_string_chars:
            raise InvalidRequestError(f"stop[{i}]", f"must be at most {limits.max_stop_string_chars} characters")
    if len(params.stop_token_ids) > limits.max_stop_strings:
        raise InvalidRequestError("stop_token_ids", f"at most {limits.max_stop_strings} stop token ids, "
                                  f"got {len(params.stop_token_ids)}")
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab)


def check_token_ids(name: str, ids, vocab_size: int) -> None:
    if not vocab_size or not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # C-speed for long prompts
        return
    for i, t in enumerate(ids):  # a bad id: find the first, to name its index
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"{name}[{i}]", f"token id {t} is out of range [0, {vocab_size})")


def check_prompt_fits(num_prompt_tokens: int, params: SamplingParams, limits: RequestLimits) -> None:
    """Room for output (see the module docstring)."""
    L = limits.max_len
    if num_prompt_tokens + max(params.min_tokens, 1) > L:
        raise PromptTooLongError(num_prompt_tokens, L, limits.max_len_source, params.min_tokens)
    if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > L:
        raise InvalidRequestError(
            "max_tokens", f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len ({L}); lower max_tokens to <= {L - num_prompt_tokens} or leave it unset")


def default_max_tokens(default: int | None, num_prompt_tokens: int, params: SamplingParams,
                       max_len: int) -> int | None:
    """The max_tokens an unset one takes: generation_config's max_new_tokens (`default`, raised
    to min_tokens) where the prompt leaves room for it, as vLLM caps it; else None (to the
    context). Shared by the server and the offline LLM."""
    if not default:
        return None
    default = max(int(default), params.min_tokens)
    return default if default < max_len and num_prompt_tokens + default <= max_len else None


MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(cache_salt: str | None) -> None:
    """None (no salt), or a non-empty str of at most MAX_CACHE_SALT_CHARS characters."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequestError("cache_salt", "must be a non-empty string when set")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError("cache_salt", f"must be at most {MAX_CACHE_SALT_CHARS} characters, "
                                  f"got {len(cache_salt)}")


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Every rule: what the engine checks when a request is added."""
    check_sampling_params(params, limits)
    if not prompt_token_ids:
        raise InvalidRequestError("prompt", "must not be empty")
    check_token_ids("prompt_token_ids", prompt_token_ids, limits.vocab_size)
    check_prompt_fits(len(prompt_token_ids), params, limits)


def check_allowed_tokens_reachable(params: SamplingParams, limits: RequestLimits) -> None:
    """allowed_token_ids that the request's own rules all forbid at the first output token (a
    one-token bad word; under min_tokens, a stop token or EOS) leave nothing to sample: refused
    here rather than ending the request at its first step. Needs bad_words tokenized."""
    if not params.allowed_token_ids:
        return
    excluded = {seq[0] for seq in params.bad_words_token_ids or () if len(seq) == 1}
    if params.min_tokens > 0:
        excluded.update(params.stop_token_ids)
        if not params.ignore_eos:
            excluded.update(limits.eos_token_ids)
    if excluded.issuperset(params.allowed_token_ids):
        raise InvalidRequestError("allowed_token_ids", "every allowed token is forbidden at the first output "
                                  "token by the request's own bad_words or, under min_tokens, as a stop token or "
                                  "EOS: nothing could be sampled")
