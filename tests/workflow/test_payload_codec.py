"""The payload codec end to end: a workflow run through the time-skipping server with
warmloop's encrypting data converter leaves no plaintext in Temporal's history (inputs,
activity arguments and results, failure messages, the result) while every party with
the key reads its values; a history written before encryption still replays."""

from __future__ import annotations

import base64
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.client import Client, WorkflowHistory
from temporalio.common import RetryPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner, Worker

from warmloop.workers.clients import data_converter
from warmloop.workers.codec import ENCRYPTED_ENCODING
from warmloop.workers.settings import Settings

MARKER = "acme-secret-iban-de89370400440532013000"
SETTINGS = Settings(payload_key=base64.b64encode(os.urandom(32)).decode(),
                    payload_key_id="test-1")


class Note(BaseModel):
    text: str


@activity.defn
async def shout(note: Note) -> Note:
    return Note(text=note.text.upper())


@activity.defn
async def refuse(note: Note) -> None:
    raise ApplicationError(f"tool refused {note.text}", type="ToolRefused", non_retryable=True)


@workflow.defn
class EchoSecret:
    @workflow.run
    async def run(self, note: Note) -> Note:
        loud = await workflow.execute_activity(shout, note,
                                               start_to_close_timeout=timedelta(seconds=10))
        try:
            await workflow.execute_activity(refuse, note,
                                            start_to_close_timeout=timedelta(seconds=10),
                                            retry_policy=RetryPolicy(maximum_attempts=1))
            why = "not refused"
        except ActivityError as e:
            why = str(e.cause.message) if isinstance(e.cause, ApplicationError) else repr(e)
        return Note(text=f"{loud.text} | {why}")


@pytest.fixture(scope="module")
async def encrypted_env() -> AsyncIterator[WorkflowEnvironment]:
    server = (shutil.which("temporal-test-server", path=str(Path(sys.executable).parent))
              or shutil.which("temporal-test-server"))
    if server is None:
        pytest.fail("temporal-test-server not found; run `make install`")
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=server, data_converter=data_converter(SETTINGS))
    try:
        yield env
    finally:
        await env.shutdown()


async def _run(client: Client) -> tuple[Note, WorkflowHistory]:
    queue = f"codec-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[EchoSecret],
                      activities=[shout, refuse], workflow_runner=UnsandboxedWorkflowRunner()):
        handle = await client.start_workflow(EchoSecret.run, Note(text=MARKER),
                                             id=f"codec-{uuid.uuid4().hex[:8]}",
                                             task_queue=queue)
        result = await handle.result()
        return result, await handle.fetch_history()


def _stored_bytes(history: WorkflowHistory) -> bytes:
    return b"".join(e.SerializeToString() for e in history.events)


async def test_history_holds_no_plaintext(encrypted_env: WorkflowEnvironment) -> None:
    assert encrypted_env.client.data_converter.payload_codec is not None
    result, history = await _run(encrypted_env.client)
    assert result == Note(text=f"{MARKER.upper()} | tool refused {MARKER}")
    stored = _stored_bytes(history)
    assert MARKER.encode() not in stored and MARKER.upper().encode() not in stored
    assert b"tool refused" not in stored  # failure messages are encrypted too
    assert ENCRYPTED_ENCODING in stored and b"test-1" in stored
    # The encrypted history replays for a worker with the key.
    await Replayer(workflows=[EchoSecret], data_converter=data_converter(SETTINGS),
                   workflow_runner=UnsandboxedWorkflowRunner()).replay_workflow(history)


async def test_plaintext_history_still_reads(encrypted_env: WorkflowEnvironment) -> None:
    """The control: without the codec the marker is in the history (so the test above
    can see a leak), and that history, written before encryption was turned on, still
    replays with the encrypting converter (plaintext payloads pass through)."""
    plain = Client(encrypted_env.client.service_client,
                   namespace=encrypted_env.client.namespace,
                   data_converter=pydantic_data_converter)
    result, history = await _run(plain)
    assert result.text.startswith(MARKER.upper())
    assert MARKER.encode() in _stored_bytes(history)
    await Replayer(workflows=[EchoSecret], data_converter=data_converter(SETTINGS),
                   workflow_runner=UnsandboxedWorkflowRunner()).replay_workflow(history)
