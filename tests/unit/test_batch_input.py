"""Bad input to a batch: every line gives a record or a one-line BAD_RECORD reason, by its
line number; never a crash, a hang, or the whole source in memory."""

from __future__ import annotations

import io
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from tests.workflow.test_batch_run import MemoryS3
from warmloop.activities import batch as batch_io
from warmloop.activities.batch import BatchActivities
from warmloop.workflows.batch_run import ReadPageRequest, ReadPageResult

GOOD = {"ticket_id": "T1001", "customer_id": "C100", "subject": "s", "body": "b"}


def good(i: int = 0, **fields: Any) -> bytes:
    return json.dumps({**GOOD, "ticket_id": f"T{1000 + i}", **fields},
                      ensure_ascii=False).encode()


def activities(tmp_path: Path, s3: Any = None) -> BatchActivities:
    return BatchActivities(s3 or MemoryS3(), "b", inputs=[str(tmp_path), "s3://b"])


async def read(acts: BatchActivities, source: str | Path, *, profile: str = "ticket-triage",
               offset: int = 0, first_line: int = 1, limit: int = 100) -> ReadPageResult:
    req = ReadPageRequest(source=str(source), profile=profile, offset=offset,
                          first_line=first_line, limit=limit)
    return await ActivityEnvironment().run(acts.read_records, req)


async def read_all(acts: BatchActivities, source: str | Path, *, limit: int = 100,
                   profile: str = "ticket-triage") -> list[ReadPageResult]:
    pages = [await read(acts, source, limit=limit, profile=profile)]
    while not pages[-1].exhausted:
        last = pages[-1]
        pages.append(await read(acts, source, offset=last.next_offset,
                                first_line=last.next_line, limit=limit, profile=profile))
    return pages


def write(tmp_path: Path, *lines: bytes, end: bytes = b"\n") -> Path:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(line + end for line in lines))
    return src


def bad_by_line(page: ReadPageResult) -> dict[int, str]:
    assert all(b.state == "BAD_RECORD" for b in page.bad)
    return {b.line: b.reason for b in page.bad}


async def test_invalid_utf8_is_a_bad_record_by_line_number(tmp_path: Path) -> None:
    src = write(tmp_path, good(1), b'{"ticket_id": "\xff\xfe"}', good(3))
    page = await read(activities(tmp_path), src)
    assert [r.line for r in page.records] == [1, 3]
    assert "UTF-8" in bad_by_line(page)[2]


async def test_a_bom_before_the_first_record_is_not_part_of_it(tmp_path: Path) -> None:
    src = write(tmp_path, b"\xef\xbb\xbf" + good(1), good(2))
    page = await read(activities(tmp_path), src)
    assert [r.line for r in page.records] == [1, 2] and not page.bad


async def test_crlf_line_ends_end_one_record_each(tmp_path: Path) -> None:
    src = write(tmp_path, good(1), good(2), b"", good(4), end=b"\r\n")
    page = await read(activities(tmp_path), src)
    assert [r.line for r in page.records] == [1, 2, 4] and not page.bad
    assert page.exhausted


async def test_u2028_inside_a_json_string_stays_in_its_record(tmp_path: Path) -> None:
    body = "first\u2028second\u2029third\x85fourth\x0bfifth\x1cend"
    src = write(tmp_path, good(1, body=body), good(2))
    page = await read(activities(tmp_path), src)
    assert [r.line for r in page.records] == [1, 2] and not page.bad
    assert page.records[0].task["body"] == body


async def test_a_50_mb_line_is_refused_by_the_line_cap_without_being_held(
    tmp_path: Path,
) -> None:
    src = tmp_path / "in.jsonl"
    with src.open("wb") as f:
        f.write(good(1) + b"\n")
        f.write(b'{"ticket_id": "T2000", "customer_id": "C1", "subject": "s", "body": "')
        chunk = b"x" * (1 << 20)
        for _ in range(50):
            f.write(chunk)
        f.write(b'"}\n' + good(3) + b"\n")
    tracemalloc.start()
    try:
        page = await read(activities(tmp_path), src)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [r.line for r in page.records] == [1, 3]
    assert "longer than" in bad_by_line(page)[2]
    assert peak < 8 << 20, f"peak {peak >> 20} MiB while reading a 50 MiB line"


