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


def check_grammar(req: Request, token: int) -> bool:
    """Structured output: advance the grammar by the sampled token; finish "stop" as soon as
    the grammar is complete (no further token possible), without waiting for an EOS."""
    st = req.structured
    if st is None:
        return False
    if not st.accept(token):  # cannot happen under the mask; never emit past a broken grammar
        req.status = RequestStatus.FINISHED_ABORTED
        return True
    if st.terminated:
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
