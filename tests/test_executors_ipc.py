"""IPC stays small: a decode step's pickled SchedulerOutput grows with the batch, not the prompts
(measured with the executor benchmark's own TimedExecutor over the real engine + FakeExecutor)."""
from __future__ import annotations

import pickle
import random

import pytest

from llmsvc.bench.executors import TimedExecutor
from llmsvc.engine.llm_engine import LLMEngine
from llmsvc.sampling_params import SamplingParams
from tests.engine_fakes import FakeExecutor, make_config
from tests.server_harness import letters, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def decode_bytes(tok, batch: int, prompt_len: int, max_new: int = 6) -> TimedExecutor:
    cfg = make_config(num_blocks=2048, block_size=4, max_num_batched_tokens=4096, max_num_seqs=batch,
                      max_model_len=4096)
    timed = TimedExecutor(FakeExecutor(cfg, num_blocks=2048, token_fn=letters))
    engine = LLMEngine(cfg, timed, tok)
    rng = random.Random(prompt_len)
    for i in range(batch):
        engine.add_request(f"req-{i}", [rng.randrange(3, 250) for _ in range(prompt_len)],
                           SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert timed.decode_steps >= max_new - 2 and timed.decode_reqs / timed.decode_steps == pytest.approx(batch, abs=1)
    return timed


def test_decode_step_ipc_is_independent_of_prompt_length(tok):
    short, long_ = decode_bytes(tok, 4, 8), decode_bytes(tok, 4, 1500)
    prompt_bytes = len(pickle.dumps(list(range(3, 250)) * 6))  # ~1500 token ids
    per_step_short = short.decode_bytes / short.decode_steps
    per_step_long = long_.decode_bytes / long_.decode_steps
    assert abs(per_step_long - per_step_short) <= 8 * 4, (per_step_short, per_step_long)
    assert per_step_long < prompt_bytes / 4  # nowhere near resending a prompt
    # prefill steps do carry the prompts: each exactly once
    assert long_.bytes_all - long_.decode_bytes > 4 * prompt_bytes * 0.9


def test_decode_step_ipc_grows_with_the_batch(tok):
    per_step = [t.decode_bytes / t.decode_steps for t in (decode_bytes(tok, b, 16) for b in (2, 8, 32))]
    assert per_step[0] < per_step[1] < per_step[2]
    per_req = [(b - a) / n for a, b, n in ((per_step[0], per_step[1], 6), (per_step[1], per_step[2], 24))]
    assert max(per_req) < 3 * min(per_req), per_step  # roughly linear in the batch


def test_executor_benchmark_compares_executors_on_a_tiny_model(tmp_path, tok):
    import json

    from llmsvc.__main__ import main as llmsvc_main
    from tests.model_utils import make_tiny_model_dir
    from tests.server_harness import EOS, IM_START, TINY_VOCAB

    d = make_tiny_model_dir(tmp_path, vocab_size=TINY_VOCAB, eos_token_id=EOS, bos_token_id=IM_START, pad_token_id=0)
    tok.save_pretrained(d)
    out = tmp_path / "bench.json"
    assert llmsvc_main(["bench", d, "--executors", "uniproc,multiproc", "--num-requests", "3",
                        "--output-len", "5", "--kv-cache-memory", "4MiB", "--json", str(out)]) == 0
    rows = {r["executor"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["uniproc", "multiproc"]
    for r in rows.values():
        assert r["output_tok_s"] > 0 and r["failed"] == 0
        assert r["steps"] == rows["uniproc"]["steps"]  # same schedule whatever runs the model
        assert r["bytes_per_step"] == rows["uniproc"]["bytes_per_step"]
        assert 0 < r["worker_time_s"] <= r["executor_time_s"]
