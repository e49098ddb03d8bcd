"""Trace and catalogue files: what `manage.py plan` and `POST /api/plan/` read and
`export_trace` writes. Pure: text in, dataclasses out; no database."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core import autoscale
from scheduling.simulation.config import load
from scheduling.simulation.traces import (
    TraceFileError,
    TraceRow,
    build_trace,
    parse_arrival,
    parse_catalogue,
    parse_since,
    parse_trace,
    write_trace,
)

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=12)
# Microseconds since the epoch, as a trace file written to the microsecond holds them.
ARRIVALS = st.integers(min_value=0, max_value=4_000_000_000_000_000).map(lambda us: us / 1e6)
# One line of text: no character str.splitlines breaks at (controls, line and paragraph separators).
LINES = st.text(alphabet=st.characters(exclude_categories=("Cc", "Zl", "Zp", "Cs")), max_size=40)
ROWS = st.lists(
    st.builds(
        TraceRow,
        line=st.just(0),
        arrival_s=ARRIVALS,
        deployment=NAMES,
        prompt_tokens=st.integers(0, 10**6),
        output_tokens=st.integers(1, 10**6),
    ),
    max_size=30,
)


def same(a: TraceRow, b: TraceRow) -> bool:
    return (a.deployment, a.prompt_tokens, a.output_tokens) == (b.deployment, b.prompt_tokens, b.output_tokens) and abs(
        a.arrival_s - b.arrival_s
    ) < 1e-5


@settings(max_examples=60, deadline=None)
@given(rows=ROWS, fmt=st.sampled_from(["csv", "jsonl"]))
def test_a_written_trace_reads_back_as_the_same_requests_in_arrival_order(rows, fmt):
    out = io.StringIO()
    assert write_trace(rows, out, fmt=fmt) == len(rows)
    parsed = parse_trace(out.getvalue())  # the format is recognised from the text
    assert parsed.errors == ()
    # Sorted by arrival, ties in the order written (a stable sort, as the reader's by line).
    expected = sorted(rows, key=lambda r: r.arrival_s)
    assert len(parsed.rows) == len(expected)
    assert all(same(a, b) for a, b in zip(parsed.rows, expected, strict=True))


@settings(max_examples=80, deadline=None)
@given(
    moment=st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1)),
    offset_minutes=st.integers(-14 * 60, 14 * 60),
    style=st.sampled_from(["offset", "z", "naive", "space", "seconds"]),
)
def test_an_arrival_in_any_iso_format_or_in_seconds_is_the_same_instant(moment, offset_minutes, style):
    zone = timezone(timedelta(minutes=offset_minutes))
    aware = moment.replace(tzinfo=zone)
    expected = aware.timestamp()
    text = {
        "offset": aware.isoformat(),
        "z": aware.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "naive": aware.astimezone(UTC).replace(tzinfo=None).isoformat(),
        "space": aware.isoformat(sep=" "),
        "seconds": repr(expected),
    }[style]
    assert parse_arrival(text) == pytest.approx(expected, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(rows=ROWS.filter(bool), garbage=st.lists(LINES, min_size=1, max_size=5), data=st.data())
def test_malformed_rows_are_reported_with_their_line_numbers_and_the_good_ones_kept(rows, garbage, data):
    out = io.StringIO()
    write_trace(rows, out)
    lines = out.getvalue().splitlines()
    inserted: dict[int, str] = {}
    for text in garbage:
        line = text
        if not line.strip():
            continue
        position = data.draw(st.integers(1, len(lines)))  # after the header
        lines.insert(position, line)
        inserted = {(n + 1 if n > position else n): t for n, t in inserted.items()}
        inserted[position + 1] = line
    parsed = parse_trace("\n".join(lines), fmt="csv")
    # Each inserted line is either an error on its own line number or, by chance, a valid row.
    flagged = {e.line for e in parsed.errors}
    assert flagged <= set(inserted)
    assert len(parsed.rows) + len(parsed.errors) == len(rows) + len(inserted)


def test_a_row_with_an_unknown_deployment_is_reported_with_its_line_number():
    text = "arrival,deployment,prompt_tokens,output_tokens\n0,a,10,5\n1.5,ghost,10,5\n2,a,10,5\n"
    parsed = parse_trace(text, known={"a"})
    assert [str(e) for e in parsed.errors] == ["line 3: unknown deployment 'ghost' (not in the catalogue)"]
    assert [r.line for r in parsed.rows] == [2, 4]


def test_each_kind_of_bad_row_says_what_is_wrong_with_it():
    text = "\n".join(
        [
            '{"arrival": "2026-11-25T17:36:13Z", "deployment": "a", "prompt_tokens": 3, "output_tokens": 2}',
            '{"arrival": "yesterday", "deployment": "a", "prompt_tokens": 3, "output_tokens": 2}',
            '{"arrival": 1, "deployment": "a", "prompt_tokens": -1, "output_tokens": 2}',
            '{"arrival": 1, "deployment": "a", "prompt_tokens": 3, "output_tokens": 0}',
            '{"arrival": 1, "deployment": "a", "prompt_tokens": 3}',
            "[1, 2]",
            "{not json",
            "",
            '{"arrival": 1e400, "deployment": "a", "prompt_tokens": 3, "output_tokens": 2.5}',
        ]
    )
    parsed = parse_trace(text)
    assert [r.line for r in parsed.rows] == [1]
    messages = {e.line: e.message for e in parsed.errors}
    assert "neither seconds nor an ISO 8601 timestamp" in messages[2]
    assert "prompt_tokens -1 is below 0" in messages[3]
    assert "output_tokens 0 is below 1" in messages[4]
    assert messages[5] == "no output_tokens"
    assert "not an object" in messages[6] and "not JSON" in messages[7]
    assert 8 not in messages and 9 in messages


def test_a_csv_without_the_columns_names_what_it_lacks():
    parsed = parse_trace("time,model\n1,a\n", fmt="csv")
    assert parsed.rows == () and "lacks arrival, deployment, prompt_tokens, output_tokens" in str(parsed.errors[0])


def test_since_reads_durations_and_times():
    now = datetime(2026, 11, 25, 12, tzinfo=UTC)
    assert parse_since("7d", now) == now - timedelta(days=7)
    assert parse_since("90s", now) == now - timedelta(seconds=90)
    assert parse_since("2026-11-20T00:00:00", now) == datetime(2026, 11, 20, tzinfo=UTC)
    with pytest.raises(ValueError, match="neither a duration"):
        parse_since("last week", now)


def test_a_catalogue_resolves_shapes_bytes_and_settings_and_the_trace_starts_at_its_first_arrival():
    catalogue = parse_catalogue(
        json.dumps(
            {
                "deployments": [
                    {"name": "a", "size": "7B", "popular": True},
                    {"name": "b", "weight_bytes": 2_000_000_000, "need_bytes": 3_000_000_000, "wake_s": 0.3},
                    {
                        "name": "c",
                        "dtype": "float16",
                        "max_wait_s": 2,
                        "idle_timeout_s": 0,
                        "dedicated": True,
                        "shape": {
                            "params_b": 1.5,
                            "layers": 28,
                            "hidden": 1536,
                            "kv_heads": 2,
                            "head_dim": 128,
                            "intermediate": 8960,
                        },
                    },
                ]
            }
        )
    )
    config = load(quick=True)
    rows = parse_trace("arrival,deployment,prompt_tokens,output_tokens\n100,a,5,5\n104,b,5,5\n110,a,5,5\n").rows
    trace = build_trace(rows, catalogue, config)
    by_name = {d.name: d for d in trace.deployments}
    assert [r.arrival_s for r in trace.requests] == [0.0, 4.0, 10.0]
    assert trace.duration_s == 10.0
    assert by_name["a"].popular and by_name["a"].rate_per_s == pytest.approx(0.2)
    assert by_name["b"].estimate_bytes == 3_000_000_000 and by_name["b"].wake_s == 0.3
    assert by_name["c"].dedicated and by_name["c"].idle_timeout_s == 0 and by_name["c"].rate_per_s == 0


def test_a_catalogue_with_bad_entries_names_each():
    with pytest.raises(TraceFileError) as caught:
        parse_catalogue(
            json.dumps(
                [
                    {"name": "a", "size": "7B", "colour": "red"},
                    {"name": "b"},
                    {"name": "c", "size": "7B", "weight_bytes": 5},
                    {"name": "d", "size": "7B", "max_wait_s": -1},
                    {"name": "e", "size": "7B"},
                    {"name": "e", "size": "3B"},
                ]
            )
        )
    errors = caught.value.errors
    assert len(errors) == 5
    assert "unknown keys ['colour']" in errors[0] and "exactly one of size" in errors[1]
    assert "exactly one of size" in errors[2] and "max_wait_s" in errors[3] and "listed twice" in errors[4]


def test_a_catalogue_gives_replicas_and_autoscale_as_a_deployments_body_does_and_writes_them_back():
    catalogue = parse_catalogue(
        json.dumps(
            [
                {"name": "a", "size": "7B", "replicas": 2, "autoscale": {"max_replicas": 6, "target_in_flight": 8}},
                {"name": "b", "size": "7B", "autoscale": {"max_replicas": 0}},
                {"name": "c", "size": "7B"},
            ]
        )
    )
    a, b, c = build_trace([], catalogue, load(quick=True)).deployments
    # The settings a body leaves out default as a deployment's do (deployment_spec).
    assert a.replicas == 2 and a.autoscale == autoscale.Policy(1, 6, 8.0, 300.0)
    assert b.autoscale is None and c.autoscale is None and b.replicas == c.replicas == 1
    assert parse_catalogue(json.dumps([e.to_record() for e in catalogue])) == catalogue
    assert "replicas" not in catalogue[2].to_record() and "autoscale" not in catalogue[2].to_record()


def test_a_catalogues_bad_replicas_and_autoscale_are_named():
    with pytest.raises(TraceFileError) as caught:
        parse_catalogue(
            json.dumps(
                [
                    {"name": "a", "size": "7B", "replicas": 0},
                    {"name": "b", "size": "7B", "autoscale": {"max_replicas": 2, "min_replicas": 3}},
                    {"name": "c", "size": "7B", "autoscale": {"max_replicas": 2, "target_in_flight": 0}},
                    {"name": "d", "size": "7B", "autoscale": {"max_replicas": 2, "up_after_s": 1}},
                    {"name": "e", "size": "7B", "autoscale": 4},
                    {"name": "f", "size": "7B", "autoscale": {"max_replicas": 100_000}},
                ]
            )
        )
    errors = caught.value.errors
    assert len(errors) == 6
    assert "replicas must be a whole number from 1 to 1024, got 0" in errors[0]
    assert "autoscale.min_replicas must be at most autoscale.max_replicas (2), got 3" in errors[1]
    assert "autoscale.target_in_flight must be from 0.1 to 10000, got 0" in errors[2]
    assert "autoscale: unknown keys ['up_after_s']" in errors[3]
    assert "autoscale must be an object" in errors[4]
    assert "autoscale.max_replicas must be from 0 to 1024" in errors[5]
