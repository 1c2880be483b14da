"""Transcripts in S3, one object per message, so each step stores only what is new.

Messages are immutable once stored (the transcript is append-only), so storing
message i again (a retried step) writes the same bytes, and a worker may reuse the
prefix it already holds in memory.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from temporalio.exceptions import ApplicationError

from warmloop.workflows.contracts import ChatMessage
from warmloop.workflows.tenants import s3_prefix, split_job_id

TRANSCRIPT_GAP = "TranscriptGap"


def read_message(s3: Any, bucket: str, job_id: str, index: int) -> bytes:
    """Message ``index`` of a job's stored transcript, as stored. A missing one is a
    TranscriptGap: the store lost it (an in-memory S3 restarted)."""
    try:
        obj = s3.get_object(Bucket=bucket, Key=TranscriptStore.key(job_id, index))
    except s3.exceptions.NoSuchKey:
        raise ApplicationError(f"transcript of {job_id} has no message {index} in S3",
                               type=TRANSCRIPT_GAP, non_retryable=True) from None
    body: bytes = obj["Body"].read()
    return body


class TranscriptStore:
    def __init__(self, s3: Any, bucket: str, *, cached_jobs: int = 1024) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._cache: OrderedDict[str, list[ChatMessage]] = OrderedDict()
        self._cached_jobs = cached_jobs

    @staticmethod
    def key(job_id: str, index: int) -> str:
        """Message ``index`` of the job's store; a tenant's jobs (``<tenant>/<job id>``)
        keep theirs under ``tenants/<tenant>/``."""
        tenant, bare = split_job_id(job_id)
        return f"{s3_prefix(tenant)}transcript-messages/{bare}/{index:06d}.json"

    async def extend(self, job_id: str, base_len: int,
                     new: list[ChatMessage]) -> list[ChatMessage]:
        """Store ``new`` at positions base_len.. and return the whole transcript."""
        full, stored = await self.extend_deferred(job_id, base_len, new)
        await stored
        return full

    async def extend_deferred(
        self, job_id: str, base_len: int, new: list[ChatMessage]
    ) -> tuple[list[ChatMessage], asyncio.Future[Any]]:
        """Like ``extend``, but the writes run in the background: the caller sends the
        prompt at once and awaits the returned future before it reports the step done
        (so a finished step's messages are stored, and the engine call does not wait
        on S3)."""
        held = self._cache.get(job_id)
        prefix = held[:base_len] if held is not None and len(held) >= base_len else None
        if prefix is None:
            prefix = await self._load(job_id, base_len)
        stored = asyncio.gather(*(
            asyncio.to_thread(self._s3.put_object, Bucket=self._bucket,
                              Key=self.key(job_id, base_len + i), Body=m.model_dump_json())
            for i, m in enumerate(new)
        ))
        full = prefix + new
        self._cache[job_id] = full
        self._cache.move_to_end(job_id)
        while len(self._cache) > self._cached_jobs:
            self._cache.popitem(last=False)
        return full, stored

    async def _load(self, job_id: str, n: int) -> list[ChatMessage]:
        if n == 0:
            return []

        def get(i: int) -> ChatMessage:
            return ChatMessage.model_validate_json(
                read_message(self._s3, self._bucket, job_id, i))

        return list(await asyncio.gather(*(asyncio.to_thread(get, i) for i in range(n))))
