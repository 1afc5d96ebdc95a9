"""What xpupool sees and hands out on a real NVIDIA GPU, checked against the GPU itself.

``python bench/device/gpu_check.py OUT_DIR`` on a machine with an NVIDIA GPU, nvidia-smi and
PyTorch (as root, to start and quit the MPS control daemon). It leaves the GPU's settings (compute
mode, MIG) as they are. It writes to OUT_DIR:

* the vendor tools' own outputs (``nvidia-smi -q -x``, ``nvidia-smi``, ``nvidia-smi topo -m``),
  the fixtures in ``libs/devices/tests/data/nvidia/`` were recorded this way;
* ``report.json``: what ``NvmlBackend`` discovers and samples, idle and under a bf16 matrix
  product load, and its catalog match;
* the job environment of a whole GPU, of a 16 GiB / 25 % share without and with the MPS control
  daemon, and of a host-only job, each run by a CUDA program that counts the visible devices,
  tries a 20 GiB allocation and measures its bf16 rate;
* whether ``mps_running`` sees the daemon before it starts, while it runs and after it quits.

The figures in ``libs/devices/tests/data/nvidia/SOURCES.md`` and the README came from this.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from xpupool.contracts import DeviceSlice, Vendor
from xpupool.devices.backend import to_specs
from xpupool.devices.catalog import load_catalog
from xpupool.devices.enforcement import mps_running, running_share_limits
from xpupool.devices.environment import job_environment
from xpupool.devices.nvml import NvmlBackend

# Run in a child process under each job environment (it must see only that environment).
PROBE = r"""
import json, os, time, torch
r = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count()}
if r["count"]:
    r["name"] = torch.cuda.get_device_name(0)
    try:
        big = torch.empty(20 * 2**30, dtype=torch.uint8, device="cuda")
        r["alloc_20GiB"] = "ok"
        del big
    except RuntimeError as e:
        r["alloc_20GiB"] = str(e)[:160]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) / 90
    c = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, a, out=c)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(40):
        torch.mm(a, a, out=c)
    torch.cuda.synchronize()
    r["bf16_tflops"] = round(40 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12, 1)
print(json.dumps(r))
"""

LOAD = r"""
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) / 90
held = torch.empty(20 * 2**30, dtype=torch.uint8, device="cuda")
torch.mm(a, a); torch.cuda.synchronize()
print("ready", flush=True)
end = time.time() + float(__import__("sys").argv[1])
while time.time() < end:
    for _ in range(20):
        a = torch.mm(a, a)
    torch.cuda.synchronize()
"""


def record(out: Path, name: str, args: list[str]) -> str:
    text = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout
    (out / name).write_text(text)
    return text


def mps_control(*args: str, command: str = "") -> None:
    """Start the MPS control daemon (``-d``) or send it a command (``quit``)."""
    subprocess.run(["nvidia-cuda-mps-control", *args], input=command, text=True, timeout=30)


def probe(env: dict[str, str]) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True
    )
    return json.loads(run.stdout) if run.returncode == 0 else {"error": run.stderr[-400:]}


def main(out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    for name, args in (
        ("nvidia-smi_-q_-x.xml", ["nvidia-smi", "-q", "-x"]),
        ("nvidia-smi.txt", ["nvidia-smi"]),
        ("nvidia-smi_topo_-m.txt", ["nvidia-smi", "topo", "-m"]),
    ):
        record(out, name, args)

    backend = NvmlBackend("gpu-check")
    infos = backend.discover()
    catalog = load_catalog(None)
    report["discover"] = msgspec.to_builtins(infos)
    report["catalog"] = [(i.name, getattr(catalog.lookup(i.name), "name", None)) for i in infos]
    report["idle"] = msgspec.to_builtins(backend.sample())
    load = subprocess.Popen([sys.executable, "-c", LOAD, "4"], stdout=subprocess.PIPE, text=True)
    assert load.stdout is not None and load.stdout.readline().strip() == "ready"
    time.sleep(2.0)  # utilisation is averaged over NVML's last sample period
    report["loaded"] = msgspec.to_builtins(backend.sample())
    report["loaded_processes"] = msgspec.to_builtins([i.processes for i in backend.discover()])
    load.wait()
    spec = to_specs(infos, "gpu-check", catalog)[0]
    backend.close()

    def share(whole: bool, memory_mib: int, compute_pct: int) -> list[DeviceSlice]:
        return [
            DeviceSlice(
                device_id=spec.device_id,
                node_id="gpu-check",
                vendor=Vendor.NVIDIA,
                model=spec.model,
                index=spec.index,
                uuid=spec.uuid,
                memory_mib=memory_mib,
                compute_pct=compute_pct,
                whole=whole,
            )
        ]

    def env(slices: list[DeviceSlice]) -> dict[str, str]:
        return job_environment(slices, "job", "lease", 1)

    report["mps_before"] = mps_running()
    report["whole"] = probe(env(share(True, spec.memory_mib, 100)))
    report["share_without_mps"] = probe(env(share(False, 16384, 25)))
    mps_control("-d")
    time.sleep(1.0)
    report["mps_running"] = mps_running()
    report["share_limits_auto"] = sorted(
        running_share_limits("auto", simulated=False) or frozenset()
    )
    report["share_with_mps"] = probe(env(share(False, 16384, 25)))
    mps_control(command="quit\n")
    time.sleep(2.0)
    report["mps_after_quit"] = mps_running()
    report["host_only"] = probe(env([]))
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    result = main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-check"))
    for key in ("catalog", "idle", "loaded", "mps_before", "whole", "share_without_mps"):
        print(key, result[key])
    for key in ("mps_running", "share_with_mps", "mps_after_quit", "host_only"):
        print(key, result[key])
