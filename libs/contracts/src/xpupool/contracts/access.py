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
  JetStream API only if it consumes a stream, and then never to delete or purge anything
  (``JS_API_DENIED``): a service answers a request on whatever reply subject the requester
  named, so a tenant could otherwise have a service's answer land on a purge of the streams;
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
# What no service does with the JetStream API, denied to every role that has it. A service
# answers a request by publishing on the request's reply subject, which the requester (a tenant)
# chooses and NATS does not check; with "$JS.API.>" allowed, a tenant asking for its own job list
# with the reply subject "$JS.API.STREAM.PURGE.XPUPOOL_TENANT_EVENTS" had the scheduler purge
# every tenant's events (a purge takes any body; deletes take the empty body of an error
# answer). Services create, update, read and pull; these are the rest of the API that changes or
# removes state, the account's and the cluster's included.
JS_API_DENIED: Final = (
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.PEER.>",
    "$JS.API.STREAM.LEADER.>",
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.API.CONSUMER.PAUSE.>",
    "$JS.API.CONSUMER.RESET.>",
    "$JS.API.CONSUMER.UNPIN.>",
    "$JS.API.CONSUMER.LEADER.>",
    "$JS.API.META.>",
    "$JS.API.SERVER.>",
    "$JS.API.ACCOUNT.>",
)


@dataclass(frozen=True)
class Permissions:
    """NATS allow lists: subjects (with wildcards) an identity may publish and subscribe to;
    ``publish_deny`` wins over ``publish`` (nats-server's ``deny``)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()


INBOX_PREFIX: Final = "_INBOX."
"""Where every NATS client makes its inboxes (nats-py, nats.go, nats.js, ... by default); the
secure stack's tenant and service prefixes are under it, and services answer requests there
only."""


def service_inbox(role: str) -> str:
    """The inbox prefix of a service (``inbox_prefix`` in nats-py)."""
    return f"{INBOX_PREFIX}svc.{role}"


def tenant_inbox(tenant: str) -> str:
    """The inbox prefix of a tenant; a separate level from services, so no name can collide."""
    return f"{INBOX_PREFIX}t.{tenant}"


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
                publish_deny=JS_API_DENIED,
            )
        case "lease-manager":
            return Permissions(
                publish=(
                    *_JS_API,
                    # Flow-control answers of its ordered consumer of the stored grants
                    # (grant_watch): refused, the server stops delivering to it for good.
                    f"$JS.FC.{s.EVENTS_STREAM.name}.>",
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
                publish_deny=JS_API_DENIED,
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
                publish_deny=JS_API_DENIED,
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
