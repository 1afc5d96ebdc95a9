#!/usr/bin/env python3
"""An example command for the autoscaler's ``exec`` provider (standard library only).

It "provisions" nodes by writing them into a JSON state file, which is where a real tool would
call its cloud's or its bare-metal manager's API. The protocol (one JSON request on stdin, one
JSON answer on stdout) is documented in ``xpupool.autoscaler.providers.exec``. Use it from the
pool file::

    provider:
      type: exec
      command: [python3, deploy/autoscaler/exec-provider-example.py, --state, /var/lib/pool.json]
      options: {ready_after_s: 0}

What it shows:

- **idempotency by request id**: the state keeps every request id it carried out with the nodes
  it concerned; the same id again changes nothing and answers ``"already_applied": true``;
- a refusal (``"ok": false`` with an ``error``) when an add would exceed ``max_size``;
- node ids the collectors would register with (``<pool>-<n>``), ``provisioning`` until
  ``options.ready_after_s`` has passed, then ``ready``;
- a lock on the state file, so two autoscaler replicas cannot interleave.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from typing import Any


def answer(ok: bool, **fields: Any) -> int:
    json.dump({"ok": ok, **fields}, sys.stdout)
    sys.stdout.write("\n")
    return 0


def node_view(node: dict[str, Any], ready_after_s: float, now: float) -> dict[str, Any]:
    state = node["state"]
    if state == "provisioning" and now - node["created_at"] >= ready_after_s:
        state = "ready"
    elif state == "removed":  # given back: the protocol says "removing" (on its way out)
        state = "removing"
    return {"node_id": node["node_id"], "state": state, "request_id": node["request_id"]}


def handle(request: dict[str, Any], state: dict[str, Any]) -> int:
    pool = request["pool"]["name"]
    options = request.get("options") or {}
    ready_after_s = float(options.get("ready_after_s", 0))
    now = time.time()
    nodes = state.setdefault("pools", {}).setdefault(pool, {})
    requests = state.setdefault("requests", {})
    action, request_id = request["action"], request.get("request_id", "")
    live = [n for n in nodes.values() if n["state"] != "removed"]

    if action == "list":
        return answer(True, nodes=[node_view(n, ready_after_s, now) for n in live])

    if request_id in requests:  # a retry or a replica taking over: change nothing
        done = requests[request_id]
        concerned = [node_view(nodes[i], ready_after_s, now) for i in done["node_ids"]]
        return answer(True, nodes=concerned, target_size=done["target_size"], already_applied=True)

    if action == "add":
        count = int(request["count"])
        if len(live) + count > request["pool"]["max_size"]:
            return answer(
                False,
                error=f"pool {pool} has {len(live)} nodes; {count} more exceed max_size "
                f"{request['pool']['max_size']}",
            )
        added = []
        for _ in range(count):
            state["serial"] = state.get("serial", 0) + 1
            node_id = f"{pool}-{state['serial']}"
            nodes[node_id] = {
                "node_id": node_id,
                "state": "provisioning",
                "request_id": request_id,
                "created_at": now,
            }
            added.append(node_id)
        target = len(live) + count
        requests[request_id] = {"node_ids": added, "target_size": target}
        concerned = [node_view(nodes[i], ready_after_s, now) for i in added]
        return answer(True, nodes=concerned, target_size=target)

    if action == "remove":
        removed = [i for i in request.get("node_ids", []) if i in nodes]
        for node_id in removed:
            nodes[node_id]["state"] = "removed"
        target = len(live) - sum(1 for n in live if n["node_id"] in removed)
        requests[request_id] = {"node_ids": removed, "target_size": target}
        concerned = [{"node_id": i, "state": "removing", "request_id": request_id} for i in removed]
        return answer(True, nodes=concerned, target_size=target)

    return answer(False, error=f"unknown action {action!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--state",
        default=os.environ.get("XPUPOOL_EXEC_EXAMPLE_STATE", "exec-provider-state.json"),
        help="the JSON state file (created if missing)",
    )
    args = parser.parse_args()
    try:
        request = json.load(sys.stdin)
    except json.JSONDecodeError as exc:
        print(f"stdin is not JSON: {exc}", file=sys.stderr)
        return 2
    if request.get("version") != 1:
        print(f"unsupported protocol version {request.get('version')!r}", file=sys.stderr)
        return 2
    with open(args.state, "a+", encoding="utf-8") as handle_file:
        fcntl.flock(handle_file, fcntl.LOCK_EX)
        handle_file.seek(0)
        text = handle_file.read()
        state = json.loads(text) if text.strip() else {}
        status = handle(request, state)
        handle_file.seek(0)
        handle_file.truncate()
        json.dump(state, handle_file, indent=1, sort_keys=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
