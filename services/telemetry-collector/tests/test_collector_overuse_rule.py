"""The over-use rule and its episodes: pure, no servers."""

from __future__ import annotations

from pathlib import Path

from xpupool.contracts import Vendor
from xpupool.devices import DeviceInfo, PartitionInfo, ProcessInfo
from xpupool.telemetry_collector.handlers import processes_by_unit
from xpupool.telemetry_collector.overuse import (
    DeviceUse,
    Holder,
    Overuse,
    OveruseEpisodes,
    Verdict,
    assess,
    device_overuse,
    read_lease_env,
)

DEV = "n/nvidia0"


def no_lease(_: int) -> str | None:
    return None


def share(lease_id: str, mib: int, **kwargs: bool) -> Holder:
    return Holder(lease_id=lease_id, job_id=f"job-{lease_id}", granted_memory_mib=mib, **kwargs)


def test_single_holder_over_its_grant_is_overusing() -> None:
    """One holder is charged the device's whole memory in use; above the grant it over-uses."""
    found, judged = device_overuse(DeviceUse(DEV, 30_000), [share("a", 20_000)], no_lease)
    assert found == [Overuse("a", "job-a", DEV, 20_000, 30_000)]
    assert judged == {"a"}


def test_single_holder_within_grant_or_tolerance_is_fine() -> None:
    """Exactly at the grant, or within the tolerance above it, is not over-use."""
    assert device_overuse(DeviceUse(DEV, 20_000), [share("a", 20_000)], no_lease)[0] == []
    over = device_overuse(DeviceUse(DEV, 20_400), [share("a", 20_000)], no_lease, 500)
    assert over[0] == []


def test_whole_leases_and_reservations_are_never_charged() -> None:
    """A whole-device lease owns all memory; a reservation has no process yet."""
    for holder in (share("w", 20_000, whole=True), share("r", 20_000, active=False)):
        assert device_overuse(DeviceUse(DEV, 80_000), [holder], no_lease) == ([], set())


def test_unknown_memory_is_not_judged() -> None:
    """A device that reports no memory in use says nothing about its single holder."""
    assert device_overuse(DeviceUse(DEV, None), [share("a", 1)], no_lease) == ([], set())


def test_several_holders_are_charged_only_their_mapped_processes() -> None:
    """With two holders, processes count per lease by their XPUPOOL_LEASE_ID; unmapped
    processes count for nobody."""
    processes = [
        ProcessInfo(pid=10, memory_used_mib=15_000),
        ProcessInfo(pid=20, memory_used_mib=18_000),
        ProcessInfo(pid=21, memory_used_mib=9_000),
        ProcessInfo(pid=30, memory_used_mib=50_000),
        ProcessInfo(pid=40, memory_used_mib=None),
    ]
    leases = {10: "a", 20: "b", 21: "b", 40: "b"}
    use = DeviceUse(DEV, 80_000, processes)
    found, judged = device_overuse(use, [share("a", 20_000), share("b", 20_000)], leases.get)
    assert found == [Overuse("b", "job-b", DEV, 20_000, 27_000)]
    assert judged == {"a", "b"}


def test_several_holders_without_a_mapping_report_nothing() -> None:
    """Without a readable process environment nothing can be attributed, so nothing is
    reported even when the device is full."""
    use = DeviceUse(DEV, 80_000, [ProcessInfo(pid=1, memory_used_mib=80_000)])
    found, _ = device_overuse(use, [share("a", 10), share("b", 10)], no_lease)
    assert found == []


def test_assess_reads_each_pid_once_per_tick() -> None:
    """A process on two devices has its environment read once."""
    calls: list[int] = []

    def reader(pid: int) -> str | None:
        calls.append(pid)
        return "a"

    proc = [ProcessInfo(pid=7, memory_used_mib=100)]
    holders = {d: [share("a", 10), share("b", 10)] for d in ("n/nvidia0", "n/nvidia1")}
    verdict = assess([DeviceUse(d, 0, proc) for d in holders], holders, reader)
    assert calls == [7]
    assert {o.device_id for o in verdict.overuses} == set(holders)


def test_episode_is_reported_once_and_again_after_it_ends() -> None:
    """An over-use is reported on its first tick only; after a tick within the grant a new
    episode is reported again."""
    episodes = OveruseEpisodes()
    over = Overuse("a", "job-a", DEV, 10, 20)
    assert episodes.update(Verdict([over], frozenset({"a"})), {"a"}) == [over]
    assert episodes.update(Verdict([over], frozenset({"a"})), {"a"}) == []
    assert episodes.update(Verdict([], frozenset()), {"a"}) == []  # not judged: still open
    assert episodes.update(Verdict([over], frozenset({"a"})), {"a"}) == []
    assert episodes.update(Verdict([], frozenset({"a"})), {"a"}) == []  # within: closes
    assert episodes.update(Verdict([over], frozenset({"a"})), {"a"}) == [over]


def test_episode_ends_with_the_lease_and_reports_one_device_per_lease() -> None:
    """A lease over on two devices is one report; it ends when the lease stops holding."""
    episodes = OveruseEpisodes()
    on0, on1 = Overuse("a", "j", "n/x0", 1, 2), Overuse("a", "j", "n/x1", 1, 2)
    assert episodes.update(Verdict([on1, on0], frozenset({"a"})), {"a"}) == [on0]
    assert episodes.update(Verdict([], frozenset()), set()) == []
    assert episodes.open == {}


def test_read_lease_env_reads_proc_environ(tmp_path: Path) -> None:
    """The lease id comes from /proc/<pid>/environ; missing files or variables give None."""
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "environ").write_bytes(b"PATH=/bin\0XPUPOOL_LEASE_ID=lease-1\0X=y\0")
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "environ").write_bytes(b"PATH=/bin\0")
    assert read_lease_env(42, tmp_path) == "lease-1"
    assert read_lease_env(43, tmp_path) is None
    assert read_lease_env(44, tmp_path) is None


def test_mig_processes_go_to_their_partition() -> None:
    """Processes of a MIG-enabled GPU are keyed by their GPU/compute instance's unit id."""
    info = DeviceInfo(
        vendor=Vendor.NVIDIA,
        index=0,
        name="A100",
        mig_mode=True,
        partitions=[
            PartitionInfo(index=0, gpu_instance_id=1, compute_instance_id=0),
            PartitionInfo(index=1, gpu_instance_id=2, compute_instance_id=0),
        ],
        processes=[
            ProcessInfo(pid=1, memory_used_mib=5, gpu_instance_id=2, compute_instance_id=0),
        ],
    )
    plain = DeviceInfo(vendor=Vendor.NVIDIA, index=1, name="A100", processes=[ProcessInfo(pid=2)])
    units = processes_by_unit([info, plain], "n")
    assert units == {
        "n/nvidia0/mig1.0": [],
        "n/nvidia0/mig2.0": [info.processes[0]],
        "n/nvidia1": [ProcessInfo(pid=2)],
    }
