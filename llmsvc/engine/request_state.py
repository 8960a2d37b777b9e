"""RequestState: the output side of one (child) request: ids, text, logprobs, what was sent."""
from __future__ import annotations

import time

from llmsvc.core.core_output import EngineCoreOutput
from llmsvc.engine.detokenizer import DECODE_CONTEXT, IncrementalDetokenizer, decoded_token
from llmsvc.engine.stop_strings import StopStringChecker
from llmsvc.outputs import ABORT, STOP, CompletionOutput, Logprob
from llmsvc.sampling_params import RequestOutputKind, SamplingParams
from llmsvc.wire import SampleLogprobs


class RequestState:
    def __init__(self, req_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer) -> None:
        self.req_id = req_id
        self.index = index
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.tokenizer = tokenizer
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.stop_checker = StopStringChecker(params.stop, params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [] if params.prompt_logprobs is not None else None)
        self.text = ""  # detokenized output, cut at a matched stop string
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.eos_token_id: int | None = None
        self.abort_reason = ""  # why the engine ended it "abort" (structured output), for the client
        self.num_cached_tokens = 0
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # what the front end has already been sent (DELTA)
        self.sent_text = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.sent_prompt_logprobs = 0
        self.changed = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # ---- updates ---------------------------------------------------------------------------
    def process(self, out: EngineCoreOutput, now: float | None = None) -> bool:
        """Apply one core output. Returns True when a stop string finished the request here
        (the engine core must then be told to finish it)."""
        if self.finished:
            return False
        now = time.time() if now is None else now
        new_ids = out.new_token_ids
        # a prefill chunk that only brings prompt logprobs is no output of its own: they go out
        # whole, with the first token (as vLLM's), so PromptInfo is sent once and complete
        prompt_done = self._add_prompt_logprobs(out.new_prompt_logprobs)
        self.changed = self.changed or bool(new_ids) or out.finish_reason is not None or prompt_done
        self.num_cached_tokens = out.num_cached_tokens
        self.first_scheduled_time = self.first_scheduled_time or out.first_scheduled_time
        self.num_preemptions = out.num_preemptions
        self.num_swaps = out.num_swaps
        self.num_draft_tokens = out.num_draft_tokens
        self.num_accepted_tokens = out.num_accepted_tokens
        lps = out.new_logprobs or [None] * len(new_ids)
        if new_ids:
            self.first_token_time = self.first_token_time or now
            self.last_token_time = now
        num_text = len(new_ids)
        if (out.finish_reason == STOP and isinstance(out.stop_reason, int) and new_ids
                and not self.params.include_stop_str_in_output):
            num_text -= 1  # the EOS / stop token is not part of the text
        # several tokens in one step (accepted drafts) with stop strings to look for: one at a
        # time, so no token past the one completing a stop string is kept, as when they come one
        # step apiece; otherwise all at once
        each = 1 if self.stop_checker.stop and self.detokenizer is not None else max(1, len(new_ids))
        for i in range(0, max(1, len(new_ids)), each):
            ids = new_ids[i:i + each]
            self._append(ids, lps[i:i + each])
            text = self.detokenizer.update(ids[:max(0, num_text - i)]) if self.detokenizer else ""
            if self._add_text(text, self._may_stop()):
                return True
        if out.finish_reason is not None:
            self.finish(out.finish_reason, out.stop_reason)
        return False

    def _add_prompt_logprobs(self, entries) -> bool:
        """Append one chunk's prompt-logprob entries; True once every prompt position has one."""
        if not entries or self.prompt_logprobs is None:
            return False
        for lp in entries:
            pos = len(self.prompt_logprobs)
            self.prompt_logprobs.append(None if lp is None else self._convert(
                self.prompt_token_ids[pos], lp, self.params.prompt_logprobs,
                self.prompt_token_ids[max(0, pos - DECODE_CONTEXT):pos]))
        return self._prompt_logprobs_complete()

    def _prompt_logprobs_complete(self) -> bool:
        return len(self.prompt_logprobs) >= len(self.prompt_token_ids)

    def _append(self, ids: list[int], lps: list) -> None:
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        if self.logprobs is not None:
            for i, (tid, lp) in enumerate(zip(ids, lps), start):
                if lp is None:
                    continue
                context = self.token_ids[max(0, i - DECODE_CONTEXT):i]
                self.logprobs.append(self._convert(tid, lp, self.params.logprobs, context))
                self.cumulative_logprob += lp.logprob

    def _may_stop(self) -> bool:
        """A stop string counts only in the text of a token after the first min_tokens, as EOS and
        stop tokens can only be token min_tokens + 1 or later (vLLM's rule)."""
        return len(self.token_ids) > self.params.min_tokens

    def _add_text(self, delta: str, may_stop: bool) -> bool:
        if not delta:
            return False
        self.text += delta
        if not may_stop:  # a stop string that ends in text before min_tokens does not count
            return False
        match = self.stop_checker.find(self.text, len(delta))
        if match is None:
            return False
        keep, stop_str = match
        self.text = self.text[:keep]
        self.finish_reason, self.stop_reason = STOP, stop_str
        return True

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish for `reason` (any but a stop string); releases held-back text."""
        if self.finished:
            return
        self.changed = True
        if self.detokenizer is not None:
            flushed = self.detokenizer.flush()
            whole = flushed.rstrip("\ufffd")  # the rest stands for bytes of a character never completed
            if self._add_text(whole, self._may_stop()):
                return  # the flushed text completed a stop string (never one of those stand-ins)
            self.text += flushed[len(whole):]
        if reason == STOP and isinstance(stop_reason, int) and stop_reason not in self.params.stop_token_ids:
            # the core's stop token was an EOS. vLLM's stop_reason is None for the tokenizer's own
            # EOS and the id for the model's others (generation_config's list), which it counts
            # among the stop token ids
            self.eos_token_id = stop_reason
            if getattr(self.tokenizer, "eos_token_id", None) in (None, stop_reason):
                stop_reason = None
        if reason == ABORT and isinstance(stop_reason, str):  # the core's words; vLLM's stop_reason is None
            self.abort_reason, stop_reason = stop_reason, None
        self.finish_reason, self.stop_reason = reason, stop_reason

    def _convert(self, token_id: int, lp: SampleLogprobs, k: int | None, context: list[int]) -> dict[int, Logprob]:
        """The position's entries; `context`: the (up to DECODE_CONTEXT) ids before it, for
        tokens that are bytes of a character split over several tokens (see decoded_token)."""
        d = {token_id: Logprob(lp.logprob, lp.rank, self._decode_one(token_id, context))}
        for rank, (tid, v) in enumerate(zip(lp.top_token_ids[:k or 0], lp.top_logprobs), start=1):
            if tid not in d:
                d[tid] = Logprob(v, rank, self._decode_one(tid, context))
        return d

    def _decode_one(self, token_id: int, context: list[int]) -> str | None:
        return None if self.tokenizer is None else decoded_token(self.tokenizer, token_id, context)

    # ---- outputs ---------------------------------------------------------------------------
    def emittable_text_len(self) -> int:
        """Text that can be shown: all of it once finished, else minus a possible stop prefix."""
        if self.finished:
            return len(self.text)
        return max(self.sent_text, len(self.text) - self.stop_checker.holdback(self.text))

    def make_output(self, kind: RequestOutputKind) -> CompletionOutput:
        end = self.emittable_text_len()
        if kind == RequestOutputKind.DELTA:
            text, ids = self.text[self.sent_text:end], self.token_ids[self.sent_tokens:]
            lps = None if self.logprobs is None else self.logprobs[self.sent_logprobs:]
        else:
            text, ids = self.text[:end], list(self.token_ids)
            lps = None if self.logprobs is None else list(self.logprobs)
        self.sent_text, self.sent_tokens = end, len(self.token_ids)
        self.sent_logprobs = 0 if self.logprobs is None else len(self.logprobs)
        self.changed = False
        return CompletionOutput(
            index=self.index, text=text, token_ids=ids, cumulative_logprob=self.cumulative_logprob,
            logprobs=lps, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            num_output_tokens=len(self.token_ids), seed=self.params.seed, eos_token_id=self.eos_token_id,
            num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens)

    def take_prompt_logprobs(self, kind: RequestOutputKind):
        if self.prompt_logprobs is None:
            return None
        if not self.finished and not self._prompt_logprobs_complete():
            return None  # still prefilling: nothing until the whole prompt is in
        start = self.sent_prompt_logprobs if kind == RequestOutputKind.DELTA else 0
        self.sent_prompt_logprobs = len(self.prompt_logprobs)
        return self.prompt_logprobs[start:]
