"""Operating edges found in review, from pure logic alone (no servers): what a hostile tenant's
text does to the operator console, and the console's and usage report's options."""

from __future__ import annotations

import io

import msgspec
import pytest
from rich.console import Console

from xpupool.cli.console import (
    EventLine,
    Summary,
    event_line,
    events_table,
    format_line,
    pool_summary,
    queue_summary,
    summary_tables,
)
from xpupool.cli.main import build_parser
from xpupool.cli.usage import parse_duration, parse_time
from xpupool.contracts import DeviceSpec, Health, JobReason, JobRejected, JobRequested, Vendor
from xpupool.contracts.codec import describe_error
from xpupool.ledger.ledger import DeviceRecord, NodeRecord

#: A field name a tenant may put in its request: rich markup that closes a tag nobody opened,
#: then a terminal escape (OSC: set the window title) ended by BEL, then one that clears the
#: screen.
HOSTILE_FIELD = "[/x]\x1b]0;owned\x07\x1b[2J"


def _rejection_of_hostile_request() -> tuple[str, bytes]:
    """The operator copy of the rejection the scheduler answers a request with an unknown field
    named ``HOSTILE_FIELD``: the field's name comes back (clipped) in ``field_name`` and in the
    detail, as ``describe_error`` words msgspec's message."""
    body = msgspec.json.encode({"job_id": "j-1", HOSTILE_FIELD: 1})
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.json.decode(body, type=JobRequested)
    field_name, detail = describe_error(caught.value)
    rejected = JobRejected(
        job_id="j-1",
        tenant="mallory",
        field_name=field_name,
        reason=JobReason.INVALID_REQUEST,
        detail=detail,
    )
    return "xpupool.jobs.v1.rejected", msgspec.json.encode(rejected)


def test_top_renders_a_hostile_rejection_without_markup_or_escapes() -> None:
    """``xpupool top`` drew every cell as rich markup: a tenant that sent a request with an
    unknown field named ``[/x]`` made every operator's ``top`` die with a MarkupError (the
    rejection stays among the latest events it redraws), and an escape in the name reached
    the operator's terminal as it was."""
    line = event_line(*_rejection_of_hostile_request())
    assert "[/x]" in line.summary  # shown, not dropped
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=True).print(events_table([line]))
    drawn = out.getvalue()
    assert "[/x]" in drawn
    # rich's own styling is the only escape on the screen: the tenant's OSC and its clear-screen
    # are shown as text.
    assert "\x1b]" not in drawn and "\x1b[2J" not in drawn and "\x07" not in drawn


def test_events_prints_a_hostile_rejection_on_one_line_without_escapes() -> None:
    """``xpupool events`` on a terminal wrote the tenant's text raw: an escape sequence in a
    field name retitled or cleared the operator's terminal, a newline forged a line."""
    subject, data = _rejection_of_hostile_request()
    printed = format_line(event_line(subject, data))
    assert "\x1b" not in printed and "\x07" not in printed
    assert "[/x]" in printed and "\\x1b" in printed  # visible, escaped
    forged = msgspec.json.encode(
        {"type": "xpupool.job.rejected.v1", "job_id": "j", "detail": "x\n2099-01-01 alloc.granted"}
    )
    assert "\n" not in format_line(event_line(subject, forged))


def test_status_tables_take_names_as_text_not_markup() -> None:
    """A model a node registered and a queue name are printed as they are: ``[/x]`` in either
    made ``xpupool status`` (and ``top``) raise a MarkupError instead of drawing the pool."""
    spec = DeviceSpec(
        device_id="n/d0", vendor=Vendor.NVIDIA, model="A100[/x]", index=0, uuid="u", memory_mib=1
    )
    device = DeviceRecord(spec, "n", 1024, 1024, 100, 0, False, Health.HEALTHY, None, None)
    node = NodeRecord("n", "up", 0, 0, 0, 0, 0, {}, [device])
    summary = Summary(pool_summary([node]), queue_summary([], ["[bold]q"], 100))
    out = io.StringIO()
    Console(file=out, width=200).print(summary_tables(summary))
    assert "A100[/x]" in out.getvalue() and "[bold]q" in out.getvalue()
    table = events_table([EventLine("t", "x", "[red]", "", "", "", "s")])
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    assert "[red]" in out.getvalue()


def test_a_duration_too_long_to_count_is_refused_not_a_traceback() -> None:
    """``--since 1000…0d`` (more digits than a float holds) made ``parse_time`` raise an
    OverflowError, which ``xpupool usage`` does not catch: a traceback instead of its one-line
    ``not a duration`` error."""
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("9" * 400 + "d")
    with pytest.raises(ValueError, match="not a duration"):
        parse_time("9" * 400, 1_000_000)


@pytest.mark.parametrize(
    "argv",
    [
        ["events", "--limit", "0"],
        ["events", "--limit", "-3"],
        ["top", "--interval", "0"],
        ["top", "--interval", "-1"],
    ],
)
def test_console_counts_and_intervals_must_be_positive(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``events --limit 0`` printed every event it scanned (``lines[-0:]`` is the whole list) and
    ``--limit -3`` all but the oldest three; ``top --interval 0`` (or below) redrew without a
    pause, reading the whole ledger as fast as Redis answered. Refused as usage errors."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert "must be positive" in capsys.readouterr().err
