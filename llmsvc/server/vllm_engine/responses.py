"""RequestOutput (engine, DELTA kind) -> vllm.grpc.engine.GenerateResponse messages.

Stream shape (stream=true), per output index, as vLLM's own gRPC worker sends it:
  chunk* (token_ids: the new tokens; completion_tokens: how many; the first chunk of an index also
  carries the prompt's logprobs when asked) ... then one `complete` when the index finishes,
  whose output_ids are only the last new tokens (the last chunk's; a gateway accumulates the
  chunks), with finish_reason, the matched stop, prompt / completion (cumulative) / cached token
  counts, and that index's speculative-decoding counts (spec_draft_tokens / spec_accepted_tokens).
  Unary shape (stream=false): one `complete` per index, in index order, with every token.

Finish reasons are vLLM's strings: "stop" (EOS, stop token, stop string, grammar end), "length"
(max_tokens, or the context / KV-pool limit), "abort".
"""
from __future__ import annotations

from llmsvc.outputs import ABORT, CONTEXT, LENGTH, STOP, TIME_LIMIT, CompletionOutput, RequestOutput
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as pb

FINISH_REASONS = {STOP: "stop", LENGTH: "length", CONTEXT: "length", ABORT: "abort", TIME_LIMIT: "length"}


def _top(entries: dict, k: int) -> pb.TopLogProbs:
    """The k best alternatives of one position, best first (our entries hold the sampled token
    and the top-k, each with its 1-based rank)."""
    ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank or 10 ** 9, -kv[1].logprob))[:k]
    return pb.TopLogProbs(values=[lp.logprob for _, lp in ranked], token_ids=[t for t, _ in ranked])


def output_logprobs(token_ids: list[int], logprobs, k: int | None) -> pb.OutputLogProbs | None:
    """One entry per token (its logprob), plus its top-k alternatives when k > 0."""
    if k is None or not logprobs:
        return None
    out = pb.OutputLogProbs()
    for tid, entries in zip(token_ids, logprobs):
        lp = entries.get(tid)
        if lp is None:
            continue
        out.token_ids.append(tid)
        out.token_logprobs.append(lp.logprob)
        if k > 0:
            out.top_logprobs.append(_top(entries, k))
    return out if out.token_ids else None


def input_logprobs(prompt_ids: list[int], prompt_logprobs, k: int | None) -> pb.InputLogProbs | None:
    """One entry per prompt position; the first has no value (nothing precedes it)."""
    if k is None or not prompt_logprobs:
        return None
    out = pb.InputLogProbs()
    for tid, entries in zip(prompt_ids, prompt_logprobs):
        value = pb.InputTokenLogProb()
        if entries is not None and tid in entries:
            value.value = entries[tid].logprob
        out.token_ids.append(tid)
        out.token_logprobs.append(value)
        if k > 0:
            out.top_logprobs.append(_top(entries or {}, k))
    return out


class ResponseBuilder:
    """One Generate call's messages. `logprobs` / `prompt_logprobs`: the admitted request's counts
    (None: not asked)."""

    def __init__(self, logprobs: int | None, prompt_logprobs: int | None) -> None:
        self.k, self.prompt_k = logprobs, prompt_logprobs
        self.prompt_logprobs: list = []  # prompt positions so far (they may come over several outputs)
        self.prompt_sent: set[int] = set()  # indexes whose first chunk went out

    def _note_prompt_logprobs(self, out: RequestOutput) -> None:
        if self.prompt_k is not None and out.prompt_logprobs:
            self.prompt_logprobs.extend(out.prompt_logprobs)

    def complete(self, out: RequestOutput, comp: CompletionOutput, with_prompt_logprobs: bool) -> pb.GenerateResponse:
        c = pb.GenerateComplete(
            output_ids=comp.token_ids, finish_reason=FINISH_REASONS.get(comp.finish_reason, "stop"),
            prompt_tokens=len(out.prompt_token_ids), completion_tokens=comp.num_output_tokens,
            cached_tokens=out.num_cached_tokens, index=comp.index)
        # this index's own counts, as vLLM's worker reports each completion's (a gateway may sum them)
        c.spec_draft_tokens, c.spec_accepted_tokens = comp.num_draft_tokens, comp.num_accepted_tokens
        sr = comp.stop_reason
        if isinstance(sr, str):
            c.matched_stop_str = sr
        elif isinstance(sr, int) and not isinstance(sr, bool):
            c.matched_token_id = sr
        self._logprobs_into(c, comp, out, with_prompt_logprobs)
        return pb.GenerateResponse(complete=c)

    def _logprobs_into(self, msg, comp, out: RequestOutput, with_prompt: bool) -> None:
        """msg (a chunk or a complete) gets comp's output logprobs and, with_prompt, the prompt's."""
        lps = output_logprobs(comp.token_ids, comp.logprobs, self.k)
        if lps is not None:
            msg.output_logprobs.CopyFrom(lps)
        if with_prompt:
            ilp = input_logprobs(out.prompt_token_ids, self.prompt_logprobs, self.prompt_k)
            if ilp is not None:
                msg.input_logprobs.CopyFrom(ilp)

    def stream_messages(self, out: RequestOutput) -> list[pb.GenerateResponse]:
        """The chunks (and completes) of one coalesced DELTA output."""
        self._note_prompt_logprobs(out)
        msgs = []
        for comp in sorted(out.outputs, key=lambda c: c.index):
            first = comp.index not in self.prompt_sent
            if comp.token_ids:
                chunk = pb.GenerateStreamChunk(
                    token_ids=comp.token_ids, prompt_tokens=len(out.prompt_token_ids),
                    completion_tokens=len(comp.token_ids), cached_tokens=out.num_cached_tokens, index=comp.index)
                self._logprobs_into(chunk, comp, out, first)
                if first:
                    self.prompt_sent.add(comp.index)
                msgs.append(pb.GenerateResponse(chunk=chunk))
            if comp.finish_reason is not None:
                msgs.append(self.complete(out, comp, with_prompt_logprobs=comp.index not in self.prompt_sent))
        return msgs

    def final_messages(self, final: RequestOutput) -> list[pb.GenerateResponse]:
        """Unary: one complete per index, every token, from the merged outputs."""
        self._note_prompt_logprobs(final)
        return [self.complete(final, comp, with_prompt_logprobs=True)
                for comp in sorted(final.outputs, key=lambda c: c.index)]
