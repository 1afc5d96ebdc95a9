"""What keeping a lease's later events after its grant cost, as the e2e bench reads it from
every lease-manager's own exposition (``xpupool_grant_waits_total``, ``xpupool_grant_copies_total``)
between two scrapes, summed over the replicas."""

from __future__ import annotations

from contextlib import ExitStack
from types import ModuleType

from xpupool.lease_manager.metrics import LeaseManagerMetrics
from xpupool.obs.metrics import serve_metrics


def test_the_waits_and_copies_between_two_scrapes_are_summed_over_the_replicas(
    bench: ModuleType,
) -> None:
    replicas = [LeaseManagerMetrics(), LeaseManagerMetrics()]
    replicas[0].grant_waits.inc(5)  # before the slice the bench measures
    with ExitStack() as stack:
        ports = [stack.enter_context(serve_metrics(m.registry, 0)) for m in replicas]
        before = bench.service_counts(0, ports)
        replicas[0].grant_waits.inc(3)
        replicas[1].grant_waits.inc(2)
        replicas[1].grant_copies.inc()
        after = bench.service_counts(0, ports)

    figures = bench.grant_order_figures(before, after)
    assert figures == {"grant_waits": 5.0, "grant_copies": 1.0}
    assert bench.grant_order(figures) == (
        "later events that waited for their grant 5, went after a copy of it 1"
    )


def test_a_scrape_without_a_lease_manager_reads_zero(bench: ModuleType) -> None:
    assert bench.grant_order_figures({}, bench.service_counts(0, [])) == {
        "grant_waits": 0.0,
        "grant_copies": 0.0,
    }