async def test_100000_deep_nesting_is_a_bad_record(tmp_path: Path) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    deep_obj = b'{"a": ' * 30_000 + b"1" + b"}" * 30_000
    src = write(tmp_path, deep, good(2), deep_obj, b"[" * 100_000)
    page = await read(activities(tmp_path), src)
    assert [r.line for r in page.records] == [2]
    bad = bad_by_line(page)
    assert sorted(bad) == [1, 3, 4]
    assert "nested" in bad[1] and "nested" in bad[3]


async def test_a_million_short_lines_are_read_page_by_page_from_byte_offsets(
    tmp_path: Path,
) -> None:
    """Every 1000th line is a task, the rest are short non-records: each page reads
    from its byte offset to its end (one read-ahead chunk more), never the source."""
    lines = [good(n // 1000) if n % 1000 == 0 else (b"" if n % 2 else b"  ")
             for n in range(1, 1_000_001)]
    data = b"\n".join(lines) + b"\n"
    s3 = MemoryS3({"b/million.jsonl": data})
    acts = activities(tmp_path, s3)
    offset, line, records, pages = 0, 1, 0, 0
    while True:
        before = s3.bytes_read
        page = await read(acts, "s3://b/million.jsonl", offset=offset, first_line=line,
                          limit=10_000)
        pages += 1
        assert page.next_line - line <= 10_000
        assert s3.bytes_read - before <= page.next_offset - offset + batch_io.READ_CHUNK
        assert all(r.line % 1000 == 0 for r in page.records) and not page.bad
        records += len(page.records)
        offset, line = page.next_offset, page.next_line
        if page.exhausted:
            break
    assert (records, pages, line, offset) == (1000, 100, 1_000_001, len(data))


async def test_a_page_holds_at_most_page_bytes_of_records(tmp_path: Path) -> None:
    """Pages stay far below Temporal's 2 MB payload limit whatever the page size: 1,000
    tickets of 4,000 characters each are 4 MB."""
    big = [good(i, body="y" * 4000) for i in range(1000)]
    src = write(tmp_path, *big)
    pages = await read_all(activities(tmp_path), src, limit=1000)
    assert len(pages) >= 4
    for page in pages:
        assert len(page.model_dump_json()) <= batch_io.PAGE_BYTES + 64 * 1024
    assert [r.line for p in pages for r in p.records] == list(range(1, 1001))


async def test_an_unknown_profile_makes_each_line_a_bad_record(tmp_path: Path) -> None:
    src = write(tmp_path, good(1), b"", good(3))
    page = await read(activities(tmp_path), src, profile="no-such-profile")
    assert not page.records
    bad = bad_by_line(page)
    assert sorted(bad) == [1, 3] and all("no-such-profile" in r for r in bad.values())


@pytest.mark.parametrize("source", ["/etc/passwd", "/dev/zero", "/proc/self/environ",
                                    "file:///etc/passwd", "s3://b", "s3://other/k.jsonl"])
async def test_sources_outside_the_allowed_locations_are_refused(tmp_path: Path,
                                                                 source: str) -> None:
    with pytest.raises(ApplicationError) as err:
        await read(activities(tmp_path), source)
    assert err.value.type == "SourceRefused" and err.value.non_retryable
    assert "\n" not in str(err.value)


async def test_links_and_dot_dots_out_of_an_allowed_folder_are_refused(
    tmp_path: Path,
) -> None:
    allowed = tmp_path / "in"
    allowed.mkdir()
    (allowed / "passwd.jsonl").symlink_to("/etc/passwd")
    os.mkfifo(allowed / "fifo.jsonl")
    acts = BatchActivities(MemoryS3(), "b", inputs=[str(allowed)])
    sources: list[str | Path] = [allowed / "passwd.jsonl", f"{allowed}/../in/../../x.jsonl",
                                 allowed / "fifo.jsonl", allowed]
    for source in sources:
        with pytest.raises(ApplicationError) as err:
            await read(acts, source)
        assert err.value.type == "SourceRefused", source


async def test_a_missing_source_is_permanent_and_s3_downtime_is_retried(
    tmp_path: Path,
) -> None:
    acts = activities(tmp_path, MemoryS3(down_for=1))
    with pytest.raises(ApplicationError) as err:
        await read(acts, "s3://b/absent.jsonl")
    assert err.value.type == "SourceUnavailable" and not err.value.non_retryable
    for source in ["s3://b/absent.jsonl", str(tmp_path / "absent.jsonl")]:
        with pytest.raises(ApplicationError) as err:
            await read(acts, source)
        assert err.value.type == "SourceMissing" and err.value.non_retryable


async def test_an_empty_source_and_a_last_line_without_newline(tmp_path: Path) -> None:
    s3 = MemoryS3({"b/empty.jsonl": b"", "b/tail.jsonl": good(1) + b"\n" + good(2)})
    acts = activities(tmp_path, s3)
    empty = await read(acts, "s3://b/empty.jsonl")
    assert empty.exhausted and not empty.records and not empty.bad
    pages = await read_all(acts, "s3://b/tail.jsonl", limit=1)
    assert [r.line for p in pages for r in p.records] == [1, 2]


# ---- properties of the line reader ----------------------------------------------------


def read_bytes(data: bytes, *, max_lines: int = 10_000) -> ReadPageResult:
    return batch_io.read_page(io.BytesIO(data), profile="ticket-triage", offset=0,
                              first_line=1, max_lines=max_lines, size=len(data))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(min_size=1, max_size=300), min_size=1, max_size=5))
