"""The control loop: one decision cycle every ``interval_s`` on the replica that holds the lease.

A cycle (:meth:`Autoscaler.cycle`), on the ledger's clock:

1. **Observe.** The pool file (reloaded when it changed), the ledger's nodes, live leases and
   pending requests (with the reason each waits), every pool's nodes as its provider lists
   them, and the autoscaler's journal and node records (:mod:`xpupool.autoscaler.state`).
   A node belongs to a pool when the pool's provider lists it or the autoscaler asked the
   provider for it (the simulated provider names them ``<node_prefix or pool>-<n>``; the exec
   and Kubernetes providers name them in their answers or listings). Static nodes of the fleet
   belong to no pool and are never drained. A pool node is **ready** once it is registered in
   the ledger (its collector's first registration and heartbeat): only then does ``NodeReady``
   go out, and only then can the scheduler place anything on its devices. Before that it is
   **provisioning**; with a drain recorded it is **draining**; registered but not ``up``,
   failed at its provider, or not registered by its scale-up's deadline (below), it is
   **lost**: no longer incoming capacity nor part of the size, and, unless it was registered
   and is only unreachable, given back to its provider once it holds no lease (``remove``
   before any scale-up of the cycle, so its replacement finds room under ``max_size``).
2. **Resume.** On a new term (this replica just took the lease) every journal entry is replayed
   with its own decision id, which is the provider request id: providers answer a request they
   have carried out from their record, so a scale-up the previous leader was killed in the
   middle of is completed, never doubled. Entries that failed are retried (same id) until
   ``autoscaler_max_attempts``. A scale-up leaves the journal when all its nodes are ready, or
   fails after 3 x the pool's provisioning delay plus ``autoscaler_provisioning_grace_s``.
3. **Plan.** ``min_size`` first; then the pending requests that capacity would serve
   (:func:`~xpupool.autoscaler.solver.split_actionable`) go to the solver with every pool's
   room and the incoming nodes (being provisioned, planned for ``min_size``, or ready for less
   than ``autoscaler_settle_s`` and still empty); its answer becomes scale-up steps. Then
   per pool :func:`~xpupool.autoscaler.scale_down.plan_scale_down` (an undrain replaces as many
   new nodes of that pool) and, for predictive pools, the forecast of devices in use plus
   pending at the provisioning horizon (:mod:`xpupool.autoscaler.forecast`).
4. **Act.** Each step is written to the journal (fenced by the term) before anything is done,
   its ``ScaleDecision`` published (JetStream, ``Nats-Msg-Id`` from the decision id), then
   carried out: ``add`` at the provider (then ``NodeProvisioning``), a drain recorded and
   handed to the :class:`~xpupool.autoscaler.drain.NodeDrainer` (``NodeDraining``), leases
   preempted with the pool's grace (``EndLease`` to the lease-manager), drained nodes removed at the
   provider once their leases are re-read as gone (``NodeRemoved``). A failed provider call is a
   ``ScaleFailed`` event and is retried next cycle with the same request id.
5. **Report.** The status snapshot (``xpupool scale status``) and the metrics.

A node is idle from the moment it holds no lease (a reservation counts as one).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final, TypeVar

import msgspec

from xpupool.autoscaler.decisions import (
    ScalePlan,
    ScaleStep,
    forecast_nodes,
    plan_min_size,
    plan_predictive,
)
from xpupool.autoscaler.drain import NodeDrainer
from xpupool.autoscaler.forecast import forecast
from xpupool.autoscaler.metrics import AutoscalerMetrics
from xpupool.autoscaler.pools import PoolConfig, PoolSource, ProviderConfig
from xpupool.autoscaler.providers import NodeLifecycle, ProvidedNode, Provider, ProviderError
from xpupool.autoscaler.scale_down import NodeStatus, PoolLoad, peak_busy, plan_scale_down
from xpupool.autoscaler.settings import AutoscalerSettings
from xpupool.autoscaler.solver import (
    NodeState,
    PendingJob,
    PoolNode,
    ScaleUpAnswer,
    ScaleUpProblem,
    ScaleUpSolver,
    job_devices,
    pool_shape,
    split_actionable,
    steps_from_answer,
)
from xpupool.autoscaler.state import (
    INCOMING,
    SHAPES,
    STATUS,
    AutoscalerState,
    JournalEntry,
    LostLeadership,
    PoolNodeRecord,
)
from xpupool.autoscaler.status import (
    IncomingRequest,
    NodeView,
    PendingView,
    PoolStatus,
    ScaleStatus,
)
from xpupool.contracts import (
    EndLease,
    EndReason,
    JobReason,
    JobRequested,
    NodeDraining,
    NodeProvisioning,
    NodeReady,
    NodeRemoved,
    ScaleAction,
    ScaleDecision,
    ScaleFailed,
    ScaleReason,
)
from xpupool.devices.catalog import load_catalog
from xpupool.ledger import LeaseRecord, Ledger
from xpupool.ledger.ledger import INCOMING_OVERDUE_S
from xpupool.obs import get_logger

__all__ = ["Autoscaler", "AutoscalerDeps", "ProviderFactory"]

# Busy-node history buckets: a fifth of the pool's cool-down, between 1 and 10 seconds.
MAX_BUSY_BUCKET_S: Final = 10.0
RECENT_DECISIONS: Final = 20
MIN_CYCLE_GAP_S: Final = 0.2
_REQUEST: Final = msgspec.json.Decoder(JobRequested)

T = TypeVar("T")
ProviderFactory = Callable[[ProviderConfig], Provider]
Publish = Callable[[msgspec.Struct], Awaitable[None]]


@dataclass
class AutoscalerDeps:
    """What the control loop works with."""

    ledger: Ledger
    state: AutoscalerState
    pools: PoolSource
    solver: ScaleUpSolver
    settings: AutoscalerSettings
    drainer: NodeDrainer
    metrics: AutoscalerMetrics
    make_provider: ProviderFactory
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _PoolView:
    """One pool during a cycle."""

    pool: PoolConfig
    ready: list[str] = field(default_factory=list)
    provisioning: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    #: lost nodes to give back to the provider: never registered by their deadline, or failed
    #: at the provider, and holding no lease
    dead: list[str] = field(default_factory=list)
    unnamed_incoming: int = 0
    provider_error: str = ""

    @property
    def provisioning_count(self) -> int:
        return len(self.provisioning) + self.unnamed_incoming

    @property
    def size(self) -> int:
        """Ready or being provisioned, not draining (the size decisions speak of)."""
        return len(self.ready) + self.provisioning_count


class Autoscaler:
    """One replica's control loop (see the module docstring)."""

    def __init__(self, deps: AutoscalerDeps, publish: Publish | None = None) -> None:
        self.deps = deps
        self.publish: Publish = publish or _nowhere
        self.term: int | None = None
        self._resumed_term: int | None = None
        self._cycle = 0
        self._providers: dict[str, tuple[ProviderConfig, Provider]] = {}
        self._recent: deque[ScaleDecision] = deque(maxlen=RECENT_DECISIONS)
        self._reload_error: str | None = None
        self._log = get_logger()
        self._catalog = load_catalog()

    # ---- the loops --------------------------------------------------------------------------

    async def keep_lease(self, stop: asyncio.Event) -> None:
        """Take or renew the leader lease every third of its TTL; ``self.term`` is the term
        this replica acts under, or None."""
        ttl_s = self.deps.settings.autoscaler_leader_ttl_s
        while not stop.is_set():
            await self.renew_lease()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=ttl_s / 3)
        await self.resign()

    async def renew_lease(self) -> int | None:
        ttl_ms = int(self.deps.settings.autoscaler_leader_ttl_s * 1000)
        try:
            term = await self.deps.state.hold(ttl_ms)
        except Exception as error:  # noqa: BLE001  (Redis away: stop acting until it is back)
            self._log.warning("leader_lease_failed", error=repr(error))
            term = None
        if term != self.term:
            self._log.info("leadership", acting=term is not None, term=term)
            if term is not None:
                self.deps.wake.set()
        self.term = term
        return term

    async def resign(self) -> None:
        """Give the lease back (clean shutdown)."""
        if self.term is None:
            return
        self.term = None
        with contextlib.suppress(Exception):
            await self.deps.state.resign()

    async def run(self, stop: asyncio.Event) -> None:
        """Decide every ``interval_s``, and soon after a node registers or is lost."""
        interval = self.deps.settings.autoscaler_interval_s
        wake = self.deps.wake
        while not stop.is_set():
            started = time.monotonic()
            term = self.term
            if term is None:
                self.deps.metrics.follower()
            else:
                try:
                    with self.deps.metrics.cycle_seconds.time():
                        await self.cycle(term)
                except LostLeadership as error:
                    self._log.warning("leadership_lost", error=str(error))
                    self.term = None
                except Exception as error:  # noqa: BLE001  (Redis, NATS or a provider away)
                    self._log.warning("autoscale_cycle_failed", error=repr(error))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_first(stop, wake), timeout=interval)
            wake.clear()
            gap = MIN_CYCLE_GAP_S - (time.monotonic() - started)
            if gap > 0 and not stop.is_set():
                await asyncio.sleep(gap)

    # ---- one cycle --------------------------------------------------------------------------

    def provider(self, pool: PoolConfig) -> Provider:
        """The pool's provider, rebuilt when its configuration changes."""
        cached = self._providers.get(pool.name)
        if cached is None or cached[0] != pool.provider:
            cached = (pool.provider, self.deps.make_provider(pool.provider))
            self._providers[pool.name] = cached
        return cached[1]

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(
                call, timeout=self.deps.settings.autoscaler_provider_timeout_s
            )
        except TimeoutError as error:
            raise ProviderError(
                f"no answer within {self.deps.settings.autoscaler_provider_timeout_s:g} s"
            ) from error

    async def cycle(self, term: int) -> ScaleStatus:
        """One decision cycle under ``term`` (see the module docstring); returns its status."""
        deps, state, ledger, settings = (
            self.deps,
            self.deps.state,
            self.deps.ledger,
            self.deps.settings,
        )
        self._cycle += 1
        outcome = deps.pools.reload()
        if outcome.error != self._reload_error:
            if outcome.error:
                self._log.warning("pools_refused", error=outcome.error)
            self._reload_error = outcome.error
        if outcome.changed:
            self._log.info("pools_reloaded", pools=list(outcome.config.names))
        config = outcome.config
        pools = {p.name: p for p in config.pools}

        now = await ledger.now_ms() / 1000
        ledger_nodes = {n.node_id: n for n in await ledger.nodes()}
        leases = await ledger.leases()
        pending_raw = await ledger.pending_jobs(settings.autoscaler_pending_limit)
        journal = await state.journal()
        records = await state.nodes()
        listed: dict[str, tuple[ProvidedNode, ...] | None] = {}
        views = {name: _PoolView(pool) for name, pool in pools.items()}
        for name, pool in pools.items():
            try:
                listed[name] = await self._call(self.provider(pool).list(pool))
            except ProviderError as error:
                listed[name] = None
                views[name].provider_error = str(error)[:300]

        # -- resume: replay the journal (new term: all of it; else what has not been applied)
        new_term = self._resumed_term != term
        if new_term:
            self._log.info("resuming", term=term, journal=len(journal))
        for entry in sorted(journal.values(), key=lambda e: e.started_at):
            if new_term or not entry.applied:
                await self._apply(term, entry, pools, records, now)
        self._resumed_term = term
        journal = await state.journal()

        # -- observe: membership, readiness, idleness
        by_node = _leases_by_node(leases)
        ops: list[list[str | int | float]] = []
        events: list[msgspec.Struct] = []
        provided_state: dict[str, NodeLifecycle] = {}
        for name, nodes in listed.items():
            for provided in nodes or ():
                provided_state[provided.node_id] = provided.state
                # One the provider is removing is not a new member: after a remove it stays
                # listed while it is deleted (a Machine ``Deleting``), its collector still up;
                # taken in again it would be announced ready, sized and drained once more.
                if provided.node_id not in records and provided.state is not NodeLifecycle.REMOVING:
                    record = PoolNodeRecord(
                        node_id=provided.node_id,
                        pool=name,
                        request_id=provided.request_id,
                        requested_at=now,
                    )
                    records[provided.node_id] = record
                    ops.append(state.op_node(record))
        named_by_journal = {
            n
            for e in journal.values()
            if e.decision.action is ScaleAction.SCALE_UP
            for n in e.node_ids
        }
        for node_id, record in list(records.items()):
            if record.pool not in pools:
                continue
            registered = ledger_nodes.get(node_id)
            up = registered is not None and registered.status == "up"
            still_listed = listed.get(record.pool) is None or node_id in provided_state
            if not still_listed and not up and node_id not in named_by_journal:
                records.pop(node_id)
                ops.append(state.op_drop_node(node_id))
                continue
            changed = False
            if up and record.ready_at is None:
                record.ready_at = now
                changed = True
                events.append(
                    NodeReady(
                        pool=record.pool,
                        node_id=node_id,
                        request_id=record.request_id,
                        provisioned_s=(
                            round(now - record.requested_at, 3)
                            if record.requested_at is not None
                            else None
                        ),
                        at=_dt(now),
                    )
                )
            busy = bool(by_node.get(node_id))
            if up and not busy and record.idle_since is None:
                record.idle_since = now
                changed = True
            elif busy and record.idle_since is not None:
                record.idle_since = None
                changed = True
            if changed:
                ops.append(state.op_node(record))
            view = views[record.pool]
            failed = provided_state.get(node_id) is NodeLifecycle.FAILED
            # A node that has not registered by its scale-up's deadline will not: counted as
            # incoming it would answer the pending demand for ever (no replacement is ever
            # bought) and hold a slot of max_size, so it is lost and given back.
            overdue = (
                registered is None
                and record.requested_at is not None
                and now - record.requested_at > _provisioning_timeout(view.pool, settings)
            )
            if record.draining_since is not None:
                view.draining.append(node_id)
            elif up:
                view.ready.append(node_id)
            elif registered is not None or failed or overdue:
                view.lost.append(node_id)
                if (failed or overdue) and not by_node.get(node_id):
                    view.dead.append(node_id)
            else:
                view.provisioning.append(node_id)
        await state.write(term, ops)
        for event in events:
            await self.publish(event)

        # -- scale-ups in flight: done when all their nodes are ready, failed after the timeout
        ready_nodes = {n for v in views.values() for n in (*v.ready, *v.draining)}
        incoming_by_request: dict[str, tuple[JournalEntry, int]] = {}
        for entry in list(journal.values()):
            if entry.decision.action is not ScaleAction.SCALE_UP:
                continue
            rid = entry.request_id
            named = set(entry.node_ids) | {
                r.node_id for r in records.values() if r.request_id == rid
            }
            ready = len(named & ready_nodes)
            entry_pool = pools.get(entry.decision.pool)
            if ready >= entry.decision.count or entry_pool is None:
                await state.write(term, [state.op_drop_entry(entry.decision_id)])
                journal.pop(entry.decision_id)
                continue
            timeout = _provisioning_timeout(entry_pool, settings)
            if now - entry.started_at > timeout:
                late = f"{entry.decision.count - ready} of {entry.decision.count} nodes not "
                late += f"ready after {now - entry.started_at:.0f} s"
                await self._fail(term, entry, late, give_up=True)
                journal.pop(entry.decision_id)
                continue
            incoming_by_request[rid] = (entry, ready)
            view = views[entry.decision.pool]
            # Its named, unready nodes are in view.provisioning; count the rest as unnamed.
            unready_named = len(named - ready_nodes)
            view.unnamed_incoming += max(0, entry.decision.count - ready - unready_named)

        # -- pending demand
        jobs: list[PendingJob] = []
        for body, record_ in pending_raw:
            try:
                request = _REQUEST.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            try:
                reason = JobReason(record_.reason)
            except ValueError:
                reason = JobReason.QUEUED
            jobs.append(
                PendingJob(
                    request=request,
                    tenant=request.tenant or "",
                    reason=reason,
                    since=(record_.since_ms or 0) / 1000,
                    queue=request.queue,
                )
            )
        actionable, ignored = split_actionable(jobs)

        # -- plan
        sizes = {name: v.size for name, v in views.items()}
        min_steps = plan_min_size(config.pools, sizes)
        min_adds = {s.pool: s.count for s in min_steps}
        problem_nodes: list[PoolNode] = []
        for name, view in views.items():
            for node_id in view.ready:
                record = records[node_id]
                settling = (
                    record.ready_at is not None
                    and now - record.ready_at < settings.autoscaler_settle_s
                    and not by_node.get(node_id)
                )
                problem_nodes.append(
                    PoolNode(
                        pool=name,
                        state=NodeState.PROVISIONING if settling else NodeState.READY,
                        node_id=node_id,
                        request_id=record.request_id,
                    )
                )
            for node_id in view.provisioning:
                problem_nodes.append(
                    PoolNode(
                        pool=name,
                        state=NodeState.PROVISIONING,
                        node_id=node_id,
                        request_id=records[node_id].request_id,
                    )
                )
            for _ in range(view.unnamed_incoming + min_adds.get(name, 0)):
                problem_nodes.append(PoolNode(pool=name, state=NodeState.PROVISIONING))
            for node_id in view.draining:
                problem_nodes.append(PoolNode(pool=name, state=NodeState.DRAINING, node_id=node_id))
        room = {
            name: max(0, v.pool.max_size - v.size - min_adds.get(name, 0))
            for name, v in views.items()
        }
        problem = ScaleUpProblem(
            pending=actionable, pools=config.pools, room=room, nodes=problem_nodes
        )
        answer = ScaleUpAnswer()
        if actionable and config.pools:
            try:
                answer = deps.solver.solve(problem)
            except Exception as error:  # noqa: BLE001  (a solver bug must not stop scale-down)
                self._log.error("solver_failed", error=repr(error))
        up_steps = list(steps_from_answer(problem, answer))
        jobs_by_id = {j.job_id: j for j in actionable}
        pool_jobs: dict[str, list[str]] = {name: [] for name in pools}
        for addition in answer.additions:
            pool_jobs.setdefault(addition.pool, []).extend(addition.job_ids)
        for job_id, pool_name in answer.served_by_incoming.items():
            pool_jobs.setdefault(pool_name, []).append(job_id)

        in_journal = {
            n
            for e in journal.values()
            if e.decision.action is not ScaleAction.SCALE_UP
            for n in e.decision.node_ids
        }
        down_steps: list[ScaleStep] = []
        dead_steps: list[ScaleStep] = []
        history_ops: list[list[str | int | float]] = []
        forecasts: dict[str, float] = {}
        predictive_steps: list[ScaleStep] = []
        for name, view in views.items():
            pool = view.pool
            members = [*view.ready, *view.draining]
            # Demand history: devices in use on the pool plus the pending devices it answers.
            used = sum(
                1
                for n in members
                if n in ledger_nodes
                for d in ledger_nodes[n].devices
                if d.holders > 0
            )
            wanted = sum(job_devices(jobs_by_id[j].request) for j in pool_jobs.get(name, ()))
            demand_key = f"demand:{name}"
            demand_bucket = (
                math.floor(now / settings.autoscaler_bucket_s) * settings.autoscaler_bucket_s
            )
            history_ops.append(["HMAX", demand_key, f"{demand_bucket:.0f}", used + wanted])
            if pool.predictive.enabled:
                samples = await state.series(demand_key)
                lookback = min(pool.predictive.lookback_s, settings.autoscaler_history_s)
                history_ops.extend(
                    ["HDEL", demand_key, f"{at:.0f}"] for at, _ in samples if at < now - lookback
                )
                fc = forecast(
                    [*samples, (now, used + wanted)],
                    now,
                    pool.provisioning_delay_s,
                    bucket_s=settings.autoscaler_bucket_s,
                    season_s=pool.predictive.season_s,
                    lookback_s=lookback,
                )
                forecasts[name] = fc.peak
            busy_now = sum(1 for n in members if by_node.get(n))
            busy_key = f"busy:{name}"
            busy_history = await state.series(busy_key)
            width = max(1.0, min(MAX_BUSY_BUCKET_S, pool.scale_down.cooldown_s / 5))
            window = max(pool.scale_down.cooldown_s, width)
            bucket = math.floor(now / width) * width
            history_ops.append(["HMAX", busy_key, f"{bucket:.0f}", busy_now])
            history_ops.extend(
                ["HDEL", busy_key, f"{at:.0f}"]
                for at, _ in busy_history
                if at < now - 2 * window - width
            )
            samples_busy = [(at, int(v)) for at, v in busy_history]
            peak = max(busy_now, peak_busy(samples_busy, now, window + width))
            statuses = [
                NodeStatus(
                    node_id=n,
                    idle_since=records[n].idle_since,
                    lease_ids=tuple(sorted(by_node.get(n, ()))),
                    draining_since=records[n].draining_since,
                    preempt_requested=records[n].preempt_requested,
                    ready=True,
                )
                for n in members
                if n not in in_journal
            ]
            steps = plan_scale_down(
                pool,
                statuses,
                PoolLoad(recent_peak_busy=peak, pending_jobs=tuple(pool_jobs.get(name, ()))),
                now,
                provisioning=view.provisioning_count,
                # What the forecast wants is not drained only to be added again.
                keep_nodes=forecast_nodes(pool, forecasts.get(name, 0.0)),
            )
            undrained = sum(s.nodes for s in steps if s.action is ScaleAction.UNDRAIN)
            if undrained:
                up_steps = _fewer(up_steps, name, undrained)
            down_steps.extend(steps)
            dead = tuple(n for n in view.dead if n not in in_journal)
            if dead:
                # Out of the size already (lost), so neither min_size nor returning demand
                # keeps them: no grant can reach them, and a replacement is planned instead.
                dead_steps.append(
                    ScaleStep(
                        action=ScaleAction.REMOVE,
                        pool=name,
                        reason=ScaleReason.LOST,
                        node_ids=dead,
                        detail=(
                            "failed at the provider or not registered within "
                            f"{_provisioning_timeout(pool, settings):g} s; no lease on it"
                        ),
                    )
                )

            if name in forecasts:
                planned = (
                    view.size
                    + min_adds.get(name, 0)
                    + sum(s.count for s in up_steps if s.pool == name)
                )
                step = plan_predictive(pool, forecasts[name], planned)
                if step is not None and step.count > 0:
                    predictive_steps.append(step)
        await state.write(term, history_ops)

        plan = ScalePlan(
            # Lost nodes go back first: a provider that counts them toward max_size then has
            # room for their replacements.
            steps=(*dead_steps, *min_steps, *up_steps, *predictive_steps, *down_steps),
            unserved=dict(answer.unserved),
        )

        # -- act
        cycle_id = f"t{term}c{self._cycle}"
        decisions = plan.events(pools, sizes, cycle=cycle_id, at=_dt(now))
        for step, decision in zip(plan.steps, decisions, strict=True):
            pool = pools[step.pool]
            entry = JournalEntry(
                decision=decision,
                term=term,
                started_at=now,
                node_ids=[],
                lease_ids=list(step.lease_ids),
                grace_s=step.grace_s,
                expected_ready_at=(
                    now + pool.provisioning_delay_s if step.action is ScaleAction.SCALE_UP else None
                ),
            )
            await state.put_entry(term, entry)
            deps.metrics.decisions.labels(decision.action.value, decision.reason.value).inc()
            self._recent.append(decision)
            self._log.info(
                "scale_decision",
                decision_id=decision.decision_id,
                pool=decision.pool,
                action=decision.action.value,
                reason=decision.reason.value,
                count=decision.count,
                detail=decision.detail,
            )
            await self._apply(term, entry, pools, records, now)

        # -- report
        status = await self._status(
            term,
            now,
            config.source,
            views,
            records,
            by_node,
            jobs,
            actionable,
            ignored,
            answer,
            pool_jobs,
            jobs_by_id,
            forecasts,
        )
        # The scheduler keeps pending what only these nodes could hold (so it reaches us), and
        # lets the jobs in-flight scale-ups are for wait for them (a scheduler that restarted
        # after the NodeProvisioning event learns it here).
        shapes = [pool_shape(p, self._catalog) for p in config.pools]
        incoming = {
            job_id: (e.expected_ready_at or e.started_at) + INCOMING_OVERDUE_S
            for e in journal.values()
            if e.decision.action is ScaleAction.SCALE_UP
            for job_id in e.decision.demand.job_ids
        }
        await state.write(
            term,
            [
                ["SET", STATUS, msgspec.json.encode(status).decode()],
                ["SET", SHAPES, msgspec.json.encode(shapes).decode()],
                ["SET", INCOMING, msgspec.json.encode(incoming).decode()],
            ],
        )
        deps.metrics.observe(status)
        return status

    # ---- carrying out one step --------------------------------------------------------------

    async def _apply(
        self,
        term: int,
        entry: JournalEntry,
        pools: Mapping[str, PoolConfig],
        records: dict[str, PoolNodeRecord],
        now: float,
    ) -> None:
        """Carry out one journal entry (idempotent: a replay does nothing twice)."""
        state = self.deps.state
        decision = entry.decision
        pool = pools.get(decision.pool)
        if pool is None:
            self._log.warning("pool_gone", decision_id=decision.decision_id, pool=decision.pool)
            await state.write(term, [state.op_drop_entry(decision.decision_id)])
            return
        await self.publish(decision)
        if self.term != term:
            raise LostLeadership(f"term {term} ended before {decision.decision_id}")
        match decision.action:
            case ScaleAction.SCALE_UP:
                await self._scale_up(term, entry, pool, records, now)
            case ScaleAction.DRAIN:
                ops = []
                holding = _leases_by_node(await self.deps.ledger.leases())
                for node_id in decision.node_ids:
                    await self.deps.drainer.drain(node_id)
                    record = records.get(node_id) or PoolNodeRecord(node_id=node_id, pool=pool.name)
                    if record.draining_since is None:
                        record.draining_since = now
                    record.drain_decision = decision.decision_id
                    records[node_id] = record
                    ops.append(state.op_node(record))
                for node_id in decision.node_ids:
                    await self.publish(
                        NodeDraining(
                            pool=pool.name,
                            node_id=node_id,
                            decision_id=decision.decision_id,
                            policy=pool.drain.policy,
                            grace_s=pool.drain.grace_s,
                            leases=len(holding.get(node_id, ())),
                            at=_dt(now),
                        )
                    )
                await state.write(term, [*ops, state.op_drop_entry(decision.decision_id)])
            case ScaleAction.UNDRAIN:
                ops = []
                for node_id in decision.node_ids:
                    await self.deps.drainer.undrain(node_id)
                    undrained = records.get(node_id)
                    if undrained is None:
                        continue
                    undrained.draining_since = None
                    undrained.drain_decision = None
                    undrained.preempt_requested = False
                    # Idle afresh: the cool-down starts again (hysteresis).
                    undrained.idle_since = now if undrained.idle_since is not None else None
                    ops.append(state.op_node(undrained))
                await state.write(term, [*ops, state.op_drop_entry(decision.decision_id)])
            case ScaleAction.PREEMPT:
                # The lease-manager ends leases (its script, its role): asked on the bus as the
                # scheduler asks for a preemption, it warns the holder and keeps the grace.
                for lease_id in entry.lease_ids:
                    await self.publish(
                        EndLease(
                            lease_id=lease_id,
                            reason=EndReason.PREEMPTED,
                            detail=f"node drained by the autoscaler ({pool.name})",
                            grace_s=entry.grace_s,
                            requested_by="autoscaler",
                        )
                    )
                ops = []
                for node_id in decision.node_ids:
                    preempted = records.get(node_id)
                    if preempted is not None:
                        preempted.preempt_requested = True
                        ops.append(state.op_node(preempted))
                await state.write(term, [*ops, state.op_drop_entry(decision.decision_id)])
            case ScaleAction.REMOVE:
                await self._remove(term, entry, pool, records, now)

    async def _scale_up(
        self,
        term: int,
        entry: JournalEntry,
        pool: PoolConfig,
        records: dict[str, PoolNodeRecord],
        now: float,
    ) -> None:
        state = self.deps.state
        decision = entry.decision
        provider = self.provider(pool)
        try:
            result = await self._call(provider.add(pool, decision.count, entry.request_id))
        except ProviderError as error:
            await self._fail(term, entry, str(error))
            return
        names = list(dict.fromkeys([*entry.node_ids, *(n.node_id for n in result.nodes)]))
        ops = []
        for node_id in names:
            if node_id not in records:
                record = PoolNodeRecord(
                    node_id=node_id,
                    pool=pool.name,
                    request_id=entry.request_id,
                    requested_at=entry.started_at,
                )
                records[node_id] = record
                ops.append(state.op_node(record))
        await self.publish(
            NodeProvisioning(
                request_id=entry.request_id,
                decision_id=decision.decision_id,
                pool=pool.name,
                provider=provider.kind,
                count=decision.count,
                node_ids=names[:1024],
                job_ids=list(decision.demand.job_ids),
                expected_ready_at=(
                    _dt(entry.expected_ready_at) if entry.expected_ready_at is not None else None
                ),
                at=_dt(entry.started_at),
            )
        )
        entry.applied = True
        entry.node_ids = names
        entry.last_error = ""
        self._log.info(
            "provisioning",
            request_id=entry.request_id,
            pool=pool.name,
            nodes=names,
            replay=result.already_applied,
        )
        await state.write(term, [*ops, state.op_entry(entry)])

    async def _remove(
        self,
        term: int,
        entry: JournalEntry,
        pool: PoolConfig,
        records: dict[str, PoolNodeRecord],
        now: float,
    ) -> None:
        state = self.deps.state
        decision = entry.decision
        # A lost node given back was never drained: drain it first (a no-op for one the ledger
        # has never seen) and record it, so that if it registers or comes back now it takes no
        # grant, and if the provider refuses it is a draining node (undrained on demand). Then
        # re-read the leases right before giving nodes back: one granted since the plan keeps
        # its node (it stays draining; a later cycle removes it once empty).
        drained = []
        for node_id in decision.node_ids:
            record = records.get(node_id)
            if record is not None and record.draining_since is None:
                await self.deps.drainer.drain(node_id)
                record.draining_since = now
                record.drain_decision = decision.decision_id
                drained.append(state.op_node(record))
        await state.write(term, drained)
        busy = _leases_by_node(await self.deps.ledger.leases())
        removable = [n for n in decision.node_ids if not busy.get(n)]
        kept = [n for n in decision.node_ids if busy.get(n)]
        if kept:
            self._log.info("remove_deferred", nodes=kept, reason="leases on them")
        if removable:
            try:
                await self._call(self.provider(pool).remove(pool, removable, entry.request_id))
            except ProviderError as error:
                await self._fail(term, entry, str(error))
                return
        for node_id in removable:
            await self.publish(
                NodeRemoved(
                    pool=pool.name,
                    node_id=node_id,
                    decision_id=decision.decision_id,
                    request_id=entry.request_id,
                    at=_dt(now),
                )
            )
        ops = [state.op_drop_node(n) for n in removable]
        for node_id in removable:
            records.pop(node_id, None)
        await state.write(term, [*ops, state.op_drop_entry(decision.decision_id)])

    async def _fail(
        self, term: int, entry: JournalEntry, error: str, *, give_up: bool = False
    ) -> None:
        """Publish ``ScaleFailed``; keep the entry for a retry with the same request id, or
        drop it after ``autoscaler_max_attempts`` failures (or at once with ``give_up``)."""
        state = self.deps.state
        decision = entry.decision
        entry.attempts += 1
        entry.last_error = error[:500]
        give_up = give_up or entry.attempts >= self.deps.settings.autoscaler_max_attempts
        self.deps.metrics.provider_failures.labels(decision.pool, decision.action.value).inc()
        self._log.warning(
            "scale_failed",
            decision_id=decision.decision_id,
            pool=decision.pool,
            action=decision.action.value,
            error=error[:500],
            attempts=entry.attempts,
            given_up=give_up,
        )
        await self.publish(
            ScaleFailed(
                pool=decision.pool,
                request_id=entry.request_id,
                action=decision.action,
                error=(error + ("; given up" if give_up else "; will retry"))[:1000],
                at=_dt(time.time()),
            )
        )
        if give_up:
            await state.write(term, [state.op_drop_entry(decision.decision_id)])
        else:
            await state.write(term, [state.op_entry(entry)])

    # ---- the status snapshot ----------------------------------------------------------------

    async def _status(
        self,
        term: int,
        now: float,
        source: str,
        views: Mapping[str, _PoolView],
        records: Mapping[str, PoolNodeRecord],
        by_node: Mapping[str, set[str]],
        jobs: Sequence[PendingJob],
        actionable: Sequence[PendingJob],
        ignored: Mapping[str, JobReason],
        answer: ScaleUpAnswer,
        pool_jobs: Mapping[str, Sequence[str]],
        jobs_by_id: Mapping[str, PendingJob],
        forecasts: Mapping[str, float],
    ) -> ScaleStatus:
        journal = await self.deps.state.journal()
        pools_out: list[PoolStatus] = []
        total_cost = 0.0
        for name, view in views.items():
            pool = view.pool
            nodes = [
                NodeView(
                    node_id=n,
                    state=kind,
                    leases=len(by_node.get(n, ())),
                    request_id=records[n].request_id if n in records else None,
                    idle_since=records[n].idle_since if n in records else None,
                    draining_since=records[n].draining_since if n in records else None,
                )
                for kind, ids in (
                    ("ready", view.ready),
                    ("provisioning", view.provisioning),
                    ("draining", view.draining),
                    ("lost", view.lost),
                )
                for n in sorted(ids)
            ]
            incoming = []
            for entry in sorted(journal.values(), key=lambda e: e.started_at):
                if entry.decision.action is not ScaleAction.SCALE_UP or entry.decision.pool != name:
                    continue
                ready = sum(1 for n in entry.node_ids if n in view.ready or n in view.draining)
                incoming.append(
                    IncomingRequest(
                        request_id=entry.request_id,
                        count=entry.decision.count,
                        ready=ready,
                        node_ids=list(entry.node_ids),
                        requested_at=entry.started_at,
                        expected_ready_at=entry.expected_ready_at,
                        attempts=entry.attempts,
                        last_error=entry.last_error,
                    )
                )
            held = len(view.ready) + view.provisioning_count + len(view.draining) + len(view.lost)
            cost = round(held * pool.cost_per_hour, 6)
            total_cost += cost
            wanted = pool_jobs.get(name, ())
            pools_out.append(
                PoolStatus(
                    name=name,
                    provider=pool.provider_type,
                    model=pool.node.model,
                    devices_per_node=pool.node.count,
                    min_size=pool.min_size,
                    max_size=pool.max_size,
                    ready=len(view.ready),
                    provisioning=view.provisioning_count,
                    draining=len(view.draining),
                    lost=len(view.lost),
                    node_cost_per_hour=pool.cost_per_hour,
                    cost_per_hour=cost,
                    pending_jobs=len(wanted),
                    pending_devices=round(
                        sum(job_devices(jobs_by_id[j].request) for j in wanted if j in jobs_by_id),
                        6,
                    ),
                    predictive=pool.predictive.enabled,
                    forecast_devices=(round(forecasts[name], 3) if name in forecasts else None),
                    incoming=incoming,
                    nodes=nodes,
                    provider_error=view.provider_error,
                )
            )
        reasons: dict[str, int] = {}
        for reason in ignored.values():
            reasons[reason.value] = reasons.get(reason.value, 0) + 1
        return ScaleStatus(
            leader=self.deps.state.owner,
            term=term,
            at=now,
            interval_s=self.deps.settings.autoscaler_interval_s,
            pools=pools_out,
            pending=PendingView(
                jobs=len(jobs),
                actionable_jobs=len(actionable),
                actionable_devices=round(sum(job_devices(j.request) for j in actionable), 6),
                ignored=reasons,
                unserved=dict(list(answer.unserved.items())[:50]),
            ),
            cost_per_hour=round(total_cost, 6),
            recent_decisions=list(self._recent),
            pools_source=source,
            pools_error=self._reload_error or "",
        )


