"""The pool file: strict validation naming the bad key and pool, catalog defaults, reloads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from xpupool.autoscaler.pools import (
    ExecProviderConfig,
    KubernetesProviderConfig,
    PoolConfigError,
    PoolSource,
    SimulatedProviderConfig,
    load_pools,
    parse_pools,
)
from xpupool.contracts import DrainPolicy
from xpupool.devices.catalog import load_catalog

ROOT = Path(__file__).resolve().parents[3]
CATALOG = load_catalog()


def pool(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "name": "a100",
        "node": {"model": "A100-SXM4-80GB", "count": 8, "cpu_milli": 96000},
        "max_size": 4,
        "provider": {"type": "simulated"},
    }
    base.update(overrides)
    return base


def parse(*pools: dict[str, object]) -> object:
    return parse_pools({"pools": list(pools)}, source="pools.yaml", catalog=CATALOG)


def test_the_shipped_example_loads_with_every_provider() -> None:
    config = load_pools(ROOT / "deploy" / "autoscaler" / "pools.example.yaml", catalog=CATALOG)
    assert config.names == ("t4", "a100", "sim-ascend")
    t4, a100, sim = config.pools
    assert isinstance(t4.provider, ExecProviderConfig) and t4.provider_type == "exec"
    assert t4.drain.policy is DrainPolicy.PREEMPT and t4.drain.grace_s == 120
    assert isinstance(a100.provider, KubernetesProviderConfig)
    assert a100.predictive.enabled and a100.predictive.headroom == 1.1
    assert isinstance(sim.provider, SimulatedProviderConfig) and not sim.predictive.enabled
    assert sim.node.profile == "8xAscend910B"


def test_catalog_defaults_canonical_model_interconnect_and_price() -> None:
    config = parse(pool(node={"model": "NVIDIA A100-SXM4-80GB", "count": 8}))
    (a100,) = config.pools  # type: ignore[attr-defined]
    entry = CATALOG.get("A100-SXM4-80GB")
    assert a100.node.model == "A100-SXM4-80GB"  # alias canonicalised
    assert a100.node.interconnect == entry.interconnect
    assert a100.cost_per_hour == pytest.approx(8 * entry.cost_per_hour)
    assert a100.capacity_units == pytest.approx(8 * entry.capacity_units)
    assert a100.vendor == "nvidia"


def test_toml_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "pools.toml"
    path.write_text(
        '[[pools]]\nname = "t4"\nmax_size = 2\ncost_per_hour = 1.5\n'
        'node = { model = "T4", count = 1 }\n'
        'provider = { type = "exec", command = ["/bin/true"] }\n'
    )
    (t4,) = load_pools(path, catalog=CATALOG).pools
    assert t4.cost_per_hour == 1.5 and t4.provider == ExecProviderConfig(command=["/bin/true"])


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (pool(min_size=-1), "pools[0].min_size (pool 'a100'): Expected `int` >= 0"),
        (pool(colour="red"), "pools[0].colour (pool 'a100'): Object contains unknown field"),
        (pool(node={"model": "A100-SXM4-80GB"}), "pools[0].node.count (pool 'a100')"),
        (pool(max_size="four"), "pools[0].max_size (pool 'a100'): Expected `int`, got `str`"),
        (pool(provider={"type": "ftp"}), "pools[0].provider.type (pool 'a100')"),
        (pool(provider={"type": "exec"}), "pools[0].provider.command (pool 'a100')"),
        (pool(drain={"policy": "kill"}), "pools[0].drain.policy (pool 'a100')"),
        (pool(name="a.b"), "pools[0].name (pool 'a.b')"),
        (
            pool(node={"model": "A100-SXM4-80G", "count": 8}),
            "pools[0].node.model (pool 'a100'): unknown device model 'A100-SXM4-80G' (not in the "
            "device catalog; did you mean A100-SXM4-80GB",
        ),
        (pool(min_size=5), "pools[0].min_size (pool 'a100'): 5 is above max_size 4"),
        (
            pool(drain={"policy": "preempt", "grace_s": float("inf")}),
            "pools[0].drain.grace_s (pool 'a100'): must be a finite number, got inf",
        ),
        (
            pool(cost_per_hour=float("nan")),
            "pools[0].cost_per_hour (pool 'a100'): must be a finite number, got nan",
        ),
        (
            pool(drain={"policy": "wait", "grace_s": 30}),
            "pools[0].drain.grace_s (pool 'a100'): only applies to policy preempt",
        ),
        (
            pool(provider={"type": "kubernetes", "machine_deployment": "md", "token": "t"}),
            "pools[0].provider.host (pool 'a100'): required with token or token_file",
        ),
    ],
)
def test_a_bad_pool_is_refused_naming_the_key_and_the_pool(
    entry: dict[str, object], message: str
) -> None:
    with pytest.raises(PoolConfigError) as bad:
        parse(entry)
    assert str(bad.value).startswith("pools.yaml: "), str(bad.value)
    assert message in str(bad.value), str(bad.value)


def test_a_pool_without_a_price_anywhere_is_refused(tmp_path: Path) -> None:
    """An operator catalog without a price for the model: cost_per_hour must be given."""
    catalog_file = tmp_path / "catalog.toml"
    catalog_file.write_text(
        '[catalog]\nextends = "builtin"\n\n[[model]]\nname = "T4"\ncost_per_hour = 0.0\n'
    )
    catalog = load_catalog(catalog_file)
    entry = pool(node={"model": "T4", "count": 1})
    with pytest.raises(PoolConfigError, match=r"cost_per_hour \(pool 'a100'\): not given"):
        parse_pools({"pools": [entry]}, source="pools.yaml", catalog=catalog)
    priced = parse_pools(
        {"pools": [{**entry, "cost_per_hour": 0.4}]}, source="pools.yaml", catalog=catalog
    )
    assert priced.pools[0].cost_per_hour == 0.4


def test_duplicate_names_and_non_mapping_documents_are_refused() -> None:
    with pytest.raises(PoolConfigError, match=r"pools\[1\]\.name .*duplicate pool name 'a100'"):
        parse(pool(), pool())
    with pytest.raises(PoolConfigError, match="must be a mapping"):
        parse_pools(["a"], source="pools.yaml", catalog=CATALOG)


def test_a_pool_may_be_predictive_with_true() -> None:
    (a100,) = parse(pool(predictive=True)).pools  # type: ignore[attr-defined]
    assert a100.predictive.enabled and a100.predictive.season_s == 86400


def _write(path: Path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


GOOD = """
pools:
  - name: t4
    node: {model: T4, count: 2}
    max_size: 3
    provider: {type: simulated}
