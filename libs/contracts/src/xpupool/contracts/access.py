"""Who may publish and subscribe what: the NATS permissions of every identity, declared once.

Derived from the subject registry, so a subject and the right to use it cannot drift apart. The
secure configuration (``xpupool.devstack.secure``) turns these into the server's ``authorization``
block; the README's "Security model" section is this table in prose.

Identities:

- a **tenant** publishes only its own commands (``xpupool.tenant.v1.<tenant>.jobs.>``,
  ``….leases.>``) and subscribes only to its own events and inbox. It gets no JetStream API
  (no stream or consumer administration): a JetStream publish needs none, and its events reach
  it over a plain subscription;
- each **service** publishes its own families and reads what it consumes, and uses the
  JetStream API only if it consumes a stream;
- the **operator** (the CLI's operator commands, fault injection, tests' observers) may do all.

Every identity uses its own inbox prefix, so no identity can read another's replies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from xpupool.contracts import subjects as s

SCHEDULER: Final = "scheduler"
LEASE_MANAGER: Final = "lease-manager"
TELEMETRY_COLLECTOR: Final = "telemetry-collector"
AUTOSCALER: Final = "autoscaler"
OPERATOR: Final = "operator"
SERVICE_ROLES: Final = (SCHEDULER, LEASE_MANAGER, TELEMETRY_COLLECTOR, AUTOSCALER, OPERATOR)

_JS_API: Final = ("$JS.API.>", "$JS.ACK.>")


@dataclass(frozen=True)
class Permissions:
    """NATS allow lists: subjects (with wildcards) an identity may publish and subscribe to."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def service_inbox(role: str) -> str:
    """The inbox prefix of a service (``inbox_prefix`` in nats-py)."""
    return f"_INBOX.svc.{role}"


def tenant_inbox(tenant: str) -> str:
    """The inbox prefix of a tenant; a separate level from services, so no name can collide."""
    return f"_INBOX.t.{tenant}"


def _tenant_events(*events: str) -> tuple[str, ...]:
    return tuple(f"{s.TENANT_SPACE}.*.events.{e}" for e in events)


def service_permissions(role: str) -> Permissions:
    """The permissions of one service role (or the operator)."""
    inbox = f"{service_inbox(role)}.>"
    match role:
        case "scheduler":
            return Permissions(
                publish=(
                    *_JS_API,
                    "xpupool.jobs.v1.>",
                    "xpupool.sched.v1.>",
                    # The grants it makes on admission (handlers.publish_grants).
                    s.ALLOC_GRANTED.address,
                    *_tenant_events("granted", "rejected", "pending", "timed_out", "cancelled"),
                    # Replies to submit, cancel and list requests go to the requester's inbox,
                    # whoever it is.
                    "_INBOX.>",
                ),
                subscribe=(
                    inbox,
                    s.JOB_SUBMIT.pattern,
                    s.JOB_CANCEL.pattern,
                    s.JOB_LIST.pattern,
                    s.ALLOC_ENDED.pattern,
                    s.NODE_REGISTERED.address,
                    s.DEVICE_HEALTH.address,
                    # Incoming capacity: the jobs the autoscaler's nodes are for.
                    s.SCALE_PROVISIONING.address,
                    s.SCALE_READY.address,
                ),
            )
        case "lease-manager":
            return Permissions(
                publish=(
                    *_JS_API,
                    "xpupool.alloc.v1.>",
                    s.NODE_LOST.address,
                    *_tenant_events("granted", "renewed", "ending", "ended.>"),
                    # Replies to lease commands go to the requester's inbox, whoever it is.
                    "_INBOX.>",
                ),
                subscribe=(
                    inbox,
                    s.LEASE_RENEW.pattern,
                    s.LEASE_RELEASE.pattern,
                    s.LEASE_GET.pattern,
                    s.LEASE_LIST.pattern,
                ),
            )
        case "telemetry-collector":
            return Permissions(
                publish=(
                    s.TELEMETRY.pattern,
                    s.NODE_HEARTBEAT.pattern,
                    s.NODE_REGISTERED.address,
                    "xpupool.devices.v1.>",
                ),
                subscribe=(inbox, s.SIM_FAULT.pattern),
            )
        case "autoscaler":
            return Permissions(
                # Its events are JetStream publishes (XPUPOOL_EVENTS): the API for the acks.
                # EndLease: a drain that preempts asks the lease-manager, as the scheduler does.
                publish=(*_JS_API, "xpupool.scale.v1.>", s.LEASE_END.address),
                subscribe=(
                    inbox,
                    s.NODE_REGISTERED.address,
                    s.NODE_LOST.address,
                    s.TELEMETRY.pattern,
                ),
            )
        case "operator":
            return Permissions(publish=(">",), subscribe=(">",))
    raise ValueError(f"unknown service role {role!r}; known: {', '.join(SERVICE_ROLES)}")


def tenant_permissions(tenant: str) -> Permissions:
    """The permissions of one tenant: its own commands out, its own events and replies in."""
    if not s.TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"{tenant!r} is not a valid tenant name ({s.TENANT_NAME.pattern})")
    space = f"{s.TENANT_SPACE}.{tenant}"
    return Permissions(
        publish=(f"{space}.jobs.>", f"{space}.leases.>"),
        subscribe=(f"{space}.events.>", f"{tenant_inbox(tenant)}.>"),
    )
