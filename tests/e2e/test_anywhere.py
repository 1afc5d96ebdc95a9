"""A stack that starts anywhere: bundled server binaries, user errors without tracebacks, services
that stop on SIGTERM whatever their connections do, and nothing left behind by a killed stack."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Ready
from xpupool.devstack.stack import NodeSpec, ServiceProcess, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

CLI = [sys.executable, "-m", "xpupool.cli.main"]
SERVER_BINARIES = ("nats-server", "redis-server")


def _hidden_servers_env() -> dict[str, str]:
    """This environment with no nats-server or redis-server reachable but the bundled ones:
    PATH without the folders holding one (the virtualenv's bin included), no *_SERVER_BIN and
    no server URLs."""
    path = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not any((Path(d) / name).exists() for name in SERVER_BINARIES)
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "XPUPOOL_NATS_SERVER_BIN",
            "XPUPOOL_REDIS_SERVER_BIN",
            "XPUPOOL_NATS_URL",
            "XPUPOOL_REDIS_URL",
        )
    }
    env["PATH"] = os.pathsep.join(path)
    return env


def _process_table() -> dict[int, tuple[int, str, list[str]]]:
    """pid -> (parent pid, state, argv) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry.name)] = (
            int(fields[1]),
            fields[0],
            [a.decode(errors="replace") for a in argv if a],
        )
    return table


def _descendants(root: int) -> dict[int, list[str]]:
    """The live descendants of ``root``: pid -> argv."""
    table = _process_table()
    found: dict[int, list[str]] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, state, argv) in table.items():
            if ppid == parent and state != "Z" and pid not in found:
                found[pid] = argv
                frontier.append(pid)
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture
def dev_up(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[str], list[str]]]]:
    """Start ``xpupool dev up ARGS`` (own folder, own session) and read its banner up to the
    line naming its logs; every process it started is killed at the end whatever happened."""
    started: list[subprocess.Popen[str]] = []
    spawned: dict[int, list[str]] = {}

    def start(
        *args: str, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[str], list[str]]:
        process = subprocess.Popen(
            [*CLI, "dev", "up", "--dir", str(tmp_path / "stack"), *args],
            env=env if env is not None else _hidden_servers_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(process)
        assert process.stdout is not None
        lines: list[str] = []
        while not (lines and lines[-1].startswith("logs in")):
            line = process.stdout.readline()
            if not line:
                assert process.stderr is not None
                pytest.fail(f"dev up ended: {lines} {process.stderr.read()}")
            lines.append(line.strip())
        spawned.update(_descendants(process.pid))
        return process, lines

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
    for pid in spawned:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_dev_up_serves_a_job_on_the_bundled_servers(
    dev_up: Callable[..., tuple[subprocess.Popen[str], list[str]]],
) -> None:
    """With no nats-server or redis-server on PATH, `xpupool dev up` runs on the PyPI wheels'."""
    env = _hidden_servers_env()
    process, lines = dev_up("--fleet", "1xA100-80GB,2xT4", "--schedulers", "2", env=env)
    urls = dict(line.split("=", 1) for line in lines if line.startswith("XPUPOOL_"))
    # redis-server rewrites its argv: what runs is read from the executable itself.
    binaries = [Path(os.readlink(f"/proc/{pid}/exe")) for pid in _descendants(process.pid)]
    servers = [b for b in binaries if b.name in SERVER_BINARIES]
    assert sorted(b.name for b in servers) == sorted(SERVER_BINARIES), binaries
    bundled = Path(sys.executable).parent.resolve()
    assert all(b.parent == bundled for b in servers), servers
    submitted = subprocess.run(
        [*CLI, "submit", "--tenant", "anywhere", "--model", "T4", "--count", "2", "--wait"],
        env={**env, **urls},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    grant = json.loads(submitted.stdout)
    assert [s["device_id"] for s in grant["slices"]] == ["node-b/nvidia0", "node-b/nvidia1"]
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0


def test_sigkill_of_dev_up_leaves_no_process(
    dev_up: Callable[..., tuple[subprocess.Popen[str], list[str]]],
) -> None:
    """SIGKILL to `xpupool dev up` ends every service and server it started within seconds."""
    process, _ = dev_up("--fleet", "1xA100-80GB")
    children = _descendants(process.pid)
    assert len(children) == 5, children  # two servers, lease-manager, scheduler, collector
    process.kill()
    process.wait(timeout=10)
    deadline = time.monotonic() + 15
    while (left := [p for p in children if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, {p: children[p] for p in left}


async def test_sigterm_stops_services_whose_servers_are_gone(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """SIGTERM ends a service within seconds when its NATS and Redis are gone, one reconnecting
    and one started after they went (nats-py retries that first connection forever)."""
    stack = make_stack([NodeSpec("node-t", "1xA100-80GB")])
    await ready(stack, 1)
    assert stack.nats is not None and stack.redis is not None
    stack.nats.kill()
    stack.redis.kill()
    late = stack.spawn("scheduler")
    await asyncio.sleep(2.0)  # every service notices: reconnecting, failing its Redis calls
    services: list[ServiceProcess] = list(stack.services)
    assert all(s.alive() for s in services), stack.logs()
    started = time.monotonic()
    for service in services:
        service.process.send_signal(signal.SIGTERM)
    for service in services:
        service.process.wait(timeout=max(0.1, started + 8 - time.monotonic()))
    assert late.process.returncode is not None
    assert time.monotonic() - started < 8, stack.logs()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nats-url", "nats://127.0.0.1:1", "submit", "--tenant", "t"], "cannot reach NATS"),
        (["--redis-url", "redis://u:secret@127.0.0.1:1/0", "status"], "cannot reach Redis"),
        (["devices", "--simulate", "1xMI300X"], "unknown device model 'MI300X'"),
        (["dev", "up", "--fleet", "2xA100-80GB,1xNoSuchCard"], "unknown device model"),
        (["dev", "up", "--queues", "/nonexistent/queues.yaml"], "cannot read"),
        (["--creds", "/nonexistent/t.nk", "submit", "--tenant", "t"], "No such file"),
        (["dev", "up", "--fleet", "1xT4"], "XPUPOOL_NATS_SERVER_BIN=/nonexistent"),
    ],
)
def test_user_errors_print_one_line(args: list[str], says: str) -> None:
    """Unreachable servers, unknown models, missing files and binaries: one line, exit 2."""
    env = {**os.environ, "XPUPOOL_NATS_SERVER_BIN": "/nonexistent/nats-server"}
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("xpupool: error: ") and says in done.stderr
    assert "secret" not in done.stderr