"""


def test_reload_takes_a_good_file_and_keeps_the_last_good_one_on_a_bad_edit(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pools.yaml"
    _write(path, GOOD, 1_000_000_000)
    source = PoolSource(path, catalog=CATALOG)
    first = source.current()
    assert first.names == ("t4",)
    assert source.reload().changed is False  # unchanged file: not re-read

    _write(path, GOOD.replace("max_size: 3", "max_size: 1\n    min_size: 2"), 2_000_000_000)
    outcome = source.reload()
    assert not outcome.changed and outcome.config is first  # the last good one stays
    assert outcome.error is not None and "pools[0].min_size (pool 't4')" in outcome.error
    assert source.last_error == outcome.error and source.current() is first
    assert source.reload().error == outcome.error  # still said until a good file loads

    _write(path, GOOD.replace("max_size: 3", "max_size: 6"), 3_000_000_000)
    outcome = source.reload()
    assert outcome.changed and outcome.error is None and source.last_error is None
    assert outcome.config.pools[0].max_size == 6 and source.current() is outcome.config
    assert first.pools[0].max_size == 3  # configurations are immutable values


def test_a_bad_file_at_start_up_raises(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text("pools: [{name: x}]")
    with pytest.raises(PoolConfigError, match=r"pools\[0\]\.node"):
        PoolSource(path, catalog=CATALOG)
    assert PoolSource(None).current().pools == ()
