"""RequestOutput (engine) -> GenerateResponse messages (wire), per the stream shape of docs/api.md."""
from __future__ import annotations

from functools import lru_cache

from google.protobuf import duration_pb2

from llmsvc.outputs import ABORT, CONTEXT, LENGTH, STOP, TIME_LIMIT, CompletionOutput, RequestOutput
from llmsvc.v1 import llmsvc_pb2 as pb

R = pb.FinishInfo
REASONS = {STOP: R.REASON_STOP, LENGTH: R.REASON_LENGTH, CONTEXT: R.REASON_CONTEXT,
           ABORT: R.REASON_ABORTED, TIME_LIMIT: R.REASON_TIME_LIMIT}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable stand-in character -> the raw byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Piece text and raw bytes of single tokens (for OutputOptions.token_text)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def piece(self, token_id: int) -> tuple[str, bytes]:
        tok = self.tokenizer
        text = tok.decode([token_id], skip_special_tokens=False)
        raw = tok.convert_ids_to_tokens(token_id) if hasattr(tok, "convert_ids_to_tokens") else None
        dec = _byte_decoder()
        if isinstance(raw, str) and raw and all(ch in dec for ch in raw):
            return text, bytes(dec[ch] for ch in raw)
        return text, text.encode("utf-8", "replace")


def _duration(seconds: float | None) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    if seconds is not None and seconds >= 0:
        d.FromNanoseconds(int(seconds * 1e9))
    return d


def _top(entries: dict, k: int, token_text: TokenText | None) -> list[pb.TopLogprob]:
    ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank or 10 ** 9, -kv[1].logprob))[:k]
    out = []
    for tid, lp in ranked:
        t = pb.TopLogprob(token_id=tid, logprob=lp.logprob)
        if token_text is not None:
            t.text, t.token_bytes = token_text.piece(tid)
        out.append(t)
    return out


def token_logprobs(comp: CompletionOutput, k: int, token_text: TokenText | None) -> list[pb.TokenLogprob]:
    out = []
    for tid, entries in zip(comp.token_ids, comp.logprobs or []):
        lp = entries.get(tid)
        if lp is None:
            continue
        m = pb.TokenLogprob(token_id=tid, logprob=lp.logprob, rank=lp.rank or 0)
        if token_text is not None:
            m.text, m.token_bytes = token_text.piece(tid)
        if k > 0:
            m.top_logprobs.extend(_top(entries, k, token_text))
        out.append(m)
    return out


class ResponseBuilder:
    """Per-request state for turning engine outputs into GenerateResponse messages."""

    def __init__(self, request_id: str, req, params, tokenizer) -> None:
        self.request_id = request_id
        self.opts = req.output
        self.params = params
        self.want_text = self.opts.text if self.opts.HasField("text") else True
        self.want_ids = self.opts.token_ids if self.opts.HasField("token_ids") else True
        self.token_text = TokenText(tokenizer) if self.opts.token_text and tokenizer is not None else None
        self.prompt_sent = False

    def prompt_info(self, out: RequestOutput) -> pb.PromptInfo:
        info = pb.PromptInfo(num_prompt_tokens=len(out.prompt_token_ids), num_cached_tokens=out.num_cached_tokens)
        if self.opts.prompt_token_ids:
            info.token_ids.extend(out.prompt_token_ids)
        if self.params.prompt_logprobs is not None and out.prompt_logprobs is not None:
            k = self.params.prompt_logprobs
            for tid, entries in zip(out.prompt_token_ids, out.prompt_logprobs):
                pl = pb.PromptLogprob(token_id=tid)
                if entries is not None and tid in entries:
                    pl.logprob = entries[tid].logprob
                    if k > 0:
                        pl.top_logprobs.extend(_top(entries, k, self.token_text))
                info.logprobs.append(pl)
        return info

    def finish_info(self, out: RequestOutput, comp: CompletionOutput) -> pb.FinishInfo:
        f = pb.FinishInfo(reason=REASONS.get(comp.finish_reason, R.REASON_UNSPECIFIED),
                          abort_reason=out.abort_reason or "")
        sr = comp.stop_reason
        if isinstance(sr, str):
            f.stop_string = sr
        elif comp.eos_token_id is not None:  # any of the model's EOS ids (offline, some keep stop_reason)
            f.eos_token_id = comp.eos_token_id
        elif isinstance(sr, int) and not isinstance(sr, bool):
            f.stop_token_id = sr
        f.usage.CopyFrom(pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=comp.num_output_tokens,
                                  cached_tokens=out.num_cached_tokens))
        if comp.seed is not None:
            f.seed = comp.seed
        m = out.metrics
        if self.opts.include_timing and m is not None:
            t = f.timing
            if m.first_scheduled_time:
                t.queue.CopyFrom(_duration(m.first_scheduled_time - m.arrival_time))
            if m.first_token_time:
                t.time_to_first_token.CopyFrom(_duration(m.first_token_time - m.arrival_time))
                if m.first_scheduled_time:
                    t.prefill.CopyFrom(_duration(m.first_token_time - m.first_scheduled_time))
                end = m.finished_time or m.last_token_time
                if end:
                    t.decode.CopyFrom(_duration(end - m.first_token_time))
            if m.finished_time:
                t.total.CopyFrom(_duration(m.finished_time - m.arrival_time))
            t.num_preemptions = m.num_preemptions
            t.num_swaps = m.num_swaps
            t.num_draft_tokens = m.num_draft_tokens
            t.num_accepted_tokens = m.num_accepted_tokens
        return f

    def message(self, out: RequestOutput, comp: CompletionOutput) -> pb.GenerateResponse:
        msg = pb.GenerateResponse(request_id=self.request_id, index=comp.index,
                                  num_output_tokens=comp.num_output_tokens)
        if self.want_text:
            msg.text = comp.text
        if self.want_ids:
            msg.token_ids.extend(comp.token_ids)
        if self.params.logprobs is not None and comp.logprobs:
            msg.logprobs.extend(token_logprobs(comp, self.params.logprobs, self.token_text))
        if not self.prompt_sent:
            msg.prompt.CopyFrom(self.prompt_info(out))
            self.prompt_sent = True
        if comp.finish_reason is not None:
            msg.finish.CopyFrom(self.finish_info(out, comp))
        return msg

    def stream_messages(self, out: RequestOutput) -> list[pb.GenerateResponse]:
        """Delta messages for one (coalesced) engine output; skips empty non-final deltas."""
        msgs = []
        for comp in sorted(out.outputs, key=lambda c: c.index):
            if comp.finish_reason is None and not comp.text and not comp.token_ids and self.prompt_sent:
                continue
            msgs.append(self.message(out, comp))
        return msgs
