"""Batch I/O: read a page of task records (file or S3), write a page of outcomes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from warmloop.workflows.batch_run import (
    ReadPageRequest,
    ReadPageResult,
    RecordOutcome,
    TaskRecord,
    WritePageRequest,
)
from warmloop.workflows.profiles import UnknownProfileError, get_profile
from warmloop.workflows.profiles.base import first_error


def parse_s3_url(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not bucket or not key:
        raise ValueError(f"{url!r} is not s3://bucket/key")
    return bucket, key


class BatchActivities:
    def __init__(self, s3: Any, bucket: str) -> None:
        self._s3 = s3
        self._bucket = bucket

    def _read_text(self, source: str) -> str:
        if source.startswith("s3://"):
            bucket, key = parse_s3_url(source)
            try:
                return self._s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
            except self._s3.exceptions.NoSuchKey:
                raise ApplicationError(f"no object {source}", type="SourceMissing",
                                       non_retryable=True) from None
        try:
            return Path(source.removeprefix("file://")).read_text()
        except OSError as e:
            raise ApplicationError(f"cannot read {source}: {e.strerror}", type="SourceMissing",
                                   non_retryable=True) from None

    @activity.defn(name="read_records")
    async def read_records(self, req: ReadPageRequest) -> ReadPageResult:
        """Lines first_line.. of the source: valid tasks, and bad lines with reasons.

        Blank lines are skipped silently; line numbers are the file's own (1-based).
        """
        try:
            profile = get_profile(req.profile)
        except UnknownProfileError as e:
            raise ApplicationError(str(e), type="UnknownProfile", non_retryable=True) from None
        lines = (await asyncio.to_thread(self._read_text, req.source)).splitlines()
        records: list[TaskRecord] = []
        bad: list[RecordOutcome] = []
        n = req.first_line
        while n <= len(lines) and len(records) + len(bad) < req.limit:
            text = lines[n - 1].strip()
            if text:
                try:
                    task = json.loads(text)
                    if not isinstance(task, dict):
                        raise ValueError("not a JSON object")
                    profile.validate_task(task)
                    records.append(TaskRecord(line=n, task=task))
                except json.JSONDecodeError as e:
                    bad.append(RecordOutcome(line=n, job_id=None, state="BAD_RECORD",
                                             reason=f"invalid JSON: {e.msg}"))
                except ValidationError as e:
                    reason = f"invalid task: {first_error(e, whole='task')}"
                    bad.append(RecordOutcome(line=n, job_id=None, state="BAD_RECORD",
                                             reason=reason))
                except ValueError as e:
                    bad.append(RecordOutcome(line=n, job_id=None, state="BAD_RECORD",
                                             reason=f"invalid task: {e}"))
            n += 1
        left = sum(1 for line in lines[n - 1:] if line.strip())
        return ReadPageResult(records=records, bad=bad, next_line=n, exhausted=n > len(lines),
                              remaining_lines=left)

    @activity.defn(name="write_batch_results")
    async def write_batch_results(self, req: WritePageRequest) -> str:
        key = f"batch-results/{req.batch_id}/page-{req.page:05d}.jsonl"
        body = "".join(o.model_dump_json() + "\n" for o in req.outcomes)
        await asyncio.to_thread(self._s3.put_object, Bucket=self._bucket, Key=key,
                                Body=body.encode(), ContentType="application/x-ndjson")
        return key

