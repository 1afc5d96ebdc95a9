"""The README's worked example runs as written against a live stack (plain nats-py only)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import Ready
from xpupool.devstack.stack import NodeSpec, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example: str = next(b for b in blocks if ".jobs.requested" in b)
    assert "import xpupool" not in example and "from xpupool" not in example
    return example


async def test_plain_nats_example_gets_an_allocation(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """The README's plain-NATS submission prints a grant with the NVIDIA environment."""
    stack = make_stack([NodeSpec("node-readme", "1xA100-80GB")])
    await ready(stack, 1)
    assert stack.nats_url
    script = tmp_path / "example.py"
    script.write_text(_example().replace("nats://127.0.0.1:4222", stack.nats_url))
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    grant = json.loads(done.stdout)
    assert grant["type"] == "xpupool.alloc.granted.v1" and grant["job_id"] == "train-42"
    assert grant["env"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20000m"
