"""``archive_tool_outputs``: the whole text of tool outputs that context hygiene takes
out of a transcript (``warmloop.workflows.hygiene``), one S3 object each, before the
transcript refers to them by key. Nothing is dropped until this returned."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import activity

from warmloop.workflows.hygiene import ArchiveRequest


class HygieneActivities:
    def __init__(self, s3: Any, bucket: str) -> None:
        self._s3 = s3  # a boto3 S3 client, built once by the worker
        self._bucket = bucket

    @activity.defn(name="archive_tool_outputs")
    async def archive_tool_outputs(self, req: ArchiveRequest) -> list[str]:
        """Write every output at its key (a retry writes the same bytes); the keys
        written. An S3 error fails the activity: the workflow keeps the transcript as
        it is and tries again at a later compaction point."""
        await asyncio.gather(*(
            asyncio.to_thread(self._s3.put_object, Bucket=self._bucket, Key=o.key,
                              Body=o.text.encode(), ContentType="text/plain; charset=utf-8")
            for o in req.outputs))
        return [o.key for o in req.outputs]