def test_text_in_a_json_string_never_splits_its_record(bodies: list[str]) -> None:
    data = b"".join(good(i, body=b) + b"\n" for i, b in enumerate(bodies))
    page = read_bytes(data)
    assert not page.bad
    assert [r.task["body"] for r in page.records] == bodies


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"")),
                          st.sampled_from([b"", b"\r", b"\xef\xbb\xbf", b"[" * 5000,
                                           good(), b"\xef\xbb\xbf" + good(), good() + b"\r",
                                           b"NaN", b"1e999999", b"9" * 5000])),
                max_size=30),
       st.integers(min_value=1, max_value=7))
def test_any_bytes_give_one_outcome_per_line_by_number(lines: list[bytes],
                                                       page_lines: int) -> None:
    """Paged at any size, every non-blank line gives exactly one record or BAD_RECORD
    with a one-line reason, and the pages cover the source exactly."""
    data = b"".join(line + b"\n" for line in lines)
    offset, first, seen = 0, 1, []
    for _ in range(len(lines) + 1):
        stream = io.BytesIO(data)
        stream.seek(offset)
        page = batch_io.read_page(stream, profile="ticket-triage", offset=offset,
                                  first_line=first, max_lines=page_lines, size=len(data))
        for b in page.bad:
            assert b.state == "BAD_RECORD" and "\n" not in b.reason and len(b.reason) <= 300
        seen += [r.line for r in page.records] + [b.line for b in page.bad]
        offset, first = page.next_offset, page.next_line
        if page.exhausted:
            break
    assert page.exhausted and offset == len(data) and first == len(lines) + 1
    # blank: JSON whitespace only (a BOM counts as nothing on the first line)
    nonblank = [n for n, line in enumerate(lines, 1)
                if line.removeprefix(b"\xef\xbb\xbf" if n == 1 else b"").strip(b" \t\r")]
    assert sorted(seen) == nonblank


async def test_a_resumed_read_must_start_at_a_line(tmp_path: Path) -> None:
    """A batch resumed from another's result reads from its next_offset: the byte
    before it must end a line (an offset into a line, or a source changed since, is
    refused, not read as garbled records); the source's end is an empty page."""
    from temporalio.exceptions import ApplicationError

    src = write(tmp_path, good(0), good(1), good(2))
    first = len(good(0)) + 1
    acts = activities(tmp_path)
    page = await read(acts, src, offset=first, first_line=2)
    assert [r.line for r in page.records] == [2, 3] and not page.bad
    assert page.records[0].task["ticket_id"] == "T1001"
    with pytest.raises(ApplicationError) as err:
        await read(acts, src, offset=first + 3, first_line=2)
    assert err.value.type == "SourceRefused" and "does not start line 2" in err.value.message
    end = await read(acts, src, offset=src.stat().st_size, first_line=4)
    assert (end.records, end.exhausted) == ([], True)
    s3 = MemoryS3({"b/in.jsonl": src.read_bytes()})
    over_s3 = activities(tmp_path, s3)
    assert [r.line for r in (await read(over_s3, "s3://b/in.jsonl", offset=first,
                                        first_line=2)).records] == [2, 3]
    with pytest.raises(ApplicationError, match="does not start line 2"):
        await read(over_s3, "s3://b/in.jsonl", offset=first - 1, first_line=2)


