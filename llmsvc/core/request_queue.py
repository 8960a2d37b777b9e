"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival_time, seq))."""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from llmsvc.core.request import Request


class RequestQueue(ABC):
    """Order in which waiting requests are admitted. `peek`/`pop` give the next one."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """A newly arrived request."""

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """A request coming back after preemption: ahead of everything of its rank."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue(RequestQueue):
    """Lower priority value first; ties by arrival time, then by insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq), request))

    def add_preempted(self, request: Request) -> None:
        # its (priority, arrival_time) key already puts it ahead of later arrivals of its rank
        heapq.heappush(self._heap, (request.priority, request.arrival_time, -next(self._seq), request))

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r} (fcfs | priority)")
