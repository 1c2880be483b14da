"""Transcripts in S3 (or any S3-compatible store): the workflow keeps keys, not blobs."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import TypeAdapter
from temporalio import activity

from warmloop.workflows.contracts import ChatMessage, StoreTranscriptRequest

_transcript = TypeAdapter(list[ChatMessage])


def transcript_key(job_id: str) -> str:
    return f"transcripts/{job_id}.json"


class StorageActivities:
    def __init__(self, s3: Any, bucket: str) -> None:
        self._s3 = s3  # a boto3 S3 client, built once by the worker
        self._bucket = bucket

    @activity.defn(name="store_transcript")
    async def store_transcript(self, req: StoreTranscriptRequest) -> str:
        key = transcript_key(req.job_id)
        body = _transcript.dump_json(req.transcript)
        # Same key for the same job: a retried activity overwrites, never duplicates.
        await asyncio.to_thread(self._s3.put_object, Bucket=self._bucket, Key=key, Body=body,
                                ContentType="application/json")
        return key

    def load_transcript(self, key: str) -> list[ChatMessage]:
        obj = self._s3.get_object(Bucket=self._bucket, Key=key)
        return _transcript.validate_json(obj["Body"].read())
