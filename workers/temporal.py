"""Connecting to Temporal with the pydantic data converter."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from workers.settings import Settings


class StackNotRunningError(RuntimeError):
    """Temporal (or another part of the stack) cannot be reached."""


async def connect(settings: Settings) -> Client:
    try:
        return await Client.connect(
            settings.temporal_address,
            namespace=settings.temporal_namespace,
            data_converter=pydantic_data_converter,
        )
    except RuntimeError as e:
        raise StackNotRunningError(
            f"cannot reach Temporal at {settings.temporal_address} ({e}); "
            "start the embedded stack with `warmloop dev up` or set WARMLOOP_TEMPORAL_ADDRESS"
        ) from None
