"""The mutable working copy of a snapshot that a batch of decisions updates.

:class:`WorkingPool` turns a :class:`~.model.PoolSnapshot` into flat per-device and per-node
arrays indexed by integers, groups devices into *device classes* (same vendor, model, memory,
capacity, capabilities, isolation and cost) and keeps a few incremental indexes, so deciding 1,000
requests against one snapshot never rebuilds anything: each reservation, release or restore is
O(slices).

Quota and fair-share usage per queue (and all its ancestors) is tracked here too, because it
changes with every reservation and release in the batch.

The pool is deliberately a plain mutable object: the decision functions use
:meth:`WorkingPool.release` / :meth:`WorkingPool.restore` to simulate "what if these leases were
gone" and undo it exactly, which is much cheaper than copying 10,000 devices.

For the vectorized placement path the pool also keeps numpy mirrors of its mutable counters
(:meth:`WorkingPool.arrays`) and static per-class layouts (:meth:`WorkingPool.class_layout`).
Every counter change (``_apply_slice``, ``_apply_host``, a refresh from the ledger) logs the
touched device and node in ``counter_changes``; the mirrors, and each ``NodeView``, copy only the
entries logged since they last read, so a decision costs O(touched slices) to keep them exact.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from xpupool.placement.inventory import (
    HEALTHY,
    DeviceState,
    HostCharge,
    LeaseSlice,
    LeaseState,
    NodeState,
    PoolSnapshot,
)

__all__ = [
    "Accounts",
    "ClassLayout",
    "DeviceClass",
    "PoolArrays",
    "PoolLease",
    "Usage",
    "WorkingPool",
    "domain_key",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
_A = TypeVar("_A", bound=np.ndarray)


@dataclass(frozen=True, slots=True)
class DeviceClass:
    """Devices that are interchangeable for matching, pricing and quota (one catalog entry)."""

    index: int
    vendor: str
    model: str
    memory_total_mib: int
    capacity_units: float
    capabilities: frozenset[str]
    isolation: frozenset[str]
    cost_per_hour: float
    interconnect: str
    hard_isolation: bool
    partition: str = ""
    """``mig`` / ``vnpu`` for a class of hardware partitions (each taken whole by a hard share)."""


@dataclass(slots=True)
class Usage:
    """What a queue (with its whole subtree) holds now.

    ``devices`` and ``by_model`` count a share as the fraction of the device it takes (the larger
    of its memory and compute fractions); ``units`` are normalized capacity units.
    """

    units: float = 0.0
    devices: float = 0.0
    memory_mib: float = 0.0
    by_model: dict[str, float] = field(default_factory=dict)

    def add(
        self,
        units: float,
        devices: float,
        memory_mib: float,
        by_model: dict[str, float],
        sign: float,
    ) -> None:
        """Add (sign=+1) or remove (sign=-1) one lease's footprint."""
        self.units += sign * units
        self.devices += sign * devices
        self.memory_mib += sign * memory_mib
        for m, n in by_model.items():
            self.by_model[m] = self.by_model.get(m, 0.0) + sign * n


@dataclass(slots=True)
class PoolLease:
    """A lease resolved against the pool: device indices and its quota footprint."""

    state: LeaseState
    queue: str
    devices: tuple[int, ...]
    units: float
    device_count: float
    memory_mib: float
    by_model: dict[str, float]
    nodes: frozenset[int]
    over_quota: bool = False


@dataclass(slots=True)
class PoolArrays:
    """numpy mirrors of the pool's mutable counters, indexed like the lists they mirror.

    Only :meth:`WorkingPool.arrays` hands them out, after copying every entry changed since the
    last read, so a reader always sees exactly the lists' values.
    """

    mem_free: IntArray
    compute_free: IntArray
    holders: IntArray
    exclusive: BoolArray
    node_cpu_free: IntArray
    node_mem_free: IntArray
    node_busy: IntArray
    node_ndevs: IntArray
    """Devices on each node, 1 for a node without any (the divisor of a node's busy fraction)."""
    node_cpu_total: IntArray


