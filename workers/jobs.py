"""``JobClient``: submit agent jobs and read their results from Python.

The CLI's ``submit``/``status``/``result``/``cancel`` as a typed API, for a team's own
services and scripts. Input is validated against the profile before anything starts.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ValidationError
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDReusePolicy

from warmloop.workers.clients import connect
from warmloop.workers.plugins import load_plugins
from warmloop.workers.settings import Settings
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    JobInput,
    JobResult,
    JobStatus,
    Lane,
    id_problem,
)
from warmloop.workflows.profiles import UnknownProfileError, get_profile


class InvalidJobError(ValueError):
    """The job's input does not validate; nothing was started."""


class JobClient:
    """Submits ``AgentJob`` workflows and reads them back.

    Build it with ``await JobClient.connect()`` (settings from ``WARMLOOP_*``), or
    around a Temporal client of your own that uses the pydantic data converter
    (``temporalio.contrib.pydantic.pydantic_data_converter``): warmloop's payloads are
    pydantic models, and the default converter cannot read them back.
    """

    def __init__(self, client: Client) -> None:
        self.temporal = client

    @classmethod
    async def connect(cls, settings: Settings | None = None) -> JobClient:
        settings = settings or Settings()
        load_plugins(plugins=settings.plugins, profile_paths=settings.profile_paths,
                     toolsets=False)
        return cls(await connect(settings))

    async def submit(self, profile: str, task: dict[str, Any], *, job_id: str | None = None,
                     limits: JobLimits | None = None, max_steps: int | None = None,
                     lane: Lane | str = Lane.INTERACTIVE, **options: Any) -> str:
        """Start a job and return its id (``<profile>-<random>`` unless given).

        Raises ``InvalidJobError`` when the profile is unknown (in this process's
        plugins) or the task does not validate, and Temporal's
        ``WorkflowAlreadyStartedError`` when ``job_id`` was ever used: a job id names
        one job for good. ``options`` are further ``JobInput`` fields (``tools``,
        ``hold_policy``, ``routing``, ...)."""
        if job_id is not None and (bad := id_problem("job", job_id)):
            raise InvalidJobError(bad)
        if options.get("carry") is not None:
            raise InvalidJobError("carry is set by continue-as-new only; submit without it")
        try:
            get_profile(profile).validate_task(task)
            job = JobInput(profile=profile, task=task, limits=limits, max_steps=max_steps,
                           lane=Lane(lane), **options)
        except (UnknownProfileError, ValidationError, ValueError) as e:
            raise InvalidJobError(f"invalid job for {profile}: {e}") from None
        from warmloop.workflows.agent_job import AgentJob

        jid = job_id or f"{profile}-{uuid.uuid4().hex[:10]}"
        await self.temporal.start_workflow(
            AgentJob.run, job, id=jid, task_queue=AGENT_TASK_QUEUE,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE)
        return jid

    def handle(self, job_id: str) -> WorkflowHandle[Any, JobResult]:
        return self.temporal.get_workflow_handle(job_id, result_type=JobResult)

    async def result(self, job_id: str) -> JobResult:
        """How the job ended (waits while it runs). Every ending is a named state with
        the transcript kept; a workflow failure here is a bug, raised as Temporal's."""
        return await self.handle(job_id).result()

    async def run(self, profile: str, task: dict[str, Any], **kw: Any) -> JobResult:
        """``submit`` then ``result``."""
        return await self.result(await self.submit(profile, task, **kw))

    async def status(self, job_id: str) -> JobStatus:
        """Where a running job is (the ``status`` query)."""
        return await self.handle(job_id).query("status", result_type=JobStatus)

    async def cancel(self, job_id: str) -> None:
        """Ask the job to stop: it ends CANCELLED with its transcript kept."""
        await self.handle(job_id).cancel()
