"""The phase-free scheduler: each step grants tokens to requests under a token budget.

A request only has ``num_tokens`` (prompt + output so far) and ``num_computed_tokens``; a
prefill chunk, a decode step and a recompute after preemption are the same thing: "compute
the next ``n`` tokens". Running requests are served first (in order), then waiting ones
(FCFS or priority). When the cache is full the scheduler preempts (recompute) the running
request that would be scheduled last; the KV manager never decides policy.

The class is assembled from three modules: ``engine/scheduler_requests.py`` (its state and
requests in and out), ``engine/scheduler_planning.py`` (``schedule()`` and preemption) and
``engine/scheduler_update.py`` (``update()``: tokens, stops, drafts, KV commits).
"""

from __future__ import annotations

from rackserve.engine.outputs import SchedulerStats
from rackserve.engine.scheduler_planning import SchedulerPlanning
from rackserve.engine.scheduler_update import SchedulerUpdate

__all__ = ["Scheduler"]


class Scheduler(SchedulerPlanning, SchedulerUpdate):
    """``Scheduler(config, kv_manager, eos_token_ids, offload=None, num_spec_tokens=0)``:
    the constructor is ``SchedulerRequests.__init__``."""

    def stats(self) -> SchedulerStats:
        kv_stats = self.kv.stats
        return SchedulerStats(
            spec_decoding=None if self.spec_stats is None else self.spec_stats.copy(),
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting)
            + len(self.waiting_for_grammar)
            + (self.offload.num_loading if self.offload else 0),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=kv_stats.num_queried_tokens,
            prefix_cache_hits=kv_stats.num_hit_tokens,
            num_preemptions=self.num_preemptions,
        )
