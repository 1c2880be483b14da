"""Batch I/O: read a page of task records (file or S3) from a byte offset, write a page
of outcomes.

A page is streamed from its byte offset, so no page reads what an earlier one did and
none holds the source: lines end at ``\\n`` only (a JSON string may hold U+2028, U+0085,
a form feed; ``str.splitlines`` would cut the record there), a line longer than
``MAX_LINE_BYTES`` is skipped by the chunk without being held, and a page stops at
``max_lines`` lines, ``PAGE_BYTES`` of records or ``SCAN_BYTES`` read, whichever comes
first (its result is a Temporal payload: 2 MB at most). A bad line is a ``BAD_RECORD``
with its line number and a one-line reason; only the source itself can fail a read:
refused (outside the allowed locations, not a regular file), missing (both permanent),
or unreachable (retried by the workflow's retry policy).
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import ValidationError
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from urllib3.exceptions import HTTPError

from warmloop.activities.batch_recovery import (
    JobGone,
    JobsStillStopping,
    StoppedPage,
    stopped_page,
)
from warmloop.workflows.batch_run import (
    ReadPageRequest,
    ReadPageResult,
    RecordOutcome,
    RecoverPageRequest,
    TaskRecord,
    WritePageRequest,
    one_line,
    page_key,
)
from warmloop.workflows.profiles import UnknownProfileError, get_profile
from warmloop.workflows.profiles.base import Profile, first_error
from warmloop.workflows.tenants import DEFAULT_TENANT, TenantQuota, s3_prefix

READ_CHUNK = 64 * 1024
"""Bytes read at a time: with one line in hand, all a reader holds of the source."""
MAX_LINE_BYTES = 256 * 1024
"""A longer line is a BAD_RECORD, skipped unread: a task is a few KB, and every record
travels in Temporal payloads (the page, the child job's input)."""
PAGE_BYTES = 1024 * 1024
"""Records (and reasons) per page, in bytes: half of Temporal's 2 MB payload limit."""
SCAN_BYTES = 64 * 1024 * 1024
"""Bytes one page may read (skipped long lines included): a page ends within its
activity's timeout whatever the source holds."""
MAX_DEPTH = 64
"""Deepest nesting of a task: a deeper one is a BAD_RECORD (so is one past json's own
recursion limit), before validation or a payload converter recurses on it."""

_BOM = b"\xef\xbb\xbf"
_JSON_SPACE = b" \t\r"
"""A line of only these is blank (skipped silently); ``\\r`` ends a CRLF line."""
_REFUSED, _MISSING, _UNAVAILABLE = "SourceRefused", "SourceMissing", "SourceUnavailable"
_S3_MISSING = frozenset({"NoSuchKey", "NoSuchBucket", "404", "NotFound"})
_S3_REFUSED = frozenset({"AccessDenied", "403", "Forbidden", "InvalidBucketName",
                         "AllAccessDisabled", "InvalidObjectState"})


def parse_s3_url(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not bucket or not key:
        raise ValueError(f"{url!r} is not s3://bucket/key")
    return bucket, key


# ---- reading a page --------------------------------------------------------------------


class _Line(NamedTuple):
    start: int
    end: int
    """Offset after the line's newline: where the next line starts."""
    text: bytes | None
    """None: longer than MAX_LINE_BYTES (its bytes were not kept)."""


def _lines(stream: BinaryIO, offset: int, size: int) -> Iterator[_Line]:
    """The lines from ``offset`` (a line start) to ``size``, split at ``\\n`` only; at
    most one line and one chunk in memory."""
    buf = bytearray()
    start = pos = offset
    over = False
    while pos < size:
        chunk = stream.read(min(READ_CHUNK, size - pos))
        if not chunk:
            break  # the source is shorter than it was: end at what is there
        base, i = pos, 0
        pos += len(chunk)
        while (nl := chunk.find(b"\n", i)) >= 0:
            if not over:
                buf += chunk[i:nl]
            end = base + nl + 1
            yield _Line(start, end, None if over or len(buf) > MAX_LINE_BYTES else bytes(buf))
            buf.clear()
            start, i, over = end, nl + 1, False
        if not over:
            buf += chunk[i:]
            if len(buf) > MAX_LINE_BYTES:
                buf.clear()
                over = True
    if start < pos:
        yield _Line(start, pos, None if over else bytes(buf))


class BadRecord(ValueError):
    """A line that is not a task: the reason is its BAD_RECORD's."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRecord(f"invalid JSON: number {one_line(text, 40)} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise BadRecord(f"invalid JSON: {name} is not a JSON value")


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` containers (iterative: never recurses)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _text_nests_deeper(text: str, limit: int) -> bool:
    """Whether JSON ``text`` opens more than ``limit`` containers at once, brackets inside
    strings not counted. Checked before parsing: json's recursion past its limit raises
    a RecursionError whose deep traceback can itself fail to be formatted later."""
    if text.count("[") + text.count("{") <= limit:
        return False  # the common line: not enough brackets to nest that deep
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def parse_task(text: bytes, profile: Profile) -> dict[str, Any]:
    """One line's task, validated by ``profile``; BadRecord says why it is not one."""
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"invalid UTF-8 at byte {e.start + 1} of the line") from None
    if _text_nests_deeper(decoded, MAX_DEPTH):
        raise BadRecord(f"invalid JSON: nested deeper than {MAX_DEPTH} levels")
    try:
        task = json.loads(decoded, parse_float=_finite, parse_constant=_no_constant)
    except BadRecord:
        raise
    except json.JSONDecodeError as e:
        raise BadRecord(f"invalid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise BadRecord(f"invalid JSON: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise BadRecord(f"invalid JSON: {e}") from None
    if not isinstance(task, dict):
        raise BadRecord("invalid task: not a JSON object")
    if _depth_exceeds(task, MAX_DEPTH):
        raise BadRecord(f"invalid task: nested deeper than {MAX_DEPTH} levels")
    try:
        profile.validate_task(task)
    except ValidationError as e:
        raise BadRecord(f"invalid task: {first_error(e, whole='task')}") from None
    except (ValueError, RecursionError) as e:
        raise BadRecord(f"invalid task: {e}") from None
    return task


def read_page(stream: BinaryIO, *, profile: str, offset: int, first_line: int,
              max_lines: int, size: int) -> ReadPageResult:
    """The page of ``stream`` (positioned at ``offset``, the start of line ``first_line``;
    ``size``: the source's length): its valid tasks and its bad lines, by line number.

    Blank lines are skipped silently but count as lines; a BOM before the first line is
    not part of it. A profile unknown here makes every line a BAD_RECORD: the batch ends
    with each record accounted for.
    """
    try:
        prof: Profile | None = get_profile(profile)
        unknown = ""
    except UnknownProfileError as e:
        prof, unknown = None, one_line(str(e))
    records: list[TaskRecord] = []
    bad: list[RecordOutcome] = []
    line, next_offset, page_bytes, nonblank = first_line, offset, 0, 0
    for ln in _lines(stream, offset, size):
        text = ln.text
        if text is not None and ln.start == 0:
            text = text.removeprefix(_BOM)
        reason, task, cost = "", None, 0
        if text is None:
            reason = f"line longer than {MAX_LINE_BYTES} bytes"
        elif text.strip(_JSON_SPACE):
            if prof is None:
                reason = unknown
            else:
                try:
                    task = parse_task(text, prof)
                except BadRecord as e:
                    reason = one_line(str(e))
            cost = len(text) + 64 if task is not None else len(reason) + 64
        if cost and page_bytes + cost > PAGE_BYTES and page_bytes:
            break  # this line starts the next page
        page_bytes += cost
        if task is not None:
            records.append(TaskRecord(line=line, offset=ln.start, task=task))
        elif reason:
            bad.append(RecordOutcome(line=line, job_id=None, state="BAD_RECORD",
                                     reason=reason))
        nonblank += bool(cost)
        line, next_offset = line + 1, ln.end
        if line - first_line >= max_lines or next_offset - offset >= SCAN_BYTES:
            break
    left = size - next_offset
    read = next_offset - offset
    return ReadPageResult(records=records, bad=bad, next_line=line, next_offset=next_offset,
                          exhausted=left <= 0,
                          remaining_lines=round(left * nonblank / read) if read else 0)


# ---- where sources may be read from ------------------------------------------------------


@dataclass(frozen=True)
class InputLocations:
    """Where batch sources may be read: folders on the worker host (and what is below
    them, after links are followed) and S3 buckets, optionally a key prefix of one.
    Nothing else is read: not ``/etc/passwd``, not ``/dev/zero``, not another bucket."""

    dirs: tuple[Path, ...]
    s3: tuple[tuple[str, str], ...]
    """(bucket, key prefix)."""

    @classmethod
    def parse(cls, entries: Iterable[str]) -> InputLocations:
        """``s3://bucket[/prefix]`` entries and folder paths."""
        dirs: list[Path] = []
        s3: list[tuple[str, str]] = []
        for entry in (e.strip() for e in entries):
            if entry.startswith("s3://"):
                bucket, _, prefix = entry.removeprefix("s3://").partition("/")
                if bucket:
                    s3.append((bucket, prefix))
            elif entry:
                dirs.append(Path(os.path.realpath(Path(entry).expanduser())))
        return cls(tuple(dirs), tuple(s3))

    @classmethod
    def default(cls, bucket: str) -> InputLocations:
        """The worker's working folder, the temporary folder and its own bucket."""
        return cls.parse([os.getcwd(), tempfile.gettempdir(), f"s3://{bucket}"])

    def allows_path(self, path: Path) -> bool:
        return any(path.is_relative_to(d) for d in self.dirs)

    def allows_s3(self, bucket: str, key: str) -> bool:
        return any(bucket == b and key.startswith(p) for b, p in self.s3)

    def describe(self) -> str:
        return ", ".join([*map(str, self.dirs), *(f"s3://{b}/{p}" for b, p in self.s3)])


def _not_the_tenants(key: str, tenant: str) -> str | None:
    """Why a batch of ``tenant`` may not read ``key`` of warmloop's own bucket, where
    every tenant's transcripts and results are; None when it may. A tenant reads only
    its own area, the default tenant anything but the tenants' areas."""
    own = s3_prefix(tenant)
    if tenant != DEFAULT_TENANT and not key.startswith(own):
        return (f"a batch of tenant {tenant} reads warmloop's bucket only under {own} "
                "(other tenants' objects are there)")
    if tenant == DEFAULT_TENANT and key.startswith("tenants/"):
        return "tenants' objects (tenants/) are not the default tenant's to read"
    return None


def _refused(source: str, why: str) -> ApplicationError:
    return ApplicationError(one_line(f"{source}: {why}"), type=_REFUSED, non_retryable=True)


def _missing(source: str, why: str) -> ApplicationError:
    return ApplicationError(one_line(f"cannot read {source}: {why}"), type=_MISSING,
                            non_retryable=True)


def _unavailable(source: str, e: BaseException) -> ApplicationError:
    return ApplicationError(one_line(f"cannot read {source} now: {type(e).__name__}: {e}"),
                            type=_UNAVAILABLE)


async def _stopped_page(client: Client, batch_id: str) -> StoppedPage:
    """``stopped_page``, its refusals as the activity's errors."""
    try:
        return await stopped_page(client, batch_id)
    except JobsStillStopping as e:
        raise ApplicationError(str(e), type="JobsStillStopping") from None
    except JobGone as e:
        raise ApplicationError(str(e), type="PageMoved", non_retryable=True) from None
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise
        raise ApplicationError(f"batch {batch_id} is not known to Temporal (past its "
                               "retention?)", type="PageMoved", non_retryable=True) from None


class BatchActivities:
    def __init__(self, s3: Any, bucket: str, *, inputs: str | Iterable[str] | None = None,
                 quotas: Mapping[str, TenantQuota] | None = None) -> None:
        """``inputs``: the allowed source locations, folders and ``s3://bucket[/prefix]``
        (a comma-separated string, as in ``WARMLOOP_BATCH_INPUT_DIRS``); none given: the
        worker's working folder, the temporary folder and ``s3://<bucket>``. ``quotas``:
        the tenants' quotas (``WARMLOOP_TENANTS``): a page of a tenant that has one
        says so (``ReadPageResult.ask_quota``), and its jobs each claim a slot first."""
        self._s3 = s3
        self._bucket = bucket
        self._quotas = dict(quotas or {})
        if isinstance(inputs, str):
            inputs = [e for e in inputs.split(",") if e.strip()]
        self._inputs = (InputLocations.parse(inputs) if inputs
                        else InputLocations.default(bucket))

    def _open_file(self, source: str, offset: int) -> tuple[BinaryIO, int]:
        path = Path(os.path.realpath(Path(source.removeprefix("file://")).expanduser()))
        if not self._inputs.allows_path(path):
            raise _refused(source, "not in an allowed input location "
                           f"({self._inputs.describe()}; WARMLOOP_BATCH_INPUT_DIRS)")
        try:
            # O_NONBLOCK: a FIFO opens at once (and is refused below) instead of waiting
            # for a writer; O_NOFOLLOW: no link swapped in since the path was resolved.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _missing(source, "no such file") from None
        except OSError as e:
            if isinstance(e, PermissionError) or e.errno == errno.ELOOP:
                raise _refused(source, e.strerror or str(e)) from None
            raise _unavailable(source, e) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise _refused(source, "not a regular file")
        stream = os.fdopen(fd, "rb")
        stream.seek(offset)
        return stream, st.st_size

    def _open_s3(self, source: str, offset: int, tenant: str = DEFAULT_TENANT
                 ) -> tuple[BinaryIO, int]:
        try:
            bucket, key = parse_s3_url(source)
        except ValueError:
            raise _refused(source, "not s3://bucket/key") from None
        if not self._inputs.allows_s3(bucket, key):
            raise _refused(source, "not in an allowed input location "
                           f"({self._inputs.describe()}; WARMLOOP_BATCH_INPUT_DIRS)")
        if bucket == self._bucket and (why := _not_the_tenants(key, tenant)) is not None:
            raise _refused(source, why)
        args = {"Bucket": bucket, "Key": key}
        if offset:
            args["Range"] = f"bytes={offset}-"
        try:
            resp = self._s3.get_object(**args)
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code == "InvalidRange":  # the offset is the object's end
                return io.BytesIO(), offset
            if code in _S3_MISSING:
                raise _missing(source, "no such object") from None
            if code in _S3_REFUSED:
                raise _refused(source, f"S3 says {code}") from None
            raise _unavailable(source, e) from None
        except (BotoCoreError, OSError, HTTPError) as e:
            raise _unavailable(source, e) from None
        total = str(resp.get("ContentRange", "")).rpartition("/")[2]
        size = int(total) if total.isdigit() else offset + int(resp["ContentLength"])
        return resp["Body"], size

    def _read(self, req: ReadPageRequest) -> ReadPageResult:
        # from the byte before the offset: it must end a line (a resumed batch's offset
        # from another batch's result, or a source changed since, would not)
        before = 1 if req.offset else 0
        if req.source.startswith("s3://"):
            stream, size = self._open_s3(req.source, req.offset - before, req.tenant)
        else:
            stream, size = self._open_file(req.source, req.offset - before)
        try:
            if before and req.offset < size and stream.read(1) != b"\n":
                raise _refused(req.source, f"byte offset {req.offset} does not start line "
                               f"{req.first_line} (resume from the next_line and next_offset "
                               "of the batch's result, over the same source)")
            page = read_page(stream, profile=req.profile, offset=req.offset,
                             first_line=req.first_line, max_lines=req.limit, size=size)
        except (BotoCoreError, OSError, HTTPError) as e:
            raise _unavailable(req.source, e) from None
        finally:
            stream.close()
        quota = self._quotas.get(req.tenant)
        page.ask_quota = quota is not None and quota.counts_in_redis
        return page

    @activity.defn(name="read_records")
    async def read_records(self, req: ReadPageRequest) -> ReadPageResult:
        """Lines first_line.. of the source, from byte ``offset``: valid tasks, and bad
        lines with reasons (line numbers are the file's own, 1-based).

        Raises ApplicationError SourceRefused or SourceMissing (non-retryable) and
        SourceUnavailable (retryable: S3 or the disk is down, try again).
        """
        return await asyncio.to_thread(self._read, req)

    @activity.defn(name="write_batch_results")
    async def write_batch_results(self, req: WritePageRequest) -> str:
        key = page_key(req.batch_id, req.page)  # a tenant's under the tenant's prefix
        body = "".join(o.model_dump_json() + "\n" for o in req.outcomes)
        await asyncio.to_thread(self._s3.put_object, Bucket=self._bucket, Key=key,
                                Body=body.encode(), ContentType="application/x-ndjson")
        return key

    @activity.defn(name="write_recovered_page")
    async def write_recovered_page(self, req: RecoverPageRequest) -> str:
        """Write the page a batch stopped on without writing it (terminated mid-page),
        its outcomes read back from its jobs (``batch_recovery.stopped_page``, through
        the worker's Temporal client), as that batch's page ``req.page``; its key.

        Raises ApplicationError ``JobsStillStopping`` (retried) while a job the stop
        asked to cancel has not ended, and ``PageMoved`` (not retried) when the batch's
        last run is no longer that page's, or read none."""
        found = await _stopped_page(activity.client(), req.batch_id)
        if found.page != req.page or found.read is None:
            raise ApplicationError(
                f"batch {req.batch_id} is at page {found.page}"
                f"{'' if found.read is not None else ' (not read)'}, not {req.page}: "
                "resume it again", type="PageMoved", non_retryable=True)
        if found.written:  # its run wrote it before it stopped
            return page_key(req.batch_id, req.page)
        return await self.write_batch_results(WritePageRequest(
            batch_id=req.batch_id, page=req.page, outcomes=found.outcomes))
