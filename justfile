# xpupool: the single entry point for development, tests and benchmarks.
set shell := ["bash", "-euo", "pipefail", "-c"]

[private]
default:
    @just --list

# Compiled ahead: where PYTHONDONTWRITEBYTECODE is set (as on this project's dev and CI machines)
# every Python process would otherwise compile numpy, nats-py, redis-py and xpupool from source
# at each start, about 1.2 s of CPU a service there; the CLI and the e2e tests start hundreds.

# Install every workspace package and the dev tools into .venv, compiled to bytecode
[group("setup")]
sync:
    uv sync --frozen --all-packages --compile-bytecode --quiet
    uv run --frozen --no-sync python -m compileall -q -j 0 libs services src

# Run the demo: embedded NATS and Redis, every service, a burst of mixed jobs, a report
[group("run")]
demo: sync
    uv run --frozen xpupool demo

# Start the whole stack and keep it running (prints the URLs)
[group("run")]
up: sync
    uv run --frozen xpupool dev up

# The demo on the secure configuration: TLS, one NKey per service and tenant, Redis ACLs
[group("run")]
demo-secure: sync
    uv run --frozen xpupool demo --secure

# The secure stack, kept running: prints how each tenant connects (credentials, CA, subjects)
[group("run")]
up-secure: sync
    uv run --frozen xpupool dev up --secure

# The whole default test suite (real nats-server and redis-server processes, no Docker)
[group("tests")]
test *ARGS: sync
    uv run --frozen pytest -q {{ARGS}}

# Regenerate proto/ (JSON Schemas and the AsyncAPI document) from the contracts
[group("contracts")]
proto: sync
    uv run --frozen python -m xpupool.contracts.asyncapi proto

# Lint and type-check
[group("lint")]
lint: sync
    uv run --frozen ruff check .
    uv run --frozen mypy libs/*/src services/*/src src tests bench services/*/bench

# On a machine with an NVIDIA GPU and PyTorch, as root: NVML discovery and load, the job environment of a whole GPU and of a share with and without MPS, and MPS detection, checked on the GPU itself
[group("bench")]
gpu-check OUT="gpu-check": sync
    uv run --frozen python bench/device/gpu_check.py {{OUT}}

# Placement quality on the Alibaba GPU trace: every policy, seeds 42-51
[group("bench")]
bench-placement *ARGS: sync
    uv run --frozen python bench/placement/bench_placement.py {{ARGS}}

# Scheduler decision time against pools of 100 to 10,000 devices
[group("bench")]
bench-scheduler: sync
    uv run --frozen python services/scheduler/bench/bench_decide.py

# Lone decisions one after another on a kept pool, as the scheduler makes them for serial jobs
[group("bench")]
bench-serial-decide *ARGS: sync
    uv run --frozen python services/scheduler/bench/bench_serial_decide.py {{ARGS}}

# How long the periodic gauge refreshes hold an event loop (10,000 devices, 10,000 leases), and the loop-lag probe's cost
[group("bench")]
bench-stalls *ARGS: sync
    uv run --frozen python bench/e2e/bench_loop_stalls.py {{ARGS}}

# Whole scheduling cycles at the trace's scale (1,213 nodes) against a real redis-server
[group("bench")]
bench-cycle: sync
    uv run --frozen python services/scheduler/bench/bench_cycle.py

# Collector cost per sample: CPU per device and Redis round trips, 8 and 64 simulated devices
[group("bench")]
bench-collector: sync
    uv run --frozen python services/telemetry-collector/bench/bench_collector.py

# The scheduler default's knobs (learning window, rebuild period) against its allocation
[group("bench")]
bench-online-sensitivity *ARGS: sync
    uv run --frozen python bench/placement/bench_online_sensitivity.py {{ARGS}}

# The scheduler's own default placement on the trace (every pod, CPU-only included), beside FGD on the same arrivals
[group("bench")]
bench-scheduler-trace *ARGS: sync
    uv run --frozen python bench/placement/bench_scheduler_default.py {{ARGS}}

# Live replay of the default trace through the running services (one seed) beside the in-process run
[group("bench")]
bench-live POLICY="xpupool-online" SEED="42": sync
    uv run --frozen xpupool replay --live --policy {{POLICY}} --seeds {{SEED}}

# What CI runs
[group("tests")]
ci: test

# Autoscaled pools against fixed peak- and mean-sized ones on the trace's own arrivals (JSON)
[group("bench")]
bench-autoscale *ARGS: sync
    uv run --frozen python bench/autoscale/bench_autoscale.py {{ARGS}}

# End-to-end grants/s and latency against the floor of the same NATS and Redis (issue 14); --quick: smoke run
[group("bench")]
bench *ARGS: sync
    uv run --frozen python bench/e2e/bench_e2e.py {{ARGS}}

# The ledger's admission and end scripts inside Redis, and what their parts (calls, key names, JSON) cost
[group("bench")]
bench-scripts *ARGS: sync
    uv run --frozen python bench/e2e/script_costs.py {{ARGS}}

# A pair of acknowledged JetStream publishes: nats-py's publish_async against the bus's own acks
[group("bench")]
bench-acks *ARGS: sync
    uv run --frozen python bench/e2e/bench_acks.py {{ARGS}}

# Where one job's submit -> grant time goes, step by step, from the services' spans (issue 14)
[group("bench")]
bench-anatomy *ARGS: sync
    uv run --frozen python bench/e2e/anatomy.py {{ARGS}}

# Soak: the stack under load with faults injected, then the invariants checked (ten minutes)
[group("bench")]
soak *ARGS: sync
    uv run --frozen python bench/soak/soak.py {{ARGS}}