@dataclass(frozen=True, slots=True)
class ClassLayout:
    """Static arrays of one device class, its devices grouped by node in ``class_nodes`` order.

    ``devs[seg_starts[k]:seg_starts[k + 1]]`` are the class's devices on node ``seg_nodes[k]``.
    """

    devs: IntArray
    dev_seg: IntArray
    seg_starts: IntArray
    seg_nodes: IntArray
    ok: BoolArray
    memory_total: IntArray
    """``memory_total_mib or 1``: the divisor the policies use."""
    util: FloatArray
    """``util_pct or 0.0``."""


class Accounts(Protocol):
    """Who a lease's footprint is charged to: the scheduler's queue tree satisfies it.

    Placement itself never looks at accounts; the pool only keeps each account's usage (and its
    ancestors') exact as leases come and go, because a batch of decisions changes it with every
    reservation and quota checks read it between them.
    """

    def charge_queue(self, tenant: str, queue: str, /) -> str:
        """The account a lease of ``tenant`` in ``queue`` is charged to."""
        ...

    def path(self, queue: str, /) -> Sequence[str]:
        """``queue`` and every account above it, each charged with its footprint."""
        ...


def domain_key(domain: str, node_id: str) -> str:
    """The interconnect domain of a device; a device without one is its node's own domain."""
    return domain if domain else f"node:{node_id}"


# What a pool reads from a device besides its counters and live load: a change to any of these
# means a new pool (``WorkingPool.refresh``).
_REFRESHED = frozenset({"memory_free_mib", "compute_free_pct", "exclusive", "holders", "util_pct"})
_layout_key = operator.attrgetter(
    *(f.name for f in fields(DeviceState) if f.name not in _REFRESHED)
)


def _read_only(array: _A) -> _A:
    array.flags.writeable = False
    return array


