"""StructuredRequest: the grammar state of one engine request (torch-free).

Owned by the engine's Request (`request.structured`) and touched only from the engine thread.
Life: WAITING_FOR_FSM while its compile runs (`poll`), then one matcher copied from the
compiled one, advanced by every sampled token (`accept`) and asked for the next token's mask
each step it samples. The matcher always reflects exactly `output_token_ids`; `sync`
rebuilds it from the compiled start state whenever that is not so.
"""
from __future__ import annotations

import time
from concurrent.futures import Future

import llguidance

from llmsvc.structured import errors as E


class StructuredRequest:
    def __init__(self, kind: str, compiled: Future, timeout_s: float, tokenizer_ready: Future | None = None) -> None:
        self.kind = kind
        self._compiled = compiled  # Future[llguidance.LLMatcher] in its start state
        # the time limit is the compile's: it counts from when the manager's one-time tokenizer
        # view is ready (the compile waits for it), so the first constraint is not charged for it
        self._tokenizer_ready = tokenizer_ready
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self.matcher: llguidance.LLMatcher | None = None
        self.num_consumed = 0  # output tokens the matcher has consumed

    def poll(self, now: float | None = None) -> bool:
        """True once the grammar is ready; False while it compiles. Raises ConstraintError when
        the compile failed or has run past the time limit."""
        if self.matcher is not None:
            return True
        if not self._compiled.done():
            now = time.monotonic() if now is None else now
            if self._tokenizer_ready is not None and not self._tokenizer_ready.done():
                self._deadline = now + self._timeout_s
                return False
            if now >= self._deadline:
                raise E.ConstraintError(self.kind, E.COMPILE_TIMEOUT,
                                        f"did not compile within {self._timeout_s:g} s")
            return False
        if self._compiled.cancelled():  # the engine is shutting down
            raise E.ConstraintError(self.kind, E.COMPILE_CANCELLED, "was not compiled: the engine stopped")
        self.matcher = self._compiled.result().deep_copy()  # re-raises the compile's ConstraintError
        self.num_consumed = 0
        return True

    @property
    def future(self) -> Future:
        return self._compiled

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to the state after `output_token_ids`: consume what it has not
        seen, or rebuild it from the start state if it ran ahead (tokens were taken back)."""
        if self.num_consumed > len(output_token_ids):
            self.matcher = self._compiled.result().deep_copy()
            self.num_consumed = 0
        for tok in output_token_ids[self.num_consumed:]:
            self.accept(tok)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token. False if the grammar rejects it (the matcher is then
        in an error state for good; a masked sampler never lets that happen)."""
        self.num_consumed += 1
        return self.matcher.consume_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows no further token (not even EOS is needed)."""
        return self.matcher.is_stopped()

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    def error(self) -> str:
        """The grammar engine's message once `failed` ("" before), without its verbosity marker."""
        return E.matcher_error(self.matcher)
