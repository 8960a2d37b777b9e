"""Verifying draft tokens (speculative decoding, worker side).

A request with drafts d_0..d_{L-1} has L + 1 logits rows: row j is the model's distribution for
the token after d_0..d_{j-1}. Each row is sampled as though decoding one token at a time had
produced the drafts before it: its SamplingMetadata row sees output_token_ids + d[:j], so
penalties, min_tokens, bad words and the per-request seed (keyed by the number of output tokens)
act exactly as they would at that position. The request then emits x_0, x_1, ... up to and
including the first j with x_j != d_j (all L + 1 when every draft matches).

Every emitted x_j is the token sequential decoding samples at that point, so greedy and seeded
requests produce the same tokens with and without drafts, and unseeded ones the same
distribution. For a proposer that puts all its mass on one token (prompt lookup), accepting d_j
iff the model's own draw equals it is the rejection sampler: d_j is accepted with probability
p(d_j), and a rejection emits a draw from p conditioned on not being d_j.
"""
from __future__ import annotations

from llmsvc.wire import SampleLogprobs
from llmsvc.worker.request_state import CachedRequestState


def expand_rows(states: list[CachedRequestState], num_rows: list[int],
                spec_tokens: dict[str, list[int]]) -> tuple[list, list, list, list[str]]:
    """One sampling row per logits row: (params, prompt ids, output ids so far, req_id) lists."""
    params, prompts, outputs, row_req_ids = [], [], [], []
    for st, m in zip(states, num_rows):
        drafts = spec_tokens.get(st.req_id, ())
        prompt, out = st.token_ids[:st.prompt_len], st.output_token_ids
        for j in range(m):
            params.append(st.sampling_params)
            prompts.append(prompt)
            outputs.append(out + list(drafts[:j]) if j else out)
            row_req_ids.append(st.req_id)
    return params, prompts, outputs, row_req_ids


def accept(sampled: list[int], logprobs: list[SampleLogprobs | None], req_ids: list[str],
           num_rows: list[int], spec_tokens: dict[str, list[int]]
           ) -> tuple[list[list[int]], list[list[SampleLogprobs] | None]]:
    """Per request, the tokens it emits and their logprobs (None where the request asked for none),
    from the flat per-row samples."""
    tokens_out: list[list[int]] = []
    lps_out: list[list[SampleLogprobs] | None] = []
    row = 0
    for rid, m in zip(req_ids, num_rows):
        drafts = spec_tokens.get(rid, ())
        emitted = 1
        while emitted < m and sampled[row + emitted - 1] == drafts[emitted - 1]:
            emitted += 1
        tokens_out.append(sampled[row:row + emitted])
        lps = logprobs[row:row + emitted]
        lps_out.append(None if lps[0] is None else lps)
        row += m
    return tokens_out, lps_out
