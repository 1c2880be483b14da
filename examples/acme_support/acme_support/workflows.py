"""Acme's own Temporal workflows (a module named ``workflows``, as in Temporal's
samples: it does not clash with warmloop's, which lives under ``warmloop.``).

``SupportCase`` runs a warmloop ``AgentJob`` as a child workflow and files its outcome:
a team composes warmloop's jobs into its own processes.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from warmloop import AGENT_TASK_QUEUE, JobInput, JobResult


class SupportCaseInput(BaseModel):
    order_id: str
    question: str


class SupportCaseResult(BaseModel):
    job_id: str
    state: str
    answer: str | None
    steps: int


@workflow.defn
class SupportCase:
    @workflow.run
    async def run(self, case: SupportCaseInput) -> SupportCaseResult:
        job_id = f"{workflow.info().workflow_id}-agent"
        result: JobResult = await workflow.execute_child_workflow(
            "AgentJob",
            JobInput(profile="acme-orders",
                     task={"order_id": case.order_id, "question": case.question}),
            id=job_id, task_queue=AGENT_TASK_QUEUE, result_type=JobResult,
            execution_timeout=timedelta(minutes=30),
        )
        answer = (result.final or {}).get("answer")
        return SupportCaseResult(job_id=job_id, state=result.state.value,
                                 answer=None if answer is None else str(answer),
                                 steps=len(result.steps))
