"""Transcripts in S3 (or any S3-compatible store): the workflow keeps keys, not blobs.

Two layouts share one store: the message store (one object per message, written by the
inference workers as steps run, see ``transcripts.py``) and the finished transcript (one
object per job). A transcript too big for a Temporal payload reaches the finished object
through the message store, in chunks."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import TypeAdapter
from temporalio import activity

from warmloop.activities.transcripts import TranscriptStore, read_message
from warmloop.workflows.contracts import (
    ChatMessage,
    LoadTranscriptRequest,
    StoreTranscriptRequest,
)
from warmloop.workflows.tenants import s3_prefix, split_job_id

_transcript = TypeAdapter(list[ChatMessage])


def transcript_key(job_id: str) -> str:
    """Where a finished job's transcript is: ``transcripts/<job id>.json``, under
    ``tenants/<tenant>/`` for a tenant's job (its workflow id is ``<tenant>/<job id>``)."""
    tenant, bare = split_job_id(job_id)
    return f"{s3_prefix(tenant)}transcripts/{bare}.json"


class StorageActivities:
    def __init__(self, s3: Any, bucket: str) -> None:
        self._s3 = s3  # a boto3 S3 client, built once by the worker
        self._bucket = bucket

    @activity.defn(name="store_transcript")
    async def store_transcript(self, req: StoreTranscriptRequest) -> str:
        """Append ``req.transcript`` at ``base_len`` and, when ``complete``, write the
        whole transcript as one object. Same keys for the same job: a retried call
        overwrites, never duplicates."""
        key = transcript_key(req.job_id)
        if req.base_len == 0 and req.complete:  # small: one object, as it always was
            body = _transcript.dump_json(req.transcript)
        else:
            await asyncio.gather(*(
                asyncio.to_thread(self._s3.put_object, Bucket=self._bucket,
                                  Key=TranscriptStore.key(req.job_id, req.base_len + i),
                                  Body=m.model_dump_json())
                for i, m in enumerate(req.transcript)))
            if not req.complete:
                return key
            n = req.base_len + len(req.transcript)
            raw = await asyncio.gather(*(
                asyncio.to_thread(read_message, self._s3, self._bucket, req.job_id, i)
                for i in range(n)))
            body = b"[" + b",".join(raw) + b"]"
        await asyncio.to_thread(self._s3.put_object, Bucket=self._bucket, Key=key, Body=body,
                                ContentType="application/json")
        return key

    @activity.defn(name="load_transcript")
    async def load_transcript_chunk(self, req: LoadTranscriptRequest) -> list[ChatMessage]:
        """Messages ``start..`` of the message store, up to ``max_bytes`` (at least one).
        A missing message is a TranscriptGap: the store lost it (an in-memory S3
        restarted), and nothing here can rebuild it."""
        out: list[ChatMessage] = []
        size = 0
        for i in range(req.start, req.end):
            raw = await asyncio.to_thread(read_message, self._s3, self._bucket,
                                          req.job_id, i)
            if out and size + len(raw) > req.max_bytes:
                break
            out.append(ChatMessage.model_validate_json(raw))
            size += len(raw)
        return out

    def load_transcript(self, key: str) -> list[ChatMessage]:
        obj = self._s3.get_object(Bucket=self._bucket, Key=key)
        return _transcript.validate_json(obj["Body"].read())
