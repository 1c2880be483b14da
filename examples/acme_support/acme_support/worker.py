"""Acme's own worker: the ``acme_issue_refund`` activity (the refund tool of the
acme-returns profile) and Acme's ``SupportCase`` workflow, on task queue ``acme-tools``.

The refund runs here, with Acme's payment credentials; warmloop's workers only schedule
it. ``python -m acme_support.worker`` (``--with-warmloop`` also runs warmloop's
workflows and agent activities in this process, through ``WarmloopPlugin``, so no
separate ``warmloop worker agent`` is needed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from acme_support.data import RETURNS
from acme_support.workflows import SupportCase
from warmloop import AGENT_TASK_QUEUE, WarmloopPlugin

TASK_QUEUE = "acme-tools"


class Refunds:
    """Acme's payment side. A refund applies once per idempotency key, however often
    Temporal retries the activity."""

    def __init__(self) -> None:
        self.applied: dict[str, dict[str, Any]] = {}
        self.calls = 0

    @activity.defn(name="acme_issue_refund")
    async def issue_refund(self, call: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        args = call["arguments"]
        record = RETURNS.get(args["return_id"])
        if record is None:
            return {"ok": False, "output": f"no return {args['return_id']}; nothing refunded"}
        if record["state"] != "received":
            # an expected refusal: the model reads it
            return {"ok": False, "output": f"return {args['return_id']} is not received yet"}
        key = call["idempotency_key"]
        if key not in self.applied:
            self.applied[key] = {"refund_id": f"RF-{len(self.applied) + 1:04d}",
                                 "amount": record["refundable"], "reason": args["reason"]}
        return self.applied[key]


async def run_worker(client: Client, refunds: Refunds, *, with_warmloop: bool = False) -> None:
    workers = [Worker(client, task_queue=TASK_QUEUE, workflows=[SupportCase],
                      activities=[refunds.issue_refund])]
    if with_warmloop:
        workers.append(Worker(client, task_queue=AGENT_TASK_QUEUE, plugins=[WarmloopPlugin()]))
    await asyncio.gather(*(w.run() for w in workers))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--with-warmloop", action="store_true")
    args = parser.parse_args()
    client = await Client.connect(os.environ.get("WARMLOOP_TEMPORAL_ADDRESS", "127.0.0.1:7233"),
                                  data_converter=pydantic_data_converter)
    print(f"acme worker on task queue {TASK_QUEUE}", flush=True)
    await run_worker(client, Refunds(), with_warmloop=args.with_warmloop)


if __name__ == "__main__":
    asyncio.run(main())