class WorkingPool:
    """Flat, incrementally updated view of a snapshot; see the module docstring."""

    def __init__(self, snapshot: PoolSnapshot, config: Accounts) -> None:
        self.config = config
        self.now_s = snapshot.now_s
        self.version = snapshot.version
        self.devices = [d for n in snapshot.nodes for d in n.devices]
        self.nodes = list(snapshot.nodes)
        self.node_index = {n.node_id: i for i, n in enumerate(self.nodes)}
        self.node_cpu_free = [n.cpu_milli_free for n in self.nodes]
        self.node_mem_free = [n.memory_mib_free for n in self.nodes]
        self.node_devs: list[tuple[int, ...]] = []
        self.dev_node: list[int] = []
        self.dev_class: list[int] = []
        self.dev_index: dict[str, int] = {}
        self.dev_mem_free = [d.memory_free_mib for d in self.devices]
        self.dev_compute_free = [d.compute_free_pct for d in self.devices]
        self.dev_holders = [d.holders for d in self.devices]
        self.dev_exclusive = [d.exclusive for d in self.devices]
        draining = {n.node_id for n in self.nodes if n.draining}
        # A draining node's devices take no new slice, whatever their health.
        self.dev_ok = [d.health == HEALTHY and d.node_id not in draining for d in self.devices]
        self.node_busy = [0] * len(self.nodes)
        self.classes: list[DeviceClass] = []
        self.class_devs: list[list[int]] = []
        self.class_nodes: list[dict[int, list[int]]] = []
        self.class_domains: list[dict[str, dict[int, list[int]]]] = []
        self.class_whole_free: list[dict[int, int]] = []
        self.model_names: set[str] = set()
        class_ids: dict[tuple[object, ...], int] = {}

        i = 0
        for ni, node in enumerate(self.nodes):
            idxs = []
            for d in node.devices:
                key = (
                    d.vendor,
                    d.model,
                    d.memory_total_mib,
                    d.capacity_units,
                    d.capabilities,
                    d.isolation,
                    d.cost_per_hour,
                    d.interconnect,
                    d.partition,
                )
                ci = class_ids.get(key)
                if ci is None:
                    ci = len(self.classes)
                    class_ids[key] = ci
                    self.classes.append(
                        DeviceClass(
                            index=ci,
                            vendor=d.vendor,
                            model=d.model,
                            memory_total_mib=d.memory_total_mib,
                            capacity_units=d.capacity_units,
                            capabilities=d.capabilities,
                            isolation=d.isolation,
                            cost_per_hour=d.cost_per_hour,
                            interconnect=d.interconnect,
                            hard_isolation=d.hard_isolation,
                            partition=d.partition,
                        )
                    )
                    self.class_devs.append([])
                    self.class_nodes.append({})
                    self.class_domains.append({})
                    self.class_whole_free.append({})
                self.model_names.add(d.model.lower())
                self.dev_node.append(ni)
                self.dev_class.append(ci)
                self.dev_index[d.device_id] = i
                if d.uuid:
                    self.dev_index.setdefault(d.uuid, i)
                self.class_devs[ci].append(i)
                self.class_nodes[ci].setdefault(ni, []).append(i)
                dk = domain_key(d.domain, node.node_id)
                self.class_domains[ci].setdefault(dk, {}).setdefault(ni, []).append(i)
                if self._whole_free(i):
                    wf = self.class_whole_free[ci]
                    wf[ni] = wf.get(ni, 0) + 1
                if self._busy(i):
                    self.node_busy[ni] += 1
                idxs.append(i)
                i += 1
            self.node_devs.append(tuple(idxs))

        self.node_up = [
            not node.draining and (not idxs or any(self.devices[i].health != "lost" for i in idxs))
            for node, idxs in zip(self.nodes, self.node_devs, strict=True)
        ]
        """False for a node that is draining or whose devices are all lost (how a snapshot shows
        a node that is down): host-only placement must not pick it."""
        usable = [d for d in self.devices if d.health != "lost"]
        self.total_devices = float(len(usable)) or 1.0
        self.total_memory_mib = float(sum(d.memory_total_mib for d in usable)) or 1.0
        self.total_units = float(sum(d.capacity_units for d in usable)) or 1.0

        self.leases: dict[str, PoolLease] = {}
        self.lease_changes: list[str] = []
        """The ids of leases added or dropped, in order, for readers that follow the lease set
        incrementally (``NodeView``); cleared, with ``lease_changes_epoch`` bumped, when long."""
        self.lease_changes_epoch = 0
        self.node_leases: list[set[str]] = [set() for _ in self.nodes]
        self.queue_leases: dict[str, set[str]] = {}
        self.quota_stale: set[str] = set()
        """Queues whose leases changed since ``quota.refresh_over_quota`` last marked them."""
        self.terminating: set[str] = set()
        """Leases whose end was already requested: a request that does not fit asks for them
        on every decision, which must not cost a pass over every lease."""
        self.queue_priorities: dict[str, dict[int, int]] = {}
        """Per queue, how many of its leases hold each priority: whether a request may preempt
        within its queue at all, without a pass over every lease."""
        self.quota_added: dict[str, set[str]] = {}
        """Per stale queue, the leases added since the last marking: a queue without a guarantee
        flags each lease on its own, so only these need marking (not every lease it holds)."""
        self.quota_marked_for: Accounts | None = None
        """The config the over-quota flags were last computed with (None: never)."""
        self.usage: dict[str, Usage] = {}
        self.held_nodes: set[int] = set()
        self.fast_placement: bool | None = None
        """Vectorized placement: None picks it for large classes, False always uses the
        straightforward per-device scoring (the reference the fast path is tested against)."""
        self._arrays: PoolArrays | None = None
        self._layouts: dict[int, ClassLayout] = {}
        # Where the arrays are in the counter log: (its epoch, devices read, nodes read).
        self._arrays_at = (0, 0, 0)
        self.counter_changes: tuple[list[int], list[int]] = ([], [])
        """The devices and the nodes whose free counters changed, in order, for readers that
        follow the counters incrementally (``arrays``, ``NodeView``); cleared, with
        ``counter_changes_epoch`` bumped, when long."""
        self.counter_changes_epoch = 0
        for lease in snapshot.leases:
            self._register(lease, charge=False)

    # ------------------------------------------------------------------------------------------
    # Per-device predicates used on the hot path.
    # ------------------------------------------------------------------------------------------

    def _whole_free(self, i: int) -> bool:
        return self.dev_ok[i] and self.dev_holders[i] == 0 and not self.dev_exclusive[i]

    def _busy(self, i: int) -> bool:
        return self.dev_holders[i] > 0 or self.dev_exclusive[i]

    # ------------------------------------------------------------------------------------------
    # numpy mirrors for the vectorized placement path.
    # ------------------------------------------------------------------------------------------

    @cached_property
    def device_classes(self) -> IntArray:
        """``dev_class`` as a read-only array: a device's class is fixed for the pool's life."""
        return _read_only(np.fromiter(self.dev_class, dtype=np.int64, count=len(self.devices)))

    @cached_property
    def devices_ok(self) -> BoolArray:
        """``dev_ok`` as a read-only array: health and draining are fixed for the pool's life (a
        change to either makes a new pool, see ``refresh``)."""
        return _read_only(np.fromiter(self.dev_ok, dtype=np.bool_, count=len(self.devices)))

    def arrays(self) -> PoolArrays:
        """The counters as numpy arrays, brought up to date with every change logged since the
        last read (all of them anew when the log started over)."""
        a = self._arrays
        devices, nodes = self.counter_changes
        epoch, devices_read, nodes_read = self._arrays_at
        if a is None or epoch != self.counter_changes_epoch:
            a = self._arrays = PoolArrays(
                mem_free=np.array(self.dev_mem_free, dtype=np.int64),
                compute_free=np.array(self.dev_compute_free, dtype=np.int64),
                holders=np.array(self.dev_holders, dtype=np.int64),
                exclusive=np.array(self.dev_exclusive, dtype=np.bool_),
                node_cpu_free=np.array(self.node_cpu_free, dtype=np.int64),
                node_mem_free=np.array(self.node_mem_free, dtype=np.int64),
                node_busy=np.array(self.node_busy, dtype=np.int64),
                node_ndevs=np.array([len(d) or 1 for d in self.node_devs], dtype=np.int64),
                node_cpu_total=np.array([n.cpu_milli_total for n in self.nodes], dtype=np.int64),
            )
        else:
            for i in set(devices[devices_read:]):
                a.mem_free[i] = self.dev_mem_free[i]
                a.compute_free[i] = self.dev_compute_free[i]
                a.holders[i] = self.dev_holders[i]
                a.exclusive[i] = self.dev_exclusive[i]
            for ni in set(nodes[nodes_read:]):
                a.node_cpu_free[ni] = self.node_cpu_free[ni]
                a.node_mem_free[ni] = self.node_mem_free[ni]
                a.node_busy[ni] = self.node_busy[ni]
        self._arrays_at = (self.counter_changes_epoch, len(devices), len(nodes))
        return a

    def class_layout(self, ci: int) -> ClassLayout:
        """The static layout of class ``ci`` (built once per pool: classes never change)."""
        lay = self._layouts.get(ci)
        if lay is None:
            devs: list[int] = []
            dev_seg: list[int] = []
            starts: list[int] = []
            seg_nodes: list[int] = []
            for k, (ni, idxs) in enumerate(self.class_nodes[ci].items()):
                starts.append(len(devs))
                seg_nodes.append(ni)
                devs.extend(idxs)
                dev_seg.extend([k] * len(idxs))
            lay = self._layouts[ci] = ClassLayout(
                devs=np.array(devs, dtype=np.int64),
                dev_seg=np.array(dev_seg, dtype=np.int64),
                seg_starts=np.array(starts, dtype=np.int64),
                seg_nodes=np.array(seg_nodes, dtype=np.int64),
                ok=np.array([self.dev_ok[i] for i in devs], dtype=np.bool_),
                memory_total=np.array(
                    [self.devices[i].memory_total_mib or 1 for i in devs], dtype=np.int64
                ),
                util=np.array(
                    [float(self.devices[i].util_pct or 0.0) for i in devs], dtype=np.float64
                ),
            )
        return lay

    def usage_of(self, queue: str) -> Usage:
        """The usage of ``queue`` (its subtree included); zero when it holds nothing."""
        u = self.usage.get(queue)
        if u is None:
            u = self.usage[queue] = Usage()
        return u

    # ------------------------------------------------------------------------------------------
    # Footprints and incremental updates.
    # ------------------------------------------------------------------------------------------

    def slice_fraction(self, i: int, memory_mib: int, compute_pct: int, whole: bool) -> float:
        """The fraction of device ``i`` a slice takes: 1 for whole, else max(memory, compute)."""
        if whole:
            return 1.0
        total = self.devices[i].memory_total_mib or 1
        return max(compute_pct / 100.0, memory_mib / total)

    def _resolve(self, lease: LeaseState) -> PoolLease:
        idxs: list[int] = []
        units = devices = memory = 0.0
        by_model: dict[str, float] = {}
        nodes: set[int] = set()
        for s in lease.slices:
            i = self.dev_index.get(s.device_id)
            if i is None:
                continue  # the device left the inventory; nothing to give back
            d = self.devices[i]
            frac = self.slice_fraction(i, s.memory_mib, s.compute_pct, s.whole)
            idxs.append(i)
            units += d.capacity_units * frac
            devices += frac
            memory += d.memory_total_mib if s.whole else s.memory_mib
            by_model[d.model] = by_model.get(d.model, 0.0) + frac
            nodes.add(self.dev_node[i])
        for h in lease.host:
            ni = self.node_index.get(h.node_id)
            if ni is not None:
                nodes.add(ni)
        queue = self.config.charge_queue(lease.tenant, lease.queue)
        return PoolLease(
            lease, queue, tuple(idxs), units, devices, memory, by_model, frozenset(nodes)
        )

    def _charge_usage(self, pl: PoolLease, sign: float) -> None:
        for q in self.config.path(pl.queue):
            self.usage_of(q).add(pl.units, pl.device_count, pl.memory_mib, pl.by_model, sign)

    def _apply_slice(self, i: int, s: LeaseSlice, sign: int) -> None:
        ni = self.dev_node[i]
        was_free, was_busy = self._whole_free(i), self._busy(i)
        if s.whole:
            self.dev_exclusive[i] = sign > 0
            mem = self.devices[i].memory_total_mib
            self.dev_mem_free[i] -= sign * mem
            self.dev_compute_free[i] -= sign * 100
        else:
            self.dev_mem_free[i] -= sign * s.memory_mib
            self.dev_compute_free[i] -= sign * s.compute_pct
        self.dev_holders[i] += sign
        self._device_changed(i, was_free, was_busy)
        self._node_changed(ni)

    def _apply_host(self, host: Iterable[HostCharge], sign: int) -> None:
        for h in host:
            ni = self.node_index.get(h.node_id)
            if ni is not None:
                self.node_cpu_free[ni] -= sign * h.cpu_milli
                self.node_mem_free[ni] -= sign * h.memory_mib
                self._node_changed(ni)

    def _register(self, lease: LeaseState, *, charge: bool) -> PoolLease:
        pl = self._resolve(lease)
        if charge:
            for s in lease.slices:
                i = self.dev_index.get(s.device_id)
                if i is not None:
                    self._apply_slice(i, s, +1)
            self._apply_host(lease.host, +1)
        self.leases[lease.lease_id] = pl
        self._lease_changed(lease.lease_id)
        for ni in pl.nodes:
            self.node_leases[ni].add(lease.lease_id)
        self.queue_leases.setdefault(pl.queue, set()).add(lease.lease_id)
        self.quota_stale.add(pl.queue)
        self.quota_added.setdefault(pl.queue, set()).add(lease.lease_id)
        if lease.terminating:
            self.terminating.add(lease.lease_id)
        counts = self.queue_priorities.setdefault(pl.queue, {})
        counts[lease.priority] = counts.get(lease.priority, 0) + 1
        self._charge_usage(pl, +1.0)
        return pl

    def add_lease(self, lease: LeaseState) -> PoolLease:
        """Take ``lease``'s slices and host resources out of the free counters and charge its queue.

        Used for the scheduler's own reservations within a batch, and by a shell that keeps the
        pool between cycles and applies granted leases incrementally.
        """
        if lease.lease_id in self.leases:
            raise ValueError(f"lease {lease.lease_id!r} is already in the pool")
        return self._register(lease, charge=True)

    def release(self, lease_id: str) -> PoolLease | None:
        """Give back ``lease_id``'s slices and host resources; :meth:`restore` undoes it."""
        pl = self.leases.get(lease_id)
        if pl is None:
            return None
        for s in pl.state.slices:
            i = self.dev_index.get(s.device_id)
            if i is not None:
                self._apply_slice(i, s, -1)
        self._apply_host(pl.state.host, -1)
        self._forget(lease_id)
        return pl

    def restore(self, pl: PoolLease) -> None:
        """Undo :meth:`release` exactly (the over-quota flag included)."""
        self._register(pl.state, charge=True).over_quota = pl.over_quota

    def release_many(self, lease_ids: Sequence[str]) -> list[PoolLease]:
        """Release several leases; returns them in order for :meth:`restore_many`."""
        out = []
        for lid in lease_ids:
            pl = self.release(lid)
            if pl is not None:
                out.append(pl)
        return out

    def restore_many(self, released: Sequence[PoolLease]) -> None:
        """Undo :meth:`release_many`."""
        for pl in reversed(released):
            self.restore(pl)

    # ------------------------------------------------------------------------------------------
    # Kept between batches: brought up to date from the ledger's changes.
    # ------------------------------------------------------------------------------------------

    def refresh(
        self,
        snapshot: PoolSnapshot,
        nodes: Mapping[str, NodeState | None],
        leases: Mapping[str, LeaseState | None],
    ) -> bool:
        """Bring this pool to ``snapshot``, given what changed since the one it mirrors: the new
        state of each changed node (None: gone) and of each changed lease (None: ended).

        The pool must carry no decisions of its own (see ``release``), since the counters of a
        changed node are taken from the ledger, which already counts its leases; leases are
        re-resolved without charging them again. Only counters, utilisation and leases are
        refreshed this way: anything else (a node added or removed, a device's identity, class,
        health or draining changed) answers False, the pool being left half refreshed, and a
        new pool must be built from ``snapshot``. Equal to ``WorkingPool(snapshot, config)``
        when it answers True (``tests/integration/test_snapshot_cache.py`` checks it).
        """
        for node_id, node in nodes.items():
            ni = self.node_index.get(node_id)
            if node is None or ni is None or not self._same_layout(ni, node):
                return False
        for node_id, node in nodes.items():
            assert node is not None
            self._refresh_node(self.node_index[node_id], node)
        for lease_id, lease in leases.items():
            if lease_id in self.leases:
                self._forget(lease_id)
            if lease is not None:
                self._register(lease, charge=False)
        self.now_s = snapshot.now_s
        self.version = snapshot.version
        return True

    def _same_layout(self, ni: int, node: NodeState) -> bool:
        """Whether ``node`` differs from what the pool holds only in counters and utilisation."""
        old = self.nodes[ni]
        if node.draining != old.draining or len(node.devices) != len(old.devices):
            return False
        return all(
            new is was or _layout_key(new) == _layout_key(was)
            for new, was in zip(node.devices, old.devices, strict=True)
        )

    def _refresh_node(self, ni: int, node: NodeState) -> None:
        self.nodes[ni] = node
        self.node_cpu_free[ni] = node.cpu_milli_free
        self.node_mem_free[ni] = node.memory_mib_free
        self._node_changed(ni)
        for i, device in zip(self.node_devs[ni], node.devices, strict=True):
            # The same state object (the snapshot kept an unchanged device's): the pool, which
            # carries no decisions of its own here, already holds its counters.
            if device is not self.devices[i]:
                self._refresh_device(i, device)

    def _refresh_device(self, i: int, device: DeviceState) -> None:
        ci = self.dev_class[i]
        was_free, was_busy = self._whole_free(i), self._busy(i)
        if device.util_pct != self.devices[i].util_pct:
            self._layouts.pop(ci, None)  # its utilisation column is rebuilt when next read
        self.devices[i] = device
        self.dev_mem_free[i] = device.memory_free_mib
        self.dev_compute_free[i] = device.compute_free_pct
        self.dev_holders[i] = device.holders
        self.dev_exclusive[i] = device.exclusive
        self._device_changed(i, was_free, was_busy)

    def _device_changed(self, i: int, was_free: bool, was_busy: bool) -> None:
        """Log device ``i``'s changed counters, and move it between the whole-free and busy
        indexes when its state moved (``was_free``, ``was_busy``: before the change)."""
        self._counter_logged(0, i)
        ni, ci = self.dev_node[i], self.dev_class[i]
        now_free, now_busy = self._whole_free(i), self._busy(i)
        if was_free != now_free:
            wf = self.class_whole_free[ci]
            wf[ni] = wf.get(ni, 0) + (1 if now_free else -1)
        if was_busy != now_busy:
            self.node_busy[ni] += 1 if now_busy else -1

    def _node_changed(self, ni: int) -> None:
        self._counter_logged(1, ni)

    def _counter_logged(self, kind: int, index: int) -> None:
        devices, nodes = self.counter_changes
        if len(devices) + len(nodes) > 4 * (len(self.devices) + len(self.nodes)) + 4096:
            devices.clear()  # readers see the epoch move and compare every counter once
            nodes.clear()
            self.counter_changes_epoch += 1
        self.counter_changes[kind].append(index)

    def _lease_changed(self, lease_id: str) -> None:
        changes = self.lease_changes
        if len(changes) > 4 * len(self.leases) + 4096:
            changes.clear()  # readers see the epoch move and compare the whole set once
            self.lease_changes_epoch += 1
        changes.append(lease_id)

    def _forget(self, lease_id: str) -> None:
        """Drop a lease's bookkeeping without touching the counters (``release`` without giving
        its slices back: the ledger's counters, read anew, no longer hold them)."""
        pl = self.leases.pop(lease_id)
        self._lease_changed(lease_id)
        for ni in pl.nodes:
            self.node_leases[ni].discard(lease_id)
        self.queue_leases[pl.queue].discard(lease_id)
        self.quota_stale.add(pl.queue)
        self.terminating.discard(lease_id)
        counts = self.queue_priorities[pl.queue]
        counts[pl.state.priority] -= 1
        if not counts[pl.state.priority]:
            del counts[pl.state.priority]
        self._charge_usage(pl, -1.0)

    # ------------------------------------------------------------------------------------------
    # Invariants, for tests and for the shell's paranoia checks.
    # ------------------------------------------------------------------------------------------

    def violations(self) -> list[str]:
        """Every device or node whose free counters went negative or above total."""
        out = []
        for i, d in enumerate(self.devices):
            if self.dev_mem_free[i] < 0 or self.dev_mem_free[i] > d.memory_total_mib:
                out.append(f"device {d.device_id}: memory_free {self.dev_mem_free[i]}")
            if self.dev_compute_free[i] < 0 or self.dev_compute_free[i] > 100:
                out.append(f"device {d.device_id}: compute_free {self.dev_compute_free[i]}")
            if self.dev_exclusive[i] and self.dev_holders[i] != 1:
                out.append(f"device {d.device_id}: exclusive with {self.dev_holders[i]} holders")
        for ni, n in enumerate(self.nodes):
            if self.node_cpu_free[ni] < 0 or self.node_mem_free[ni] < 0:
                out.append(f"node {n.node_id}: host resources negative")
        return out
