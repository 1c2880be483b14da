"""Fixtures of the browser test: the inbox served by uvicorn on a free port, Debian's
Chromium driven by Playwright with a fresh profile, the dev users' tokens, and a
place for screenshots (the test's tmp dir, copied to <state_dir>/screenshots)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from playwright.async_api import BrowserContext, Page, async_playwright
from starlette.applications import Starlette

from warmloop.infra.stack import Stack
from warmloop.workers.inbox import create_app
from warmloop.workers.settings import Settings

CHROMIUM = Path(os.environ.get("WARMLOOP_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


class InboxServer:
    """An ASGI app served by uvicorn in a background thread, on a socket bound before
    the thread starts (no free-port race); ``url`` once it answers /healthz."""

    def __init__(self, app: Starlette) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> InboxServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the inbox did not answer at {self.url}/healthz in 30 s")

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


@pytest.fixture(scope="session")
def inbox_url(stack: Stack, settings: Settings) -> Iterator[str]:
    """The real inbox (real verifier, signer, S3 and Temporal), as `warmloop ui` builds it."""
    with InboxServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture(scope="session")
def dev_tokens(stack: Stack, settings: Settings) -> dict[str, str]:
    """The embedded stack's dev users and their plain tokens (``warmloop dev up``)."""
    path = settings.state_dir / "auth" / "dev-tokens.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: the stack's `warmloop dev up` writes it")
    return {name: str(user["token"]) for name, user in json.loads(path.read_text()).items()}


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's Chromium (``make browser`` installs it); WARMLOOP_CHROMIUM overrides."""
    if not CHROMIUM.exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make browser` (apt-get install chromium)")
    return CHROMIUM


@pytest.fixture
async def browser(chromium: Path, tmp_path: Path) -> AsyncIterator[BrowserContext]:
    """Chromium with a fresh profile (no cookies or cache from any earlier run)."""
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(chromium), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 900})
        context.set_default_timeout(30_000)
        try:
            yield context
        finally:
            await context.close()


class Screenshots:
    """Full-page screenshots, numbered in the order taken, kept under the test's tmp
    dir and copied to <state_dir>/screenshots (ignored by git) to be looked at."""

    def __init__(self, tmp: Path, keep: Path) -> None:
        self.tmp, self.keep = tmp, keep
        self.taken: list[Path] = []
        tmp.mkdir(parents=True, exist_ok=True)
        keep.mkdir(parents=True, exist_ok=True)

    async def take(self, page: Page, name: str) -> Path:
        path = self.tmp / f"{len(self.taken) + 1:02d}-{name}.png"
        await page.screenshot(path=str(path), full_page=True)
        shutil.copy2(path, self.keep / path.name)
        self.taken.append(path)
        return path


@pytest.fixture
def screenshots(tmp_path: Path, settings: Settings) -> Screenshots:
    keep = settings.state_dir / "screenshots"
    for old in keep.glob("*.png"):  # only this run's pictures in the folder
        old.unlink()
    return Screenshots(tmp_path / "screenshots", keep)
