"""StructuredOutputManager: compiles constraints off the step loop and fills the per-step mask.

Threads: `submit` may be called from any thread (the asyncio front end and the engine
thread both do); compiles run in a small thread pool of this object's own (llguidance drops
the GIL while it builds a matcher). `fill_bitmask` runs on the engine thread, once per step,
for the constrained requests that sample in that step only.

Compiled grammars are cached by (kind, spec) in an LRU of `cache_size` entries, failures
included, so a bad spec sent again fails at once. A request whose compile is not done after
`compile_timeout_s` (counted once the one-time tokenizer view is built) fails with
ConstraintError(COMPILE_TIMEOUT); so does a compile that itself ran longer than that, and
that outcome is what the cache keeps.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from llmsvc.sampling_params import StructuredOutputsParams
from llmsvc.structured import errors as E
from llmsvc.structured.compiler import FAILURE_REASON, build_tokenizer, compile_matcher
from llmsvc.structured.request import StructuredRequest

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], *,
                 compile_timeout_s: float = 10.0, cache_size: int = 256, num_threads: int = 2) -> None:
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="llmsvc-grammar")
        self._tokenizer_args = (hf_tokenizer, vocab_size, eos_token_ids)
        self._tokenizer_fut: Future | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def prewarm(self) -> None:
        """Start building the tokenizer view in the pool now (0.5-2 s of mostly GIL-holding
        Python). Without it the first constraint builds it, which is what a serving front end
        wants: the build then does not compete with its start-up and warm-up request."""
        self._tokenizer_future()

    def tokenizer_ready(self) -> Future:
        """Future of the one-time tokenizer view every compile waits for (started if it was
        not): a constraint's time limit counts from when it is done."""
        return self._tokenizer_future()

    def _tokenizer_future(self) -> Future:
        """Future of llguidance's view of the tokenizer; compiles and masks wait for it."""
        with self._lock:
            if self._tokenizer_fut is None:
                self._tokenizer_fut = self._pool.submit(build_tokenizer, *self._tokenizer_args)
            return self._tokenizer_fut

    # ---- compiling ----------------------------------------------------------------------
    def submit(self, params: StructuredOutputsParams) -> Future:
        """Future of the compiled start-state matcher for this constraint (cached)."""
        key = params.key()
        self._tokenizer_future()  # queued ahead of the compile, which waits for it in the pool
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, key, params)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # a request still holds its own future
            return fut

    def _compile(self, key, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        tokenizer = self._tokenizer_future().result()
        t0 = time.perf_counter()
        matcher = None
        try:
            matcher = compile_matcher(tokenizer, params)
        except E.ConstraintError:
            raise
        except Exception as e:  # the grammar engine refused the spec some other way
            raise E.ConstraintError(params.kind, FAILURE_REASON[params.kind],
                                    f"cannot be compiled: {e}") from None
        finally:
            dt = time.perf_counter() - t0
            logger.debug("compiled %s constraint in %.1f ms (%s)", key[0], dt * 1e3,
                         "ok" if matcher is not None else "failed")
        if dt > self.compile_timeout_s:
            raise E.ConstraintError(params.kind, E.COMPILE_TIMEOUT,
                                    f"took {dt:.3g} s to compile; the limit is {self.compile_timeout_s:g} s")
        return matcher

    def new_request(self, params: StructuredOutputsParams) -> StructuredRequest:
        return StructuredRequest(params.kind, self.submit(params), self.compile_timeout_s, self._tokenizer_future())

    def wait(self, params: StructuredOutputsParams, timeout_s: float | None = None) -> None:
        """Block until the constraint is compiled; ConstraintError if it fails or times out.
        For callers that may block (offline generate); never the engine thread."""
        fut = self.submit(params)
        limit = self.compile_timeout_s if timeout_s is None else timeout_s
        self._tokenizer_future().result()  # not part of the limit (raises what the build raised)
        try:
            fut.result(timeout=limit)
        except TimeoutError:
            raise E.ConstraintError(params.kind, E.COMPILE_TIMEOUT,
                                    f"did not compile within {limit:g} s") from None

    # ---- per step -------------------------------------------------------------------------
    def fill_bitmask(self, requests: list[StructuredRequest]) -> np.ndarray:
        """[len(requests), ceil(n_vocab / 32)] int32: row i allows the tokens requests[i] may sample next."""
        bitmask = allocate_token_bitmask(len(requests), self._tokenizer_future().result().vocab_size)
        # one row at a time on this thread (~10 us each for typical schemas): llguidance's
        # parallel fill keeps worker threads spinning that the model's own threads need
        for i, r in enumerate(requests):
            fill_next_token_bitmask(r.matcher, bitmask, i)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
