"""Shared fixtures: real nats-server and redis-server processes on free ports, per test."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar, overload

import pytest
from redis.asyncio import Redis

from xpupool.devstack.servers import NatsServer, RedisServer
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import Ledger

T = TypeVar("T")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh JetStream-enabled nats-server for one test."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def ledger(redis_server: RedisServer) -> AsyncIterator[Ledger]:
    """A ledger on the test's Redis."""
    redis = Redis.from_url(redis_server.url)
    yield Ledger(redis, "test")
    await redis.aclose()


@pytest.fixture
def stack_security() -> str:
    """How ``make_stack`` builds its stack: ``plain`` (open loopback servers) or ``secure``
    (TLS, NKeys, ACLs). A test module overrides this fixture to run on both."""
    return "plain"


@pytest.fixture
def make_stack(
    tmp_path: Path, stack_security: str, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Stack]]:
    """Start a whole stack (services as subprocesses): on the test's own plain servers
    (``stack.nats``/``stack.redis`` are the ``nats_server``/``redis_server`` fixtures), or, for
    ``stack_security == "secure"``, on secured servers the stack starts itself."""
    stacks: list[Stack] = []

    def make(nodes: list[NodeSpec], **kwargs: object) -> Stack:
        servers: dict[str, object] = {}
        if stack_security == "secure":
            servers = {"secure": True}
        else:
            nats = request.getfixturevalue("nats_server")
            redis = request.getfixturevalue("redis_server")
            servers = {"nats_url": nats.url, "redis_url": redis.url, "nats": nats, "redis": redis}
        stack = Stack(
            nodes=nodes,
            workdir=tmp_path / f"stack{len(stacks)}",
            **servers,  # type: ignore[arg-type]
            **kwargs,  # type: ignore[arg-type]
        )
        stack.workdir.mkdir(parents=True, exist_ok=True)
        stacks.append(stack)
        stack.start()
        return stack

    yield make
    for stack in stacks:
        stack.stop()


@overload
async def eventually(
    check: Callable[[], Awaitable[T]], timeout_s: float = ..., interval_s: float = ...
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T], timeout_s: float = ..., interval_s: float = ...
) -> T: ...


async def eventually(
    check: Callable[[], object], timeout_s: float = 20.0, interval_s: float = 0.1
) -> object:
    """Poll a sync or async check until it returns something truthy, and return that."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)