def test_a_batch_starts_at_a_line_and_its_offset_together() -> None:
    from pydantic import ValidationError

    from warmloop.workflows.batch_run import BatchInput

    BatchInput(profile="ticket-triage", source="s3://b/k", start_line=3, start_offset=40)
    for bad in ({"start_line": 3}, {"start_offset": 40}):
        with pytest.raises(ValidationError, match="go together"):
            BatchInput(profile="ticket-triage", source="s3://b/k", **bad)  # type: ignore[arg-type]


def test_a_batch_inputs_new_fields_leave_the_payload_at_their_defaults() -> None:
    """BatchInput forbids extra fields: a worker from before start_line, start_offset,
    submitted_by, tenant and skip_lines must still read a batch that sets none of them
    (a rolling deploy)."""
    from warmloop.workflows.batch_run import BatchInput

    plain = json.loads(BatchInput(profile="ticket-triage", source="s3://b/k").model_dump_json())
    assert not {"start_line", "start_offset", "submitted_by", "tenant", "skip_lines"} & set(plain)
    given = json.loads(BatchInput(profile="ticket-triage", source="s3://b/k", start_line=3,
                                  start_offset=9, tenant="acme", submitted_by="ann",
                                  skip_lines=[4]).model_dump_json())
    assert (given["start_line"], given["start_offset"], given["tenant"],
            given["submitted_by"], given["skip_lines"]) == (3, 9, "acme", "ann", [4])


async def test_a_tenants_batch_reads_only_its_own_area_of_warmloops_bucket(
        tmp_path: Path) -> None:
    """warmloop's bucket holds every tenant's transcripts and results: a batch of
    tenant acme reads there only under tenants/acme/, a default-tenant batch nothing
    under tenants/; other allowed buckets are the operator's to share."""
    from temporalio.exceptions import ApplicationError

    data = good(0) + b"\n"
    s3 = MemoryS3({"b/tenants/acme/in.jsonl": data, "b/tenants/globex/t.json": data,
                   "b/in.jsonl": data, "shared/in.jsonl": data})
    acts = BatchActivities(s3, "b", inputs=[str(tmp_path), "s3://b", "s3://shared"])

    async def lines(source: str, tenant: str) -> list[int]:
        req = ReadPageRequest(source=source, profile="ticket-triage", first_line=1,
                              limit=10, tenant=tenant)
        page = await ActivityEnvironment().run(acts.read_records, req)
        return [r.line for r in page.records]

    assert await lines("s3://b/tenants/acme/in.jsonl", "acme") == [1]
    assert await lines("s3://b/in.jsonl", "default") == [1]
    assert await lines("s3://shared/in.jsonl", "acme") == [1]
    for source, tenant in (("s3://b/tenants/globex/t.json", "acme"),
                           ("s3://b/in.jsonl", "acme"),
                           ("s3://b/tenants/acme/in.jsonl", "default")):
        with pytest.raises(ApplicationError) as err:
            await lines(source, tenant)
        assert err.value.type == "SourceRefused" and err.value.non_retryable, source


async def test_a_page_says_whether_its_tenants_jobs_claim_slots(tmp_path: Path) -> None:
    """The reader's worker knows the tenants' quotas: a page of a tenant with one (of
    either kind) asks its jobs to claim a slot first; a tenant without one, or the
    default tenant without one, does not."""
    from warmloop.workflows.tenants import TenantQuota

    src = tmp_path / "tickets.jsonl"
    src.write_bytes(good(0) + b"\n")
    acts = BatchActivities(MemoryS3(), "b", inputs=[str(tmp_path)], quotas={
        "acme": TenantQuota(max_jobs_in_flight=2), "spendy": TenantQuota(tokens_per_hour=9)})

    async def asks(tenant: str) -> bool:
        req = ReadPageRequest(source=str(src), profile="ticket-triage", first_line=1,
                              limit=10, tenant=tenant)
        page = await ActivityEnvironment().run(acts.read_records, req)
        assert len(page.records) == 1
        return page.ask_quota

    assert [await asks(t) for t in ("acme", "spendy", "globex", "default")] == [
        True, True, False, False]
