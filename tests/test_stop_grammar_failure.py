"""How a request ends when its grammar refuses a sampled token (llmsvc.core.stop): a refusal of
a token the mask allowed is the grammar engine failing, and the abort reason carries the
engine's own message; a plain "doesn't satisfy the grammar" keeps the no-token reason."""
from __future__ import annotations

import pytest

from llmsvc.core.request import Request, RequestStatus
from llmsvc.core.stop import NO_ALLOWED_TOKEN, grammar_rejects
from llmsvc.sampling_params import SamplingParams


class RefusingGrammar:
    def __init__(self, message: str) -> None:
        self.message = message

    def accept(self, token: int) -> bool:
        return False

    def error(self) -> str:
        return self.message


@pytest.mark.parametrize("message,reason", [
    ("lexer error: too many expressions constructed",
     "the output constraint failed in the grammar engine: lexer error: too many expressions constructed"),
    ('Parser Error: token "b" doesn\'t satisfy the grammar', NO_ALLOWED_TOKEN),
])
def test_a_refused_token_ends_the_request_with_the_reason(message, reason):
    req = Request("r", [1, 2], SamplingParams(max_tokens=4))
    req.structured = RefusingGrammar(message)
    assert grammar_rejects(req, 7)
    assert (req.status, req.stop_reason) == (RequestStatus.FINISHED_ABORTED, reason)


def test_a_request_without_a_grammar_is_never_refused():
    req = Request("r", [1, 2], SamplingParams(max_tokens=4))
    assert not grammar_rejects(req, 7) and req.status == RequestStatus.WAITING
