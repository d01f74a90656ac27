"""The scheduler's waiting queue: FCFS or priority order, as vLLM's request_queue."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from rackserve.request import Request


class WaitingQueue:
    """FCFS (a deque) or priority order (a heap on (priority, arrival, seq))."""

    def __init__(self, policy: str) -> None:
        self.priority = policy == "priority"
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap) if self.priority else len(self._fifo)

    def __iter__(self):
        return (e[-1] for e in self._heap) if self.priority else iter(self._fifo)

    def add(self, req: Request, front: bool = False) -> None:
        if self.priority:
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))
        elif front:  # a preempted request resumes before newer arrivals
            self._fifo.appendleft(req)
        else:
            self._fifo.append(req)

    def peek(self) -> Request:
        return self._heap[0][-1] if self.priority else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1] if self.priority else self._fifo.popleft()

    def remove(self, ids: set[str]) -> None:
        """O(n); only on abort."""
        if self.priority:
            self._heap = [e for e in self._heap if e[-1].request_id not in ids]
            heapq.heapify(self._heap)
        else:
            self._fifo = deque(r for r in self._fifo if r.request_id not in ids)
