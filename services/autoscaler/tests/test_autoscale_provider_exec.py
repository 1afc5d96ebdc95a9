"""The exec provider at its process boundary: the documented JSON in, the answer out, errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from autoscale_builders import make_pool

from xpupool.autoscaler.pools import ExecProviderConfig, PoolConfig
from xpupool.autoscaler.providers import NodeLifecycle, ProviderError, make_provider
from xpupool.autoscaler.providers.exec import ExecProvider

EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "autoscaler" / "exec-provider-example.py"


def exec_pool(command: list[str], **config: object) -> tuple[PoolConfig, ExecProvider]:
    provider = {"type": "exec", "command": command, **config}
    pool = make_pool(
        "t4",
        node={"model": "T4", "count": 4, "cpu_milli": 32000},
        max_size=3,
        cost_per_hour=2.0,
        provider=provider,
    )
    assert isinstance(pool.provider, ExecProviderConfig)
    made = make_provider(pool.provider)
    assert isinstance(made, ExecProvider)
    return pool, made


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "provider.py"
    path.write_text("import json, sys, time\n" + body)
    return [sys.executable, str(path)]


async def test_the_command_receives_the_documented_json(tmp_path: Path) -> None:
    seen = tmp_path / "request.json"
    command = script(
        tmp_path,
        f"open({str(seen)!r}, 'w').write(sys.stdin.read())\n"
        "print(json.dumps({'ok': True, 'nodes': [{'node_id': 't4-9', 'state': 'provisioning',"
        " 'request_id': 'r1'}], 'target_size': 1, 'extra_key': 'ignored'}))\n",
    )
    pool, provider = exec_pool(command, options={"zone": "eu-1"}, env={"CLOUD": "x"})
    result = await provider.add(pool, 2, "r1")
    request = json.loads(seen.read_text())
    assert request == {
        "version": 1,
        "action": "add",
        "request_id": "r1",
        "pool": {
            "name": "t4",
            "model": "T4",
            "vendor": "nvidia",
            "devices_per_node": 4,
            "cpu_milli": 32000,
            "memory_mib": 0,
            "interconnect": "pcie",
            "labels": {},
            "cost_per_hour": 2.0,
            "min_size": 0,
            "max_size": 3,
        },
        "count": 2,
        "node_ids": [],
        "options": {"zone": "eu-1"},
    }
    assert result.target_size == 1 and result.nodes[0].node_id == "t4-9"
    assert result.nodes[0].state is NodeLifecycle.PROVISIONING and not result.already_applied


async def test_the_example_script_is_idempotent_by_request_id(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    pool, provider = exec_pool([sys.executable, str(EXAMPLE), "--state", str(state)])
    first = await provider.add(pool, 2, "r1")
    assert [n.node_id for n in first.nodes] == ["t4-1", "t4-2"] and first.target_size == 2
    assert all(n.state is NodeLifecycle.READY for n in first.nodes)  # ready_after_s 0
    replay = await provider.add(pool, 2, "r1")  # a replica that took over replays r1
    assert replay.already_applied and [n.node_id for n in replay.nodes] == ["t4-1", "t4-2"]
    assert len(await provider.list(pool)) == 2  # not doubled
    with pytest.raises(ProviderError, match="command refused: pool t4 has 2 nodes; 2 more exceed"):
        await provider.add(pool, 2, "r2")
    removed = await provider.remove(pool, ["t4-1", "t4-404"], "r3")
    assert [n.node_id for n in removed.nodes] == ["t4-1"] and removed.target_size == 1
    assert (await provider.remove(pool, ["t4-1"], "r3")).already_applied
    assert [n.node_id for n in await provider.list(pool)] == ["t4-2"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "sys.stderr.write('no credentials for eu-1'); sys.exit(3)\n",
            "exited with status 3: no credentials for eu-1",
        ),
        ("print('hello')\n", "answer on stdout is not JSON"),
        (
            "print(json.dumps({'ok': True, 'nodes': [{'state': 'ready'}]}))\n",
            "bad answer on stdout: nodes[0].node_id: Object missing required field",
        ),
        (
            "print(json.dumps({'ok': True, 'nodes': [{'node_id': 'a', 'state': 'gone'}]}))\n",
            "bad answer on stdout: nodes[0].state",
        ),
        (
            "print(json.dumps({'ok': False, 'error': 'quota exceeded'}))\n",
            "command refused: quota exceeded",
        ),
    ],
)
async def test_bad_answers_are_clear_errors(tmp_path: Path, body: str, message: str) -> None:
    pool, provider = exec_pool(script(tmp_path, "sys.stdin.read()\n" + body))
    with pytest.raises(ProviderError) as bad:
        await provider.add(pool, 1, "r1")
    assert message in str(bad.value) and "pool t4: exec provider add r1" in str(bad.value)


async def test_a_command_past_its_timeout_is_killed(tmp_path: Path) -> None:
    pool, provider = exec_pool(script(tmp_path, "time.sleep(30)\n"), timeout_s=0.5)
    with pytest.raises(ProviderError, match=r"no answer within 0.5 s \(command killed\)"):
        await provider.list(pool)


async def test_a_missing_command_is_a_clear_error(tmp_path: Path) -> None:
    pool, provider = exec_pool([str(tmp_path / "nope")])
    with pytest.raises(ProviderError, match="cannot run"):
        await provider.remove(pool, ["a"], "r1")
