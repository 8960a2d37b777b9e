"""Requests waiting for their structured-output grammar to compile (torch-free).

A request with a constraint is admitted at once (RequestStatus.WAITING_FOR_FSM) while its grammar
compiles on the StructuredOutputManager's threads; the Scheduler queues it once the compile is
done, so a slow compile never holds up the requests behind it.
"""
from __future__ import annotations

import time

from llmsvc.core.request import RequestStatus
from llmsvc.structured.errors import ConstraintError


class GrammarWaitMixin:
    """The Scheduler's methods for WAITING_FOR_FSM requests; they own no state. They use the
    Scheduler's waiting_for_fsm, waiting, _grammar_failed and _free."""

    def _promote_ready_grammars(self) -> None:
        """Queue the WAITING_FOR_FSM requests whose grammar has compiled (in arrival order);
        finish those whose compile failed or ran out of time (aborted: the front end reports
        the ConstraintError itself; nothing was allocated)."""
        now = time.monotonic()
        still = []
        for req in self.waiting_for_fsm:
            try:
                ready = req.structured.poll(now)
            except ConstraintError as e:  # the front end reports its own; this reaches offline callers
                req.status = RequestStatus.FINISHED_ABORTED
                req.stop_reason = f"the {e.kind} constraint {e.message}"
                self._free(req)
                self._grammar_failed.append(req)
                continue
            if ready:
                req.status = RequestStatus.WAITING
                self.waiting.add(req)
            else:
                still.append(req)
        self.waiting_for_fsm = still

    def compiling_grammars(self) -> list:
        """Futures of the compiles that WAITING_FOR_FSM requests wait for."""
        return [r.structured.future for r in self.waiting_for_fsm]
