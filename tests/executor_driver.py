"""Drive an Executor by hand with SchedulerOutput diffs (no scheduler): greedy, one block table each."""
from __future__ import annotations

from llmsvc.sampling_params import SamplingParams
from llmsvc.wire import CachedRequestData, NewRequestData, SchedulerOutput


def greedy_generate(executor, prompts: list[list[int]], max_new: int, block_size: int = 16,
                    chunk: int | None = None, on_step=None) -> list[list[int]]:
    """Prefill every prompt (in chunks of `chunk` tokens if given), then decode `max_new` tokens.

    Block ids are handed out in reverse order so each table is non-contiguous."""
    num_blocks = sum((len(p) + max_new) // block_size + 1 for p in prompts)
    free = list(range(num_blocks))[::-1]
    ids = [f"r{i}" for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    blocks: list[list[int]] = [[] for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    known = [False] * len(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    unsent: list[list[int]] = [[] for _ in prompts]  # sampled, not yet told to the worker
    step = 0
    while any(len(o) < max_new for o in outs):
        so = SchedulerOutput.make_empty()
        cached = CachedRequestData()
        for i in range(len(prompts)):
            if len(outs[i]) >= max_new:
                continue
            n = len(tokens[i]) - computed[i]
            if chunk:
                n = min(n, chunk)
            need = (computed[i] + n + block_size - 1) // block_size - len(blocks[i])
            new_blocks = [free.pop() for _ in range(max(need, 0))]
            blocks[i] += new_blocks
            if not known[i]:
                so.scheduled_new_reqs.append(NewRequestData(ids[i], list(prompts[i]), [], params,
                                                            list(blocks[i]), computed[i]))
                known[i] = True
            else:
                cached.req_ids.append(ids[i])
                cached.new_token_ids.append(unsent[i])
                unsent[i] = []
                cached.new_block_ids.append(new_blocks)
                cached.num_computed_tokens.append(computed[i])
            so.num_scheduled_tokens[ids[i]] = n
        so.scheduled_cached_reqs = cached
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        out = executor.execute_model(so)
        if on_step:
            on_step(step)
        step += 1
        for i in range(len(prompts)):
            if ids[i] in so.num_scheduled_tokens:
                computed[i] += so.num_scheduled_tokens[ids[i]]
        for req_id, (tok,) in zip(out.req_ids, out.sampled_token_ids):  # no drafts: one token each
            i = ids.index(req_id)
            outs[i].append(tok)
            tokens[i].append(tok)
            unsent[i].append(tok)
    return outs
