"""A request's structured-output constraint compiles beside the queue; its stream waits for it.

The compile starts when the request is admitted, on the grammar manager's pool (off the engine
thread); the request waits in the engine core (WAITING_FOR_FSM) meanwhile, and its stream waits
here, so a constraint that does not compile (in time) fails the call before any output.
"""
from __future__ import annotations

import asyncio

from llmsvc.sampling_params import SamplingParams
from llmsvc.structured.errors import COMPILE_TIMEOUT, ConstraintError


def submit_constraint(engine, params: SamplingParams):
    """The compile future of the request's constraint (None: unconstrained, or an engine
    without a grammar manager, whose admission refuses it)."""
    manager = getattr(engine, "structured_output_manager", None)
    if params.structured_outputs is None or manager is None:
        return None
    return manager.submit(params.structured_outputs)


async def wait_compiled(manager, compiled, params: SamplingParams) -> None:
    """Until `compiled` (submit_constraint's future) is done; ConstraintError when the compile
    failed or took longer than the manager's compile_timeout_s."""
    limit = manager.compile_timeout_s
    # the one-time tokenizer view is not the constraint's compile: the limit starts after it
    await asyncio.shield(asyncio.wrap_future(manager.tokenizer_ready()))
    try:  # shield: a timeout here must not cancel the compile shared through the cache
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiled)), limit)
    except asyncio.TimeoutError:
        raise ConstraintError(params.structured_outputs.kind, COMPILE_TIMEOUT,
                              f"did not compile within {limit:g} s") from None
