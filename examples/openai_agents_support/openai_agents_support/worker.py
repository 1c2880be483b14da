"""The project's worker and a small command line.

The one warmloop-specific line is the client's plugin: ``warmloop_agents_plugin()`` in
place of ``OpenAIAgentsPlugin()``. It serves the agents' model calls through warmloop's
gateway (``warmloop dev up`` runs one at 127.0.0.1:8500) with each workflow's id as the
gateway's session id. The workflows, the agent and its tool are unchanged SDK code.

    python -m openai_agents_support.worker                  # run the worker
    python -m openai_agents_support.worker ask Ada "Where is my order O1001?"
    python -m openai_agents_support.worker review <workflow id> --approve --reviewer ann
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

from temporalio.client import Client
from temporalio.worker import Worker

from openai_agents_support.orders import lookup_order
from openai_agents_support.workflows import Review, SupportRequest, SupportWorkflow
from warmloop import Settings, warmloop_agents_plugin

TASK_QUEUE = "openai-agents-support"


async def connect(settings: Settings | None = None) -> Client:
    """A Temporal client for this project's workflows, with warmloop's agents plugin
    (which also sets the client's data converter to the SDK's)."""
    settings = settings or Settings()
    return await Client.connect(settings.temporal_address,
                                namespace=settings.temporal_namespace,
                                plugins=[warmloop_agents_plugin(settings)])


def build_worker(client: Client) -> Worker:
    """The worker: the workflow, the tool's activity, and (from the plugin) the model
    activities."""
    return Worker(client, task_queue=TASK_QUEUE, workflows=[SupportWorkflow],
                  activities=[lookup_order])


async def ask(client: Client, customer: str, question: str) -> str:
    """Start a support case; print the draft once the agent has written it."""
    handle = await client.start_workflow(
        SupportWorkflow.run, SupportRequest(customer=customer, question=question),
        id=f"support-{uuid.uuid4().hex[:12]}", task_queue=TASK_QUEUE)
    for _ in range(600):  # five minutes
        draft = await handle.query(SupportWorkflow.draft)
        if draft is not None:
            print(f"{handle.id}: draft for review:\n{draft}")
            return handle.id
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{handle.id}: no draft after five minutes; is the worker running?")


async def review(client: Client, workflow_id: str, approved: bool, reviewer: str,
                 note: str) -> None:
    """Send a person's decision; print the final reply."""
    handle = client.get_workflow_handle_for(SupportWorkflow.run, workflow_id)
    await handle.execute_update(SupportWorkflow.review, Review(approved, reviewer, note))
    outcome = await handle.result()
    print(outcome.reply)
    for i, call in enumerate(outcome.model_calls):
        print(f"model call {i + 1}: {call.cached_tokens}/{call.input_tokens} prompt tokens "
              "cached")


async def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m openai_agents_support.worker")
    sub = parser.add_subparsers(dest="command")
    a = sub.add_parser("ask", help="start a support case and print its draft")
    a.add_argument("customer")
    a.add_argument("question")
    r = sub.add_parser("review", help="approve or reject a case's draft")
    r.add_argument("workflow_id")
    r.add_argument("--approve", action="store_true")
    r.add_argument("--reviewer", required=True)
    r.add_argument("--note", default="")
    args = parser.parse_args()
    client = await connect()
    if args.command == "ask":
        await ask(client, args.customer, args.question)
    elif args.command == "review":
        await review(client, args.workflow_id, args.approve, args.reviewer, args.note)
    else:
        await build_worker(client).run()


if __name__ == "__main__":
    asyncio.run(main())
