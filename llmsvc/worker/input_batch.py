"""Flatten one step's scheduled requests into model inputs (no padding to the longest sequence)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmsvc.models.layers.attention import AttentionMetadata
from llmsvc.worker.request_state import CachedRequestState


@dataclass
class ModelInputs:
    req_ids: list[str]  # batch order
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: rows of the flattened batch whose logits sample
    sampling_req_ids: list[str]  # [S]: request of each sampling row
    # prompt logprobs: req_id -> (first flattened row, number of rows, first target prompt position)
    prompt_logprob_rows: dict[str, tuple[int, int, int]]
    token_lora_slots: np.ndarray | None = None  # [T] adapter slot per token (-1: base); None: no adapter
    # speculative decoding: logits rows of each sampling request (1 + its drafts); None: one each
    num_sample_rows: list[int] | None = None


def build_inputs(states: dict[str, CachedRequestState], num_scheduled: dict[str, int],
                 block_size: int, device: torch.device,
                 spec_tokens: dict[str, list[int]] | None = None) -> ModelInputs:
    """Requests keep the scheduler's order (dict order of num_scheduled_tokens).

    Request r computes tokens [c, c + n) with c = num_computed_tokens, n = num_scheduled[r];
    its attention context afterwards is c + n tokens; it samples iff c + n == len(tokens).
    A request with drafts d (spec_tokens[r], n = 1 + len(d)) computes tokens[c] then d, and
    samples at each of those n positions.
    """
    req_ids = list(num_scheduled)
    n_tok = np.fromiter((num_scheduled[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
    total = int(n_tok.sum())
    qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
    np.cumsum(n_tok, out=qsl[1:])
    input_ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    seq_lens = np.empty(len(req_ids), dtype=np.int64)
    max_blocks = max((len(states[r].block_ids) for r in req_ids), default=1)
    block_tables = np.zeros((len(req_ids), max(max_blocks, 1)), dtype=np.int32)
    logits_rows: list[int] = []
    sampling_req_ids: list[str] = []
    prompt_rows: dict[str, tuple[int, int, int]] = {}
    sample_rows: list[int] | None = [] if spec_tokens else None
    for i, r in enumerate(req_ids):
        st = states[r]
        c, n, s = st.num_computed_tokens, int(n_tok[i]), int(qsl[i])
        drafts = spec_tokens.get(r) if spec_tokens else None
        if drafts:
            assert c + 1 == len(st.token_ids) and n == 1 + len(drafts), (r, c, n, len(st.token_ids))
            input_ids[s] = st.token_ids[c]
            input_ids[s + 1:s + n] = drafts
            positions[s:s + n] = np.arange(c, c + n)
        elif n == 1:
            input_ids[s] = st.token_ids[c]
            positions[s] = c
        else:
            input_ids[s:s + n] = st.token_ids[c:c + n]
            positions[s:s + n] = np.arange(c, c + n)
        seq_lens[i] = c + n
        block_tables[i, :len(st.block_ids)] = st.block_ids
        # logits rows: every position of a request with drafts, else its last one if it samples
        m = n if drafts else int(c + n == len(st.token_ids))
        if m:
            logits_rows.extend(range(s + n - m, s + n))
            sampling_req_ids.append(r)
            if sample_rows is not None:
                sample_rows.append(m)
        # max(.., 1): a one-token prompt still gets its one entry (None), as vLLM's [None]
        if st.sampling_params.prompt_logprobs is not None and c < max(st.prompt_len - 1, 1):
            last = min(c + n, st.prompt_len - 1)  # rows whose next token is still a prompt token
            prompt_rows[r] = (s, last - c, c + 1)
    # slot of each token = block_ids[pos // block_size] * block_size + pos % block_size
    row_of_token = np.repeat(np.arange(len(req_ids)), n_tok)
    slot_mapping = (block_tables[row_of_token, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    lora_ids = np.fromiter((states[r].lora_id for r in req_ids), dtype=np.int64, count=len(req_ids))
    token_lora_slots = np.repeat(lora_ids - 1, n_tok) if lora_ids.any() else None
    as_t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=as_t(slot_mapping),
        block_tables=as_t(block_tables),
        query_start_loc=as_t(qsl.astype(np.int32)),
        seq_lens=as_t(seq_lens.astype(np.int32)),
        max_query_len=int(n_tok.max()) if len(req_ids) else 0,
        max_seq_len=int(seq_lens.max()) if len(req_ids) else 0,
    )
    return ModelInputs(req_ids, as_t(input_ids), as_t(positions), meta,
                       torch.tensor(logits_rows, dtype=torch.int64, device=device),
                       sampling_req_ids, prompt_rows, token_lora_slots, sample_rows)
