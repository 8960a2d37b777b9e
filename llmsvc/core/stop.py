"""What Scheduler.update_from_output applies per request, needing no text (torch-free): the stop
conditions on each sampled token, and the prompt-logprob positions not reported yet.

Stop strings need the detokenized text and are the output processor's. A check that stops a
request sets its finished status (and stop_reason) and returns True; the Scheduler then frees it.
"""
from __future__ import annotations

from llmsvc.core.request import Request, RequestStatus


def check_stop(req: Request, token: int, max_len: int) -> bool:
    """EOS or a stop token (once min_tokens are out), max_tokens, or max_len known tokens.
    Counts only known tokens: under async scheduling the placeholders of later steps are not."""
    params = req.sampling_params
    num_output = req.num_output_tokens - req.num_output_placeholders  # tokens known so far
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token in req.eos_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
            return True
        if token in params.stop_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
            return True
    if params.max_tokens is not None and num_output >= params.max_tokens:
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if req.num_known_tokens >= max_len:
        req.status = RequestStatus.FINISHED_CONTEXT
        return True
    return False


NO_ALLOWED_TOKEN = ("the request's token rules (the output constraint, allowed_token_ids, bad_words, "
                    "min_tokens) left no token to sample")


def no_token_left(req: Request) -> bool:
    """The sampler found nothing allowed in the request's row (ModelRunnerOutput.no_token): the
    request ends "abort" with the reason, and the row's token is not emitted."""
    req.status = RequestStatus.FINISHED_ABORTED
    req.stop_reason = NO_ALLOWED_TOKEN
    return True


def grammar_rejects(req: Request, token: int) -> bool:
    """Structured output: advance the grammar by the sampled token, before it is recorded. The
    mask allowed the token, so a refusal is the grammar engine failing on its own (a lexer past
    its limits on a huge pattern): the request ends "abort" with the engine's message, and the
    token is not emitted."""
    st = req.structured
    if st is None or st.accept(token):
        return False
    req.status = RequestStatus.FINISHED_ABORTED
    err = st.error()
    req.stop_reason = (NO_ALLOWED_TOKEN if "doesn't satisfy the grammar" in err
                       else f"the output constraint failed in the grammar engine: {err}")
    return True


def grammar_complete(req: Request) -> bool:
    """Finish "stop" as soon as the grammar is complete (no further token possible), without
    waiting for an EOS."""
    if req.structured is not None and req.structured.terminated:
        req.status = RequestStatus.FINISHED_STOPPED
        return True
    return False


def fresh_prompt_logprobs(req: Request, entries):
    """The prompt-logprob entries of positions not reported yet. The entries of one step end at
    the last prompt position it computed; after a preemption the prompt is recomputed from 0."""
    if not entries:
        return entries
    last = min(req.num_computed_tokens, req.num_prompt_tokens - 1)  # num_computed_tokens: after this step
    skip = req.num_prompt_logprobs_sent - (last + 1 - len(entries))
    req.num_prompt_logprobs_sent = max(req.num_prompt_logprobs_sent, last + 1)
    return (entries[skip:] or None) if skip > 0 else entries