def _leases_by_node(leases: Iterable[LeaseRecord]) -> dict[str, set[str]]:
    """Live leases (reservations included) per node, by their slices and host claims."""
    out: dict[str, set[str]] = {}
    for lease in leases:
        if lease.state == "ended":
            continue
        for node_id in {s.node_id for s in lease.slices} | set(lease.host):
            out.setdefault(node_id, set()).add(lease.lease_id)
    return out


def _provisioning_timeout(pool: PoolConfig, settings: AutoscalerSettings) -> float:
    """How long a scale-up of ``pool`` may take before its unready nodes count as lost."""
    return 3 * pool.provisioning_delay_s + settings.autoscaler_provisioning_grace_s


def _fewer(steps: builtins.list[ScaleStep], pool: str, by: int) -> builtins.list[ScaleStep]:
    """``steps`` with the scale-ups of ``pool`` reduced by ``by`` nodes in all (undrained
    nodes serve that demand first)."""
    out = []
    for step in steps:
        if step.pool == pool and step.action is ScaleAction.SCALE_UP and by > 0:
            cut = min(by, step.count)
            by -= cut
            if step.count - cut <= 0:
                continue
            step = ScaleStep(
                action=step.action,
                pool=step.pool,
                reason=step.reason,
                count=step.count - cut,
                demand=step.demand,
                detail=f"{step.detail}; {cut} undrained instead",
            )
        out.append(step)
    return out


def _dt(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC)


async def _first(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def _nowhere(event: msgspec.Struct) -> None:
    """Until the bus is open, events go nowhere (a cycle never runs without a publisher)."""
    raise RuntimeError(f"no publisher for {type(event).__name__}")
