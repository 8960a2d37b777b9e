"""Single engine steps without a scheduler: a CPU ModelRunner fed hand-made scheduler outputs.

For timing one step at a time (`llmsvc bench --ceiling`, benchmarks/step_profile.py): a
decode step of `seqs` greedy requests at `context` keys each, or a prefill step of whole
128-token prompts. The K/V blocks hold whatever they hold (the bytes a step reads, not their
values, set its time); a sequence's blocks are scattered over the cache as after a while of
serving. Generators yield one SchedulerOutput per timed step and take the step's
ModelRunnerOutput back through `send` (`run_steps` does both).
"""
from __future__ import annotations

import random
import time
from typing import Callable, Generator, Optional

PREFILL_PROMPT = 128  # tokens per request of a prefill step (W1's prompt length)
BLOCK_SIZE = 16

Steps = Generator  # yields SchedulerOutput, is sent the step's ModelRunnerOutput


def make_cpu_runner(dtype: str, num_blocks: int, model: Optional[str] = None, quantization: str = "none"):
    """A ModelRunner of `model` (None: the default) on the CPU with `num_blocks` KV blocks,
    warmed up, with the worker's malloc settings."""
    import torch

    from llmsvc.config import EngineConfig
    from llmsvc.models.resolve import resolve_model_config
    from llmsvc.worker import host_malloc
    from llmsvc.worker.model_runner import ModelRunner

    config = EngineConfig.from_options(model=model, dtype=dtype, device="cpu", block_size=BLOCK_SIZE,
                                       quantization=quantization)
    config.model_config = resolve_model_config(config.model_config)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    host_malloc.keep_activations_mapped()  # as the worker does once its caches are in place
    runner.warmup()
    return runner


def decode_blocks(seqs: int, context: int, steps: int) -> int:
    """KV blocks `decode_steps` needs."""
    return seqs * -(-(context + steps + 2) // BLOCK_SIZE)


def _vocab(runner) -> int:
    """Token ids to draw prompts from: ordinary ones of the default model's vocabulary."""
    return min(30000, runner.config.model_config.hf_config.vocab_size)


def _new_request(req_id: str, prompt: list[int], blocks: list[int], num_computed: int):
    from llmsvc.sampling_params import SamplingParams
    from llmsvc.wire import NewRequestData

    return NewRequestData(req_id, prompt, [], SamplingParams(temperature=0.0, max_tokens=1 << 20),
                          blocks, num_computed)


def decode_steps(runner, seqs: int, context: int, steps: int, seed: int = 0) -> Steps:
    """`steps` decode steps of `seqs` requests whose contexts start at `context` keys (one
    untimed step first registers the requests)."""
    from llmsvc.wire import CachedRequestData, SchedulerOutput

    rng, vocab = random.Random(seed), _vocab(runner)
    per_seq = decode_blocks(1, context, steps)
    blocks = list(range(seqs * per_seq))
    rng.shuffle(blocks)
    so = SchedulerOutput.make_empty()
    for i in range(seqs):
        prompt = [rng.randrange(3, vocab) for _ in range(context)]
        so.scheduled_new_reqs.append(_new_request(f"d{i}", prompt, blocks[i * per_seq:(i + 1) * per_seq],
                                                  context - 1))
        so.num_scheduled_tokens[f"d{i}"] = 1
    so.total_num_scheduled_tokens = seqs
    out = runner.execute_model(so)
    for computed in range(context, context + steps):
        so = SchedulerOutput.make_empty()
        so.scheduled_cached_reqs = CachedRequestData(
            list(out.req_ids), [list(t) for t in out.sampled_token_ids], [[] for _ in out.req_ids],
            [computed] * len(out.req_ids))
        so.num_scheduled_tokens = {r: 1 for r in out.req_ids}
        so.total_num_scheduled_tokens = len(out.req_ids)
        out = yield so


def prefill_steps(runner, tokens: int, steps: int, seed: int = 0, prompt_len: int = PREFILL_PROMPT) -> Steps:
    """`steps` prefill steps of tokens // prompt_len fresh prompt_len-token prompts each (the
    previous step's requests finished)."""
    from llmsvc.wire import SchedulerOutput

    rng, vocab = random.Random(seed), _vocab(runner)
    n, per_seq = max(1, tokens // prompt_len), -(-prompt_len // BLOCK_SIZE)
    prev: set[str] = set()
    for step in range(steps):
        so = SchedulerOutput.make_empty()
        so.finished_req_ids = prev
        for i in range(n):
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            so.scheduled_new_reqs.append(_new_request(f"p{step}.{i}", prompt,
                                                      list(range(i * per_seq, (i + 1) * per_seq)), 0))
            so.num_scheduled_tokens[f"p{step}.{i}"] = prompt_len
        so.total_num_scheduled_tokens = n * prompt_len
        prev = set(so.num_scheduled_tokens)
        yield so


def run_steps(runner, steps: Steps, around: Optional[Callable[[], Callable[[], None]]] = None) -> list[float]:
    """Runs every step of `steps`; returns each step's wall seconds. around(), if given, is
    called before each step and returns what to call after it."""
    seconds = []
    so = next(steps, None)
    while so is not None:
        after = around() if around else None
        t0 = time.perf_counter()
        out = runner.execute_model(so)
        seconds.append(time.perf_counter() - t0)
        if after:
            after()
        try:
            so = steps.send(out)
        except StopIteration:
            so = None
    return seconds
