"""Results of Generate: per-index completions accumulated from GenerateResponse messages.

`ResultBuilder.add(msg)` folds each message of a stream (deltas or the single final message of
stream=false) into `GenerateResult`; the same code serves both shapes, since a non-streamed
response is just one big delta per index.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llmsvc.v1 import llmsvc_pb2 as pb

# FinishInfo.Reason -> the short strings of llmsvc.outputs / OpenAI ("stop", "length", ...)
FINISH_REASONS = {
    pb.FinishInfo.REASON_UNSPECIFIED: None,
    pb.FinishInfo.REASON_STOP: "stop",
    pb.FinishInfo.REASON_LENGTH: "length",
    pb.FinishInfo.REASON_CONTEXT: "context",
    pb.FinishInfo.REASON_ABORTED: "abort",
    pb.FinishInfo.REASON_TIME_LIMIT: "time_limit",
}


def finish_reason_name(finish: pb.FinishInfo | None) -> str | None:
    """"stop" | "length" | "context" | "abort" | "time_limit", or None while unfinished."""
    return None if finish is None else FINISH_REASONS.get(finish.reason)


@dataclass
class Completion:
    """One of the n outputs of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # aligned with token_ids
    finish: pb.FinishInfo | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def finish_reason(self) -> str | None:
        return finish_reason_name(self.finish)

    @property
    def stop_reason(self) -> int | str | None:
        """The EOS / stop token id or stop string that ended the output, if any."""
        if self.finish is None:
            return None
        kind = self.finish.WhichOneof("matched")
        return getattr(self.finish, kind) if kind else None


@dataclass
class GenerateResult:
    """A whole Generate call. The convenience properties describe output index 0."""

    request_id: str = ""
    prompt: pb.PromptInfo | None = None
    outputs: list[Completion] = field(default_factory=list)  # ordered by index

    def _first(self) -> Completion:
        """Output 0; an empty one while nothing has arrived (a call that failed before its first
        message keeps what it has: nothing)."""
        return self.outputs[0] if self.outputs else Completion(0)

    @property
    def text(self) -> str:
        return self._first().text

    @property
    def token_ids(self) -> list[int]:
        return self._first().token_ids

    @property
    def logprobs(self) -> list[pb.TokenLogprob]:
        return self._first().logprobs

    @property
    def finish(self) -> pb.FinishInfo | None:
        return self._first().finish

    @property
    def finish_reason(self) -> str | None:
        return self._first().finish_reason

    @property
    def usage(self) -> pb.Usage | None:
        finish = self._first().finish
        return finish.usage if finish is not None else None

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and all(o.finished for o in self.outputs)


class ResultBuilder:
    """Folds GenerateResponse messages into a GenerateResult."""

    def __init__(self, request_id: str = ""):
        self.result = GenerateResult(request_id=request_id)
        self._by_index: dict[int, Completion] = {}

    def add(self, msg: pb.GenerateResponse) -> Completion:
        res = self.result
        if msg.request_id:
            res.request_id = msg.request_id
        if msg.HasField("prompt") and res.prompt is None:
            res.prompt = msg.prompt
        out = self._by_index.get(msg.index)
        if out is None:
            out = self._by_index[msg.index] = Completion(index=msg.index)
            res.outputs = [self._by_index[i] for i in sorted(self._by_index)]
        out.text += msg.text
        out.token_ids.extend(msg.token_ids)
        out.logprobs.extend(msg.logprobs)
        if msg.HasField("finish"):
            out.finish = msg.finish
        return out
