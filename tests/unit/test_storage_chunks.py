"""The storage activities that move a big transcript through S3 in chunks, against
moto's in-process S3 (the workflow side is tested in tests/workflow)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from warmloop.activities.storage import StorageActivities, transcript_key
from warmloop.activities.transcripts import TranscriptStore
from warmloop.workflows.contracts import (
    ChatMessage,
    LoadTranscriptRequest,
    StoreTranscriptRequest,
)

MESSAGES = [ChatMessage(role="tool", tool_call_id=f"c{i}", content=f"{i:03d}" + "x" * 1000)
            for i in range(10)]


@pytest.fixture
def s3() -> Iterator[Any]:
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="wl-test")
        yield client


async def test_chunks_appended_then_completed_make_the_whole_transcript(s3: Any) -> None:
    storage, env = StorageActivities(s3, "wl-test"), ActivityEnvironment()
    for base in (0, 4, 8):
        key = await env.run(storage.store_transcript, StoreTranscriptRequest(
            job_id="j", transcript=MESSAGES[base:base + 4], base_len=base,
            complete=base == 8))
    assert key == transcript_key("j")
    assert storage.load_transcript(key) == MESSAGES
    # read back in chunks of at most max_bytes, at least one message each
    out: list[ChatMessage] = []
    while len(out) < 10:
        chunk = await env.run(storage.load_transcript_chunk, LoadTranscriptRequest(
            job_id="j", start=len(out), end=10, max_bytes=2500))
        assert 1 <= len(chunk) <= 2
        out += chunk
    assert out == MESSAGES


async def test_a_message_the_store_lost_is_a_transcript_gap(s3: Any) -> None:
    storage, env = StorageActivities(s3, "wl-test"), ActivityEnvironment()
    await env.run(storage.store_transcript, StoreTranscriptRequest(
        job_id="j", transcript=MESSAGES[:4], base_len=0, complete=False))
    s3.delete_object(Bucket="wl-test", Key=TranscriptStore.key("j", 2))
    with pytest.raises(ApplicationError) as lost:
        await env.run(storage.store_transcript, StoreTranscriptRequest(
            job_id="j", transcript=MESSAGES[4:6], base_len=4, complete=True))
    assert lost.value.type == "TranscriptGap" and lost.value.non_retryable
    with pytest.raises(ApplicationError, match="no message 2"):
        await env.run(storage.load_transcript_chunk,
                      LoadTranscriptRequest(job_id="j", start=0, end=4))


async def test_a_small_transcript_is_one_object_as_before(s3: Any) -> None:
    storage, env = StorageActivities(s3, "wl-test"), ActivityEnvironment()
    key = await env.run(storage.store_transcript,
                        StoreTranscriptRequest(job_id="j", transcript=MESSAGES[:2]))
    assert storage.load_transcript(key) == MESSAGES[:2]
    listed = s3.list_objects_v2(Bucket="wl-test")["Contents"]
    assert [o["Key"] for o in listed] == [key]  # no per-message objects written
