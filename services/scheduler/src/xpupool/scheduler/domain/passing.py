"""Placing a new request past the jobs that wait, when it cannot delay any of them.

A job that waits is decided again by the scheduling cycles, in queue order, whenever capacity
frees up. A new request placed on arrival meanwhile must not take what one of them is waiting
for: the cycles' order (priorities, fair share) would no longer be what decides. So while jobs
wait, a new request is placed on arrival only where no waiting job could ever be placed: on
nodes none of them could use, charging no quota with a limit that one of them also charges.

What a waiting job could use is judged per node, conservatively:

- a device request could go to every node with a device of a class its selectors accept (device
  ids narrow that), and a gang on one node only to nodes with as many such devices; it would
  take host CPU and memory there too;
- a request without devices could take host CPU and memory on any node.

The ledger holds the other half of the rule: the judgement is made on the jobs waiting at one
pending sequence (``Ledger.waiting``; every job that starts waiting bumps it), and the admission
script takes the placement past the waiting jobs only while that sequence is still the current
one (``Admission.waiting_seq``): a job that started waiting since, which the judgement did not
see, is never overtaken.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from xpupool.contracts import JobRequested
from xpupool.placement.demand import make_demand
from xpupool.placement.pool import WorkingPool
from xpupool.scheduler.domain.config import ROOT, SchedulerConfig
from xpupool.scheduler.domain.decide import Reserve


@dataclass(frozen=True)
class Contested:
    """What the waiting jobs could use, on one pool: node indices, whether host resources on
    every node (a request without devices waits), and the limited queues they charge."""

    nodes: frozenset[int]
    host_anywhere: bool
    queues: frozenset[str]

    def joined(self, other: Contested) -> Contested:
        return Contested(
            self.nodes | other.nodes,
            self.host_anywhere or other.host_anywhere,
            self.queues | other.queues,
        )


def contested_by(
    requests: Iterable[JobRequested], pool: WorkingPool, config: SchedulerConfig
) -> Contested:
    """Everything these waiting requests could use on ``pool`` (see the module docstring)."""
    nodes: set[int] = set()
    host_anywhere = False
    queues: set[str] = set()
    for request in requests:
        # A queue it may not use (it will be rejected) leaves only the root to contest.
        leaf = config.resolve_queue(request.tenant or "", request.queue)
        for name in config.path(leaf) if leaf is not None else config.path(ROOT):
            queue = config.queue(name)
            if queue is not None and (queue.limit_units is not None or queue.limit_devices):
                queues.add(name)
        if not request.count:
            host_anywhere = True
            continue
        demand = make_demand(request, pool)
        per_node: dict[int, int] = {}
        for ci in demand.classes:
            for ni, devices in pool.class_nodes[ci].items():
                usable = (
                    len(devices)
                    if demand.allowed is None
                    else sum(i in demand.allowed for i in devices)
                )
                per_node[ni] = per_node.get(ni, 0) + usable
        # One node must hold a gang on one node (and any request of one device) whole.
        least = demand.count if demand.scope == "node" else 1
        nodes.update(ni for ni, usable in per_node.items() if usable >= least)
    return Contested(frozenset(nodes), host_anywhere, frozenset(queues))


def takes_nothing_contested(
    reserve: Reserve, pool: WorkingPool, contested: Contested, config: SchedulerConfig
) -> bool:
    """Whether ``reserve`` leaves alone everything the waiting jobs could use."""
    for s in reserve.slices:
        i = pool.dev_index.get(s.device_id)
        if i is None or pool.dev_node[i] in contested.nodes:
            return False
    for charge in reserve.host:
        if not (charge.cpu_milli or charge.memory_mib):
            continue
        ni = pool.node_index.get(charge.node_id)
        if contested.host_anywhere or ni is None or ni in contested.nodes:
            return False
    return not any(name in contested.queues for name in config.path(reserve.queue))


@dataclass
class WaitingJudgement:
    """The jobs waiting at pending sequence ``seq`` as a cycle read them (every one of them:
    a cycle that read only part of the queue makes none), for ``config``; extended by each job
    this replica saw start waiting right after (``extended``)."""

    seq: int
    config: SchedulerConfig
    requests: Sequence[JobRequested]
    _contested: tuple[WorkingPool, Contested] | None = field(default=None, repr=False)

    def contested(self, pool: WorkingPool) -> Contested:
        """What the waiting jobs could use on ``pool`` (kept while the pool is the same: its
        nodes and their devices' classes are fixed for its life)."""
        kept = self._contested
        if kept is not None and kept[0] is pool:
            return kept[1]
        found = contested_by(self.requests, pool, self.config)
        self._contested = (pool, found)
        return found

    def may_pass(self, reserve: Reserve, pool: WorkingPool, config: SchedulerConfig) -> bool:
        """Whether ``reserve``, decided on ``pool`` with ``config``, may be placed past the
        waiting jobs (the ledger still checks that none started waiting since ``seq``)."""
        return config is self.config and takes_nothing_contested(
            reserve, pool, self.contested(pool), config
        )

    def extended(self, request: JobRequested, seq: int) -> WaitingJudgement | None:
        """The judgement with ``request`` waiting too, its wait having bumped the pending
        sequence to ``seq``; None when another job started waiting in between (one this
        replica does not know: only a cycle's read of the queue judges anew)."""
        if seq != self.seq + 1:
            return None
        judged = WaitingJudgement(seq, self.config, [*self.requests, request])
        kept = self._contested
        if kept is not None:
            pool, found = kept
            judged._contested = (pool, found.joined(contested_by([request], pool, self.config)))
        return judged


__all__ = ["Contested", "WaitingJudgement", "contested_by", "takes_nothing_contested"]
