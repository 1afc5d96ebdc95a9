"""The scheduler's copy of the ledger, brought up to date each cycle from the ledger's change log.

Reading the whole ledger (every node, device and lease hash) takes hundreds of milliseconds at a
thousand nodes, and a cycle usually follows a handful of changes. ``SnapshotCache`` keeps the
domain states of its last read, asks the change log what changed since
(``Ledger.changes_since``) and re-reads only those nodes and leases (and of a node, only the
devices that changed: telemetry changes one device's utilisation at a time). What it returns equals
``build_snapshot`` of a full read (``Ledger.nodes()``, ``Ledger.leases()``) at that moment; it
reads everything when the log cannot answer (the first read, a log trimmed past the cursor, Redis
flushed, restarted or failed over) and every ``full_every`` reads regardless, but not more often
than every ``full_interval_s`` (a read per arriving batch must not mean a full read of a large
pool every second). It only reads: a
read costs one round trip, the change log, the ledger clock and the changed records together
(``read_changes.lua``), unless more records changed than ``max_records``.

Between reads it can follow the ledger's change feed (``note_change``, fed by
``Ledger.follow_changes``): while nothing but live load was announced since a read, ``kept_pool``
gives the working pool of that read without asking the ledger again, together with the view it
shows, and the one who commits on it has the ledger check that view
(``Admission.placement_view``: nothing but live load changed since). Live load, a device's
utilisation, moves every few seconds on every busy device; placement scores by it, but a sample
a few milliseconds older is as good, so it alone does not withdraw the kept pool (it does call
for a warm read, ``wants_read``).
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from xpupool.ledger import (
    ChangeCursor,
    ChangedRecords,
    LeaseRecord,
    Ledger,
    LedgerChanges,
    NodeRecord,
)
from xpupool.obs import get_logger
from xpupool.scheduler.domain import (
    Decision,
    LeaseState,
    NodeState,
    PoolSnapshot,
    Preempt,
    Reserve,
    SchedulerConfig,
    WorkingPool,
)
from xpupool.scheduler.snapshot import lease_state, node_state

FULL_EVERY = 100
"""Reads between two full ones: a safety net, since the change log alone keeps the copy exact."""
FULL_INTERVAL_S = 300.0
"""The least time between two full reads that the safety net asks for: a full read of a large
pool (10,000 devices) holds the event loop for a noticeable fraction of a second."""

RECENT_READ_S = 0.005
"""How old a read carried by a commit (``SnapshotCache.read_along``) may be for the next batch
to decide on it instead of reading: that batch arrived while the commit was out and starts as
soon as it is done, so its read is a millisecond or two old; older, the batch reads for itself."""

Committed = TypeVar("Committed")

MAX_RECORDS_WITH_LOG = 256
"""The most changed records read with the change log in its one script; more are read in
pipelined round trips instead, so one read never holds Redis for long."""


@dataclass
class _ReadStart:
    """A read begun (``SnapshotCache._begin_read``): when, what was unread until then (given
    back if the read brings nothing) and the cursor it reads from (None: everything)."""

    started: float
    unread: set[int]
    unread_load: set[int]
    cursor: ChangeCursor | None


@dataclass(frozen=True)
class ReadStats:
    """How the last read went: full or incremental, how many records it re-read, how long."""

    full: bool
    nodes: int
    leases: int
    seconds: float


class SnapshotCache:
    """The last pool snapshot, kept up to date incrementally (one per scheduler replica)."""

    def __init__(
        self,
        full_every: int = FULL_EVERY,
        full_interval_s: float = FULL_INTERVAL_S,
        max_records: int = MAX_RECORDS_WITH_LOG,
        after_full_read: Callable[[], None] | None = None,
    ) -> None:
        self.full_every = full_every
        self.max_records = max_records
        self.after_full_read = after_full_read
        """Called once a full read replaced the copy (the service freezes its heap there)."""
        self.full_interval_s = full_interval_s
        self._full_at = 0.0  # monotonic time of the last full read
        self.last: ReadStats | None = None
        self._cursor: ChangeCursor | None = None
        self._version = 0
        self._since_full = 0
        self._nodes: dict[str, NodeState] = {}
        # The records they were made from: a changed node's unchanged devices come from here.
        self._records: dict[str, NodeRecord] = {}
        self._leases: dict[str, LeaseState] = {}
        # Device id -> ids of the cached nodes that list it (a device logs its own changes).
        self._device_nodes: dict[str, set[str]] = {}
        self._node_ids: list[str] = []
        self._node_position: dict[str, int] = {}  # a node's place in _node_ids and _node_tuple
        self._lease_ids: list[str] = []
        self._lease_list: list[LeaseState] = []  # in _lease_ids order
        self._node_tuple: tuple[NodeState, ...] = ()
        self._lease_tuple: tuple[LeaseState, ...] = ()
        self._lock = asyncio.Lock()
        # The working pool of the last read, kept in step with it (``read_pool``), and what
        # changed since the pool was last brought up to date (None: since a full read).
        self._pool: WorkingPool | None = None
        self._pending_nodes: dict[str, NodeState | None] | None = None
        self._pending_leases: dict[str, LeaseState | None] = {}
        self.pool_builds = 0
        """How many working pools were built from scratch (the rest were refreshed)."""
        # The change feed (``note_change``): whether it is live, and when the last read was
        # (the ledger's clock, ms, and this process's monotonic seconds).
        self._feed_live = False
        self._read_at: tuple[int, float] = (0, 0.0)
        # When the last read carried by a commit was applied (``read_along``), until a batch
        # takes its pool (``recent_pool``) or another read comes.
        self._recent_at: float | None = None
        # The sequences announced since the last read began that it may not have seen (0: the
        # feed itself came or went), and those of this replica's own changes not read back yet.
        self._unread: set[int] = set()
        self._unread_load: set[int] = set()
        self._own: set[int] = set()
        self.reads = 0
        """How many reads there were (full or not)."""
        self.changed = asyncio.Event()
        """Set on every announced change (``keep_warm`` reads then, when nothing else is)."""

    def invalidate(self) -> None:
        """Make the next read a full one."""
        self._cursor = None

    def note_change(self, live: bool = True, seq: int = 0, load_only: bool = False) -> None:
        """The change feed announced a change (``live``; ``seq``, its sequence, 0 for the feed
        coming up), or was lost (not ``live``: changes may go unannounced until it is back).
        Either way ``changed`` is set and a read is wanted; unless the change was only live
        load (``load_only``), or one the last read saw already (its sequence is not past that
        read's cursor: announced after the read began), the copy is no longer known current."""
        if load_only:
            self._unread_load.add(seq)
        self._feed_live = live
        self._unread.add(seq)
        self.changed.set()

    def own_change(self, seq: int) -> None:
        """A change this replica made itself (its ledger script answered ``seq``), whichever
        comes first, its announcement or this. It counts as unread (``kept_pool``) until a read
        brings it in, announced or not: an admission of a replica that follows the feed is not
        announced while it is the feed's only subscriber (``follows_feed``)."""
        self._own.add(seq)

    @property
    def follows_feed(self) -> bool:
        """Whether the change feed is live here, so that this replica's own admissions need
        not be announced to it (``Admission.caller_follows_feed``): it counts them itself."""
        return self._feed_live

    def wants_read(self) -> bool:
        """Whether anything but this replica's own changes was announced since the last read
        began. Its own ones alone are not worth a read of their own: the next change anyone
        else makes (a release) brings them in with it."""
        return self._unseen(self._unread - self._own)

    def load_only_unread(self) -> bool:
        """Whether what is wanted to be read is live load alone (it withdraws no kept pool)."""
        return self._unseen(self._unread_load) and not self._unseen(
            self._unread - self._own - self._unread_load
        )

    def _unseen(self, announced: Iterable[int]) -> bool:
        """Whether any of these announced sequences names a change the last read did not see:
        one past its cursor, or 0 (the feed came or went: changes may have gone unannounced)."""
        cursor = self._cursor
        return any(seq == 0 or cursor is None or seq > cursor.seq for seq in announced)

    def since_read_s(self) -> float:
        """Seconds since the last read brought the copy up to date."""
        return time.monotonic() - self._read_at[1]

    async def kept_pool(
        self, config: SchedulerConfig
    ) -> tuple[PoolSnapshot, int, WorkingPool, ChangeCursor] | None:
        """``read_pool`` without reading, when the change feed announced nothing but live load
        since the last read brought the working pool up to date (nor did this replica change
        anything since, announced or not: ``own_change``): the pool, with the ledger's
        clock moved on by the time since (ms, also the pool's ``now_s``), and the view it
        shows. None when that is not known (no live feed, a change announced, the pool out of
        step or for another config): the caller reads. An in-flight read is waited for first."""
        async with self._lock:
            cursor = self._cursor
            if (
                not self._feed_live
                or self._unseen(self._unread - self._unread_load)
                or self._unseen(self._own)
                or cursor is None
            ):
                return None
            current = self._pool_as_read(config)
            return None if current is None else (*current, cursor)

    def _pool_as_read(
        self, config: SchedulerConfig
    ) -> tuple[PoolSnapshot, int, WorkingPool] | None:
        """The working pool of the last read, in step with it and for ``config``, with the
        ledger's clock moved on by the time since (ms, also the pool's ``now_s``); None when
        there is none such."""
        pool = self._pool
        if (
            pool is None
            or pool.config is not config
            or self._pending_nodes is None
            or self._pending_nodes
            or self._pending_leases
        ):
            return None
        read_ms, read_mono = self._read_at
        now_ms = read_ms + int((time.monotonic() - read_mono) * 1000)
        pool.now_s = now_ms / 1000
        snapshot = PoolSnapshot(
            nodes=self._node_tuple,
            leases=self._lease_tuple,
            now_s=pool.now_s,
            version=self._version,
        )
        return snapshot, now_ms, pool

    async def read(self, ledger: Ledger) -> tuple[PoolSnapshot, int]:
        """The pool as the ledger holds it now, and the ledger's clock (ms) it was read at."""
        async with self._lock:
            return await self._read(ledger)

    async def _read(self, ledger: Ledger) -> tuple[PoolSnapshot, int]:
        start = self._begin_read()
        try:
            changes = await ledger.changes_since(
                start.cursor, max_records=self.max_records, known=self._records
            )
            return await self._finish_read(ledger, start, changes)
        except BaseException:
            self._abandon_read(start)
            raise

    def _begin_read(self) -> _ReadStart:
        """A read begins: what was announced until now is what it sees at the least."""
        started = time.perf_counter()
        start = _ReadStart(started, self._unread, self._unread_load, None)
        self._unread, self._unread_load = set(), set()
        self.reads += 1
        due = (
            self._since_full >= self.full_every and started - self._full_at >= self.full_interval_s
        )
        start.cursor = None if due else self._cursor
        return start

    def _abandon_read(self, start: _ReadStart) -> None:
        """A read begun with ``_begin_read`` that brought nothing: what it would have seen is
        still unread."""
        self._unread |= start.unread
        self._unread_load |= start.unread_load

    async def _finish_read(
        self, ledger: Ledger, start: _ReadStart, changes: LedgerChanges
    ) -> tuple[PoolSnapshot, int]:
        """Bring the copy up to date with ``changes`` (read from ``start.cursor``), reading
        whatever they do not carry."""
        started = start.started
        self._recent_at = None
        if changes.complete:
            node_ids = set(changes.nodes)
            for device_id in changes.devices:
                node_ids.update(self._device_nodes.get(device_id, ()))
            # Usually read with the log; what it did not bring is read now: everything when
            # more changed than max_records, else only a node a changed device left (which
            # the log's script cannot know of).
            read = changes.records or ChangedRecords(nodes={}, leases={})
            node_ids |= read.nodes.keys()
            wanted_nodes, wanted_leases = sorted(node_ids), sorted(changes.leases)
            missing_nodes = [n for n in wanted_nodes if n not in read.nodes]
            missing_leases = [i for i in wanted_leases if i not in read.leases]
            found_nodes, found_leases = dict(read.nodes), dict(read.leases)
            if missing_nodes or missing_leases:
                more_nodes, more_leases = await ledger.get_nodes_and_leases(
                    missing_nodes, missing_leases
                )
                found_nodes.update(zip(missing_nodes, more_nodes, strict=True))
                found_leases.update(zip(missing_leases, more_leases, strict=True))
            nodes = [found_nodes[n] for n in wanted_nodes]
            leases = [found_leases[i] for i in wanted_leases]
            now_ms = changes.now_ms
            # Nothing is applied before every read succeeded: a failed read changes nothing.
            self._update_nodes(zip(wanted_nodes, nodes, strict=True))
            self._update_leases(zip(wanted_leases, leases, strict=True))
            if self._pending_nodes is not None:
                for node_id in wanted_nodes:
                    self._pending_nodes[node_id] = self._nodes.get(node_id)
                for lease_id in wanted_leases:
                    self._pending_leases[lease_id] = self._leases.get(lease_id)
            self._since_full += 1
            self.last = ReadStats(
                False, len(wanted_nodes), len(wanted_leases), time.perf_counter() - started
            )
        else:
            all_nodes, all_leases = await ledger.nodes(), await ledger.leases()
            now_ms = await ledger.now_ms()
            self._replace(all_nodes, all_leases)
            self._pending_nodes = None  # the pool, if any, is built anew
            self._since_full = 0
            self._full_at = started
            self.last = ReadStats(
                True, len(all_nodes), len(all_leases), time.perf_counter() - started
            )
            if self.after_full_read is not None:
                self.after_full_read()
        self._cursor = changes.cursor
        # What this read brought in is no longer owed; after a full read (the log started over,
        # or was rewound) the sequences held may mean other changes now, so none is kept.
        self._own = (
            {seq for seq in self._own if seq > changes.cursor.seq} if changes.complete else set()
        )
        # What was announced while it read and is in it already wants no read of its own.
        self._unread = {seq for seq in self._unread if seq == 0 or seq > changes.cursor.seq}
        self._unread_load &= self._unread
        self._version = changes.version
        self._read_at = (now_ms, time.monotonic())
        snapshot = PoolSnapshot(
            nodes=self._node_tuple,
            leases=self._lease_tuple,
            now_s=now_ms / 1000,
            version=changes.version,
        )
        return snapshot, now_ms

    async def read_pool(
        self, ledger: Ledger, config: SchedulerConfig
    ) -> tuple[PoolSnapshot, int, WorkingPool]:
        """``read``, and the working pool of that snapshot: the one kept from the last read,
        refreshed with what changed since (``WorkingPool.refresh``), or one built anew after a
        full read, a change refresh cannot take, or another config.

        The pool is shared: whoever decides on it gives its own decisions back with
        ``settle`` before the next await, so it never carries them into another read.
        """
        async with self._lock:
            snapshot, now_ms = await self._read(ledger)
            return snapshot, now_ms, self._pool_of(snapshot, config)

    def _pool_of(self, snapshot: PoolSnapshot, config: SchedulerConfig) -> WorkingPool:
        """The working pool of the snapshot just read: the kept one refreshed with what changed,
        or one built anew."""
        pool = self._pool
        nodes, leases = self._pending_nodes, self._pending_leases
        if (
            pool is None
            or nodes is None
            or pool.config is not config
            or not pool.refresh(snapshot, nodes, leases)
        ):
            pool = self._pool = WorkingPool(snapshot, config)
            self.pool_builds += 1
        self._pending_nodes, self._pending_leases = {}, {}
        return pool

    async def read_along(
        self,
        ledger: Ledger,
        config: SchedulerConfig,
        commit: Callable[
            [ChangeCursor | None, int, Mapping[str, NodeRecord]],
            Awaitable[tuple[Committed, LedgerChanges | None]],
        ],
        after: Callable[[Committed], Awaitable[None]],
    ) -> Committed:
        """A read that rides on a commit's round trip (``Ledger.admit_and_read``): ``commit``
        is given the cursor, ``max_records`` and the known nodes to read with, and answers its
        result and the change log read right after it (None when that read failed: the copy
        stays as it was). ``after`` runs on the result before the read is applied, so what the
        commit must do next (publish its grants) does not wait for it. The pool read this way
        is kept for the next batch of arrivals (``recent_pool``). A failure to apply the read
        is logged, not raised: the commit stands, and the next batch reads on its own."""
        async with self._lock:
            start = self._begin_read()
            try:
                result, changes = await commit(start.cursor, self.max_records, self._records)
            except BaseException:
                self._abandon_read(start)
                raise
            if changes is None:
                self._abandon_read(start)
            try:
                await after(result)
            finally:
                if changes is not None:
                    await self._apply_read_along(ledger, config, start, changes)
        return result

    async def _apply_read_along(
        self, ledger: Ledger, config: SchedulerConfig, start: _ReadStart, changes: LedgerChanges
    ) -> None:
        try:
            snapshot, _ = await self._finish_read(ledger, start, changes)
        except Exception as error:  # noqa: BLE001  (Redis away: the next batch reads itself)
            self._abandon_read(start)
            get_logger().warning("snapshot_read_along_failed", error=repr(error))
            return
        self._pool_of(snapshot, config)
        self._recent_at = time.monotonic()

    async def recent_pool(
        self, config: SchedulerConfig, max_age_s: float = RECENT_READ_S
    ) -> tuple[PoolSnapshot, int, WorkingPool] | None:
        """The pool a ``read_along`` brought up to date at most ``max_age_s`` ago, once: what
        ``read_pool`` would give, from a read a commit's round trip carried instead of one of
        its own (a batch that arrived while the last one committed decides on it). None when
        there is none, it is older, or anything read since."""
        async with self._lock:
            at, self._recent_at = self._recent_at, None
            if at is None or time.monotonic() - at > max_age_s:
                return None
            return self._pool_as_read(config)

    @contextmanager
    def deciding(
        self, pool: WorkingPool
    ) -> Iterator[Callable[[list[tuple[str, Decision]]], list[tuple[str, Decision]]]]:
        """Around a batch of decisions on ``pool`` (from ``read_pool``): the function it gives
        takes the batch's decisions back out of the pool (each Reserve's reservation) and
        returns them. The pool is shared, so this happens before the next await. A pool that
        preempted (victims released, not restorable from here), or whose batch failed midway,
        is dropped instead, and the next ``read_pool`` builds one anew."""
        settled = False

        def settle(decisions: list[tuple[str, Decision]]) -> list[tuple[str, Decision]]:
            nonlocal settled
            settled = True
            if pool is not self._pool:
                return decisions
            for _, decision in decisions:
                if isinstance(decision, Preempt):
                    self._pool = None
                    return decisions
            for _, decision in decisions:
                if isinstance(decision, Reserve):
                    # A batch's last reservation may never have been put in (``apply_last``):
                    # releasing a reservation the pool does not hold changes nothing.
                    pool.release(f"reservation:{decision.job_id}")
            return decisions

        try:
            yield settle
        finally:
            if not settled and pool is self._pool:
                self._pool = None

    def _replace(self, nodes: list[NodeRecord], leases: list[LeaseRecord]) -> None:
        self._records = {n.node_id: n for n in nodes}
        self._nodes = {n.node_id: node_state(n) for n in nodes}
        self._leases = {lease.lease_id: lease_state(lease) for lease in leases}
        self._device_nodes = {}
        for node in self._nodes.values():
            for device in node.devices:
                self._device_nodes.setdefault(device.device_id, set()).add(node.node_id)
        self._node_ids, self._lease_ids = sorted(self._nodes), sorted(self._leases)
        self._node_position = {node_id: i for i, node_id in enumerate(self._node_ids)}
        self._node_tuple = tuple(self._nodes[i] for i in self._node_ids)
        self._lease_list = [self._leases[i] for i in self._lease_ids]
        self._lease_tuple = tuple(self._lease_list)

    def _update_nodes(self, records: Iterable[tuple[str, NodeRecord | None]]) -> None:
        changed: list[str] = []
        members = False
        for node_id, record in records:
            old = self._nodes.pop(node_id, None)
            old_record = self._records.pop(node_id, None)
            for device in old.devices if old else ():
                holders = self._device_nodes.get(device.device_id)
                if holders is not None:
                    holders.discard(node_id)
                    if not holders:
                        del self._device_nodes[device.device_id]
            if record is not None:
                self._records[node_id] = record
                before = (old_record, old) if old is not None and old_record is not None else None
                state = self._nodes[node_id] = node_state(record, before)
                for device in state.devices:
                    self._device_nodes.setdefault(device.device_id, set()).add(node_id)
            changed.append(node_id)
            members = members or (old is None) != (record is None)
        if members:
            self._node_ids = sorted(self._nodes)
            self._node_position = {node_id: i for i, node_id in enumerate(self._node_ids)}
            self._node_tuple = tuple(self._nodes[i] for i in self._node_ids)
        elif changed:
            # The same nodes: only the changed ones' places in the tuple are replaced.
            nodes = list(self._node_tuple)
            for node_id in changed:
                nodes[self._node_position[node_id]] = self._nodes[node_id]
            self._node_tuple = tuple(nodes)

    def _update_leases(self, records: Iterable[tuple[str, LeaseRecord | None]]) -> None:
        # The id-ordered list is edited in place (a bisection and a move of pointers per
        # change): sorting the ids and rebuilding the list on every read cost milliseconds per
        # read with thousands of live leases, which a busy pool has.
        ids, states = self._lease_ids, self._lease_list
        changed = False
        for lease_id, record in records:
            at = bisect_left(ids, lease_id)
            present = at < len(ids) and ids[at] == lease_id
            if record is None:
                self._leases.pop(lease_id, None)
                if present:
                    del ids[at], states[at]
            else:
                state = self._leases[lease_id] = lease_state(record)
                if present:
                    states[at] = state
                else:
                    ids.insert(at, lease_id)
                    states.insert(at, state)
            changed = True
        if changed:
            self._lease_tuple = tuple(states)
