"""The ``warmloop`` command line. Errors are one clear line, never a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from warmloop.workers.clients import StackNotRunningError, connect, redis_options
from warmloop.workers.jobs import (
    InvalidJobError,
    QuotaExceededError,
    fit_batch_to_quota,
    stopped_how,
    submit_batch,
    submit_job,
)
from warmloop.workers.settings import Settings
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    JobInput,
    JobResult,
    JobStatus,
    id_problem,
)
from warmloop.workflows.profiles import UnknownProfileError, get_profile
from warmloop.workflows.tenants import DEFAULT_TENANT, job_workflow_id, tenant_problem

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Durable LLM agent jobs on warm vLLM prefix caches.")
dev_app = typer.Typer(no_args_is_help=True, help="The embedded dev stack.")
worker_app = typer.Typer(no_args_is_help=True, help="Run a worker process in the foreground.")
app.add_typer(dev_app, name="dev")
app.add_typer(worker_app, name="worker")
batch_app = typer.Typer(no_args_is_help=True, help="Batches of records as child jobs.")
schedule_app = typer.Typer(no_args_is_help=True, help="Temporal Schedules of batches.")
app.add_typer(batch_app, name="batch")
app.add_typer(schedule_app, name="schedule")
console = Console()
T = TypeVar("T")


def fail(msg: str, code: int = 1) -> NoReturn:
    Console(stderr=True).print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return asyncio.run(coro)
    except StackNotRunningError as e:
        fail(str(e))


def _settings(*, plugins: bool = True) -> Settings:
    """The settings; with ``plugins``, the profiles and toolsets they name are loaded too
    (a broken plugin is one line and exit 1, before anything starts)."""
    try:
        settings = Settings()
    except ValidationError as e:
        fail(f"invalid WARMLOOP_* settings: {e}")
    if plugins:
        _load_plugins(settings)
    return settings


def _load_plugins(settings: Settings) -> None:
    from warmloop.workers.plugins import PluginError, load_plugins

    try:
        load_plugins(plugins=settings.plugins, profile_paths=settings.profile_paths,
                     toolsets=False)
    except PluginError as e:
        fail(str(e))


# ---- dev stack ---------------------------------------------------------------------


@dev_app.command("up")
def dev_up() -> None:
    """Start (or keep) the embedded stack and wait until every part is healthy."""
    from warmloop.infra.stack import Stack, StackError

    stack = Stack(_settings(), log=lambda m: console.print(m, highlight=False))
    try:
        started = stack.up()
    except StackError as e:
        fail(str(e))
    console.print(f"stack up ({len(started)} part(s) started now). "
                  f"Temporal UI: http://127.0.0.1:{stack.settings.temporal_ui_port}  "
                  "Stop with: warmloop dev down")


@dev_app.command("down")
def dev_down() -> None:
    """Stop what `dev up` started."""
    from warmloop.infra.stack import Stack

    stopped = Stack(_settings(plugins=False)).down()
    console.print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


@dev_app.command("status")
def dev_status() -> None:
    """Show each part of the embedded stack."""
    from warmloop.infra.stack import Stack

    table = Table("part", "pid", "healthy", "log")
    for p in Stack(_settings(plugins=False)).status():
        pid = str(p.pid) if p.pid else ("external" if p.external else "-")
        table.add_row(p.name, pid, "yes" if p.healthy else "no", str(p.log))
    console.print(table)


# ---- workers -----------------------------------------------------------------------


@worker_app.command("agent")
def worker_agent() -> None:
    """Run an agent worker (workflows, tools, routing, storage)."""
    from warmloop.workers.agent_worker import main

    main()


@worker_app.command("inference")
def worker_inference(engine_id: str = typer.Option(..., "--engine-id")) -> None:
    """Run the inference worker for one engine of WARMLOOP_ENGINES."""
    from warmloop.workers.inference_worker import main

    main(["--engine-id", engine_id])


# ---- jobs --------------------------------------------------------------------------


def load_job_input(profile: str, path: Path, *, max_steps: int | None = None,
                   max_cost_usd: float | None = None) -> JobInput:
    """Read and validate a job's input file; raises ValueError with a clear message."""
    _settings()
    try:
        prof = get_profile(profile)
    except UnknownProfileError as e:
        raise ValueError(str(e)) from None
    try:
        task = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(task, dict):
        raise ValueError(f"{path} must hold one JSON object")
    try:
        prof.validate_task(task)
        limits = None if max_cost_usd is None else JobLimits.model_validate(
            {**prof.limits.model_dump(), "max_cost_usd": max_cost_usd})
        return JobInput(profile=profile, task=task, max_steps=max_steps, limits=limits)
    except ValidationError as e:
        raise ValueError(f"invalid input for {profile}: {e}") from None


@app.command()
def submit(
    profile: str = typer.Argument(..., help="Agent profile, e.g. ticket-triage."),
    input_file: Path = typer.Option(..., "--input", help="JSON file with the task."),
    job_id: str | None = typer.Option(None, "--job-id"),
    max_steps: int | None = typer.Option(None, "--max-steps", min=1, max=200),
    max_cost_usd: float | None = typer.Option(
        None, "--max-cost-usd", help="Cost cap in dollars (overrides the profile's); the "
        "job then runs only on engines that declare a price."),
    wait: bool = typer.Option(False, "--wait", help="Wait for the result."),
    tenant: str = typer.Option(
        "default", "--tenant", help="Whose job it is: its engine requests carry the "
        "tenant's cache_salt, its keys are the tenant's, its quota (WARMLOOP_TENANTS) "
        "applies. Its id is then <tenant>/<job id>."),
) -> None:
    """Start an agent job. The input is validated before anything starts, and so is the
    fleet: an engine must serve the profile's model and, for a cost cap, declare a price."""
    try:
        job = load_job_input(profile, input_file, max_steps=max_steps,
                             max_cost_usd=max_cost_usd)
        prof = get_profile(profile)
    except ValueError as e:
        fail(str(e))
    _fleet_must_serve(prof.model, job.limits or prof.limits)
    if job_id is not None and (bad := id_problem("job", job_id)):
        fail(bad)
    if (bad := tenant_problem(tenant)) is not None:
        fail(bad)
    job = job.model_copy(update={"tenant": tenant})
    jid = job_id or f"{profile}-{uuid.uuid4().hex[:10]}"
    wid = job_workflow_id(tenant, jid)
    # Signed in: the job records who submitted it, and its approval rules refuse that
    # person deciding its approvals.
    settings = _settings()
    if (who := _signed_in_subject(settings)) is not None:
        job = job.model_copy(update={"submitted_by": who})

    async def go() -> None:

        client = await connect(_settings())
        try:
            # A job id names one job for good: never a second run, even after it ended.
            handle = await submit_job(client, job, jid, _settings())
        except QuotaExceededError as e:
            fail(str(e))
        except WorkflowAlreadyStartedError:
            fail(f"job {wid} already exists; see `warmloop status {wid}`")
        console.print(f"started job {wid}")
        if wait:
            _print_result(await handle.result())

    run(go())


async def _handle(workflow_id: str, *, result_type: type = JobResult,  # type: ignore[no-untyped-def]
                  what: str = "job", client: Client | None = None):
    """The handle and description of ``workflow_id``; one clear line if there is none."""
    client = client or await connect(_settings())
    handle = client.get_workflow_handle(workflow_id, result_type=result_type)
    try:
        desc = await handle.describe()
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            fail(f"unknown {what} {workflow_id}")
        raise
    return handle, desc


@app.command()
def status(job_id: str) -> None:
    """Show where a job is."""

    async def go() -> None:
        handle, desc = await _handle(job_id)
        if desc.status == WorkflowExecutionStatus.RUNNING:
            st = await handle.query("status", result_type=JobStatus)
            console.print(f"{job_id}: RUNNING, step {st.step}, engine {st.engine_id or '-'}")
        elif desc.status == WorkflowExecutionStatus.COMPLETED:
            res = await handle.result()
            console.print(f"{job_id}: {res.state.value} after {len(res.steps)} steps "
                          f"({res.reason})")
        else:
            console.print(f"{job_id}: workflow {desc.status.name if desc.status else '?'}")

    run(go())


@app.command()
def result(job_id: str, as_json: bool = typer.Option(False, "--json")) -> None:
    """Print a finished job's result (waits while it runs)."""

    async def go() -> None:
        handle, _ = await _handle(job_id)
        res = await handle.result()
        if as_json:
            sys.stdout.write(res.model_dump_json(indent=2) + "\n")
        else:
            _print_result(res)

    run(go())


@app.command("jobs")
def jobs_list(
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's jobs."),
    profile: str | None = typer.Option(None, "--profile", help="Only this profile's jobs."),
    running: bool = typer.Option(False, "--running", help="Only jobs still running."),
    limit: int = typer.Option(50, "--limit", min=1, max=1000, help="At most this many."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per job."),
) -> None:
    """List jobs as Temporal's visibility shows them (a moment behind): running ones
    first, then the most recently ended."""
    from warmloop.workers.jobs import JobListing, list_jobs

    def row(j: JobListing) -> list[str]:
        state = j.state or "-"
        if j.status not in ("RUNNING", "COMPLETED"):  # the workflow's own ending
            state += f" ({j.status.lower()})"
        return [escape(j.job_id), j.tenant, j.profile or "-", state,
                _when(j.started_at), _when(j.closed_at)]

    _print_listing(lambda client: list_jobs(client, tenant=tenant, profile=profile,
                                            running=running, limit=limit),
                   as_json=as_json, what="jobs", folded=3, row=row,
                   columns=("job", "tenant", "profile", "state", "started (UTC)",
                            "ended (UTC)"))


ListedT = TypeVar("ListedT", bound=BaseModel)


def _print_listing(fetch: Callable[[Client], Awaitable[list[ListedT]]], *, as_json: bool,
                   what: str, columns: tuple[str, ...], folded: int,
                   row: Callable[[ListedT], list[str]]) -> None:
    """A listing command's output: one JSON object a line, or a table whose first
    ``folded`` columns wrap (ids are copied from there: never cut short) and whose last
    two, the times, do not. A bad filter (InvalidJobError) is one line and exit 1."""

    async def go() -> None:
        client = await connect(_settings(plugins=False))
        try:
            listed = await fetch(client)
        except InvalidJobError as e:
            fail(str(e))
        if as_json:
            for item in listed:
                sys.stdout.write(item.model_dump_json() + "\n")
            return
        if not listed:
            console.print(f"no {what}")
            return
        table = Table(*columns)
        for col in table.columns[:folded]:
            col.overflow = "fold"
        for col in table.columns[-2:]:
            col.no_wrap = True
        for item in listed:
            table.add_row(*row(item))
        console.print(table)

    run(go())


def _when(at: datetime | None) -> str:
    """A listing's time: UTC, to the second, on one line."""
    return at.astimezone(UTC).strftime("%m-%d %H:%M:%S") if at is not None else "-"


def _print_result(res: JobResult) -> None:
    console.print(f"[bold]{res.job_id}[/] {res.profile}: {res.state.value} ({res.reason})")
    if res.final:
        console.print(f"final: {json.dumps(res.final)}")
    table = Table("step", "engine", "route", "tool", "prompt", "cached", "out", "TTFT ms",
                  "latency ms")
    for s in res.steps:
        table.add_row(str(s.step), s.engine_id, s.route_reason,
                      s.tool or f"[red]invalid[/]: {s.error}", str(s.prompt_tokens),
                      str(s.cached_tokens), str(s.completion_tokens), f"{s.ttft_ms:.0f}",
                      f"{s.latency_ms:.0f}")
    console.print(table)
    failed = [s.failed_attempts for s in res.steps if s.failed_attempts is not None]
    if failed:  # counted in the job's tokens and cost, not in the steps' rows
        console.print(f"failed attempts: {sum(f.attempts for f in failed)} "
                      f"({sum(f.prompt_tokens for f in failed)} prompt, "
                      f"{sum(f.completion_tokens for f in failed)} completion tokens, "
                      f"${sum(f.cost_usd for f in failed):.6f}), in the figures below")
    u = res.usage
    console.print(f"cost: ${u.cost_usd:.6f}" if not u.cost_unknown_steps else
                  f"cost: unknown ({u.cost_unknown_steps} of {u.steps} steps ran on engines "
                  f"that declare no price; the priced ones cost ${u.cost_usd:.6f})")
    if res.transcript_key:
        console.print(f"transcript: s3://…/{res.transcript_key}")


@app.command()
def cancel(job_id: str) -> None:
    """Cancel a job: it ends as CANCELLED, with its transcript kept."""

    async def go() -> None:
        handle, desc = await _handle(job_id)
        if desc.status != WorkflowExecutionStatus.RUNNING:
            fail(f"job {job_id} is not running")
        await handle.cancel()
        res = await handle.result()
        console.print(f"{job_id}: {res.state.value} after {len(res.steps)} steps")

    run(go())


# ---- approvals: through the approvals service, as a verified person ----------------------

CLI_TOKEN_FILE = "cli-token"


def _signed_in_subject(settings: Settings) -> str | None:
    """The verified subject of the signed-in user (None: not signed in): what a job or
    batch records as its submitter, so approval rules refuse that person deciding it."""
    if _saved_token(settings) is None:
        return None
    return str(_api(settings, "GET", "/api/whoami")["subject"])


def _saved_token(settings: Settings) -> str | None:
    """The user's bearer token: WARMLOOP_TOKEN, else the one `warmloop login` saved."""
    if settings.token is not None and settings.token.get_secret_value():
        return settings.token.get_secret_value()
    path = settings.state_dir / CLI_TOKEN_FILE
    return path.read_text().strip() if path.exists() else None


def _token(settings: Settings) -> str:
    if (token := _saved_token(settings)) is not None:
        return token
    fail("no token: set WARMLOOP_TOKEN or run `warmloop login --token ...` (the embedded "
         f"stack's dev tokens are in {settings.state_dir / 'auth' / 'dev-tokens.json'})")


def _api(settings: Settings, method: str, path: str, *, body: dict[str, Any] | None = None,
         token: str | None = None) -> Any:
    """Call the approvals service with the user's token; a refusal is one line, exit 1."""
    import httpx

    url = settings.approvals_url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {token or _token(settings)}"}
    try:
        r = httpx.request(method, url, headers=headers, json=body, timeout=60)
    except httpx.HTTPError as e:
        fail(f"cannot reach the approvals service at {settings.approvals_url} ({e}); start it "
             "with `warmloop dev up` or `warmloop ui`, or set WARMLOOP_APPROVALS_URL")
    try:
        data = r.json()
    except ValueError:
        data = {"error": r.text[:200]}
    if r.status_code == 401:
        fail(f"not signed in: {data.get('error', 'bad token')}")
    if r.status_code >= 400:
        fail(f"refused: {data.get('error', r.reason_phrase) if isinstance(data, dict) else r.text}")
    return data


def _approval_path(job_id: str, approval_id: str, action: str) -> str:
    from urllib.parse import quote

    return f"/api/approvals/{quote(job_id, safe='')}/{quote(approval_id, safe='')}/{action}"


@app.command()
def login(token: str = typer.Option(..., "--token", prompt=True, hide_input=True,
                                    help="Your bearer token (OIDC access token or a dev token).")
          ) -> None:
    """Check a token with the approvals service and keep it for the approval commands."""
    settings = _settings(plugins=False)
    who = _api(settings, "GET", "/api/whoami", token=token)
    path = settings.state_dir / CLI_TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(token)
    path.chmod(0o600)
    console.print(f"signed in as {escape(who['subject'])} "
                  f"(roles: {escape(', '.join(who['roles']) or 'none')})")


@app.command()
def approvals() -> None:
    """List the pending approvals you may decide (needs your token)."""
    from warmloop.workflows.contracts import PendingApproval

    pending = [PendingApproval.model_validate(p)
               for p in _api(_settings(plugins=False), "GET", "/api/approvals")]
    if not pending:
        console.print("no pending approvals for you")
        return
    table = Table("approval", "tool and arguments", "approvers", "deadline (UTC)")
    for p in pending:
        # the model wrote the arguments: printed as text, never read as rich markup
        needed = (f" ({len(p.approved_by)}/{p.approvals_needed} approvals)"
                  if p.approvals_needed > 1 else "")
        table.add_row(escape(f"{p.job_id}\n{p.approval_id}")
                      + (" (escalated)" if p.escalated else "") + escape(needed),
                      escape(f"{p.tool}\n{json.dumps(p.arguments)}"),
                      escape("\n".join(p.approvers)),
                      p.deadline.strftime("%Y-%m-%d %H:%M:%S"))
    console.print(table)


def _decide(job_id: str, approval_id: str, approve: bool, comment: str) -> None:
    from warmloop.workflows.contracts import PendingApproval

    p = PendingApproval.model_validate(_api(
        _settings(plugins=False), "POST", _approval_path(job_id, approval_id, "decide"),
        body={"approve": approve, "comment": comment}))
    verb = "approved" if approve else "rejected"
    waiting = (f"; {p.approvals_needed - len(p.approved_by)} more approval needed"
               if approve and len(p.approved_by) < p.approvals_needed else "")
    console.print(escape(f"{verb} {p.approval_id} ({p.tool} {json.dumps(p.arguments)}) of job "
                         f"{job_id}{waiting}"))


@app.command()
def approve(job_id: str, approval_id: str,
            comment: str = typer.Option("", "--comment")) -> None:
    """Approve a pending tool call as the person your token names."""
    _decide(job_id, approval_id, True, comment)


@app.command()
def reject(job_id: str, approval_id: str,
           comment: str = typer.Option("", "--comment")) -> None:
    """Reject a pending tool call; the model is told and goes on (or the job ends)."""
    _decide(job_id, approval_id, False, comment)


@app.command()
def gateway(port: int = typer.Option(None, "--port",
                                     help="Default: WARMLOOP_GATEWAY_PORT (8500)."),
            host: str = typer.Option("127.0.0.1", "--host")) -> None:
    """Serve the OpenAI-compatible gateway (/v1/chat/completions, /v1/completions) in
    front of the live engines, in the foreground: session affinity, prefix routing,
    holds between a session's requests."""
    from warmloop.workers.gateway.__main__ import main as serve_gateway

    serve_gateway(["--host", host] + ([] if port is None else ["--port", str(port)]))


@app.command()
def ui(port: int = typer.Option(None, "--port", help="Default: WARMLOOP_INBOX_PORT (8300)."),
       host: str = typer.Option("127.0.0.1", "--host")) -> None:
    """Serve the web approval inbox (and the approvals API) in the foreground."""
    from warmloop.workers.inbox.__main__ import main as serve_inbox

    serve_inbox(host=host, port=port)


def parse_since(text: str) -> timedelta:
    """'90s', '15m', '2h', '7d' -> a timedelta."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        value, unit = float(text[:-1]), units[text[-1]]
    except (ValueError, KeyError, IndexError):
        raise typer.BadParameter(f"{text!r}: use a number and s, m, h or d (e.g. 2h)") from None
    return timedelta(seconds=value * unit)


@app.command()
def report(
    since: str = typer.Option("24h", "--since", help="Jobs closed within this window."),
    profile: str | None = typer.Option(None, "--profile"),
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's jobs."),
) -> None:
    """Per profile: jobs by terminal state, cost per task, cache hit share, tool-call
    success, TTFT per step and per task, from the jobs' recorded engine usage; then
    where the steps' time went, stage by stage; with jobs of several tenants, per
    tenant: jobs, tokens and cost."""

    if profile and (bad := id_problem("profile", profile)):  # it goes into a query's text
        fail(bad)
    if tenant is not None and (bad := tenant_problem(tenant)) is not None:
        fail(bad)  # it goes into a query's text too

    async def go() -> None:
        from warmloop.workers.report import breakdown_table, report_table, tenant_table
        from warmloop.workflows.tenants import tenant_of

        client = await connect(_settings())
        after = (datetime.now(UTC) - parse_since(since)).strftime("%Y-%m-%dT%H:%M:%SZ")
        q = f"WorkflowType = 'AgentJob' AND ExecutionStatus = 'Completed' AND CloseTime > '{after}'"
        if profile:
            q += f" AND WarmloopProfile = '{profile}'"
        if tenant is not None:
            q += f" AND WarmloopTenant = '{tenant}'"
        ids = [wf.id async for wf in client.list_workflows(q)]
        sem = asyncio.Semaphore(16)

        async def fetch(wid: str) -> JobResult:
            async with sem:
                return await client.get_workflow_handle(wid, result_type=JobResult).result()

        results = list(await asyncio.gather(*(fetch(w) for w in ids)))
        if not results:
            console.print(f"no jobs closed in the last {since}")
            return
        console.print(report_table(results, title=f"warmloop report: jobs closed in the last "
                                                  f"{since}"))
        if len({tenant_of(r.job_id) for r in results}) > 1:
            console.print(tenant_table(results, title="per tenant"))
        steps = [s for r in results for s in r.steps]
        if any(s.timing is not None for s in steps):
            console.print(breakdown_table(steps, title="where each step's time went"))

    run(go())


# ---- batches and schedules -----------------------------------------------------------


def _batch_input(source: str, profile: str, window: int | None, page_size: int,
                 max_steps: int | None, deadline: str | None = None,
                 max_window: int = 64, tenant: str = DEFAULT_TENANT) -> Any:
    from warmloop.workflows.batch_run import BatchInput

    settings = _settings()
    if (bad := tenant_problem(tenant)) is not None:
        fail(bad)
    try:
        get_profile(profile)
    except UnknownProfileError as e:
        fail(str(e))
    if not source.startswith("s3://"):
        path = Path(source).resolve()
        if not path.is_file():
            fail(f"cannot read {source}: no such file")
        source = str(path)
    due = None
    if deadline is not None:
        try:
            due = datetime.now(UTC) + parse_since(deadline)
        except typer.BadParameter:
            try:
                due = datetime.fromisoformat(deadline)
            except ValueError:
                fail(f"--deadline {deadline!r}: give a duration (30m, 2h) or an ISO time")
            if due.tzinfo is None:
                due = due.replace(tzinfo=UTC)
    try:
        inp = BatchInput(profile=profile, source=source, window=window, page_size=page_size,
                         max_steps=max_steps, deadline=due,
                         max_window=max(window or 1, max_window), tenant=tenant)
    except ValidationError as e:
        fail(f"invalid batch: {e.errors()[0]['msg']}")
    try:  # the tenant's jobs in flight bound the batch's window
        return fit_batch_to_quota(inp, settings.tenants.get(tenant))
    except InvalidJobError as e:
        fail(str(e))


_BATCH_TENANT_HELP = ("Whose batch it is: its jobs are the tenant's (their engine requests "
                      "carry its cache_salt, their transcripts and the result pages are "
                      "under tenants/<tenant>/, its quota (WARMLOOP_TENANTS) applies: at "
                      "most max_jobs_in_flight jobs at once). Its id is then "
                      "<tenant>/<batch id>.")


def _fleet_must_serve(model: str | None, limits: JobLimits) -> None:
    """Fail with what to change when no engine can serve a job that needs ``model`` under
    ``limits`` (``submit`` and ``batch run``: before anything starts)."""
    from warmloop.workers.fleet import check_fleet_serves

    try:
        run(check_fleet_serves(model, limits, _settings()))
    except ValueError as e:
        fail(str(e))


@batch_app.command("run")
def batch_run(
    source: str = typer.Argument(..., help="JSONL file, or s3://bucket/key.jsonl"),
    profile: str = typer.Option(..., "--profile"),
    window: int | None = typer.Option(
        None, "--window", min=1, max=1024, help="Jobs in progress at once. Default: asked "
        "of the fleet at each page (the jobs its KV pools hold for batch work)."),
    page_size: int = typer.Option(100, "--page-size", min=1, max=1_000),
    max_steps: int | None = typer.Option(None, "--max-steps", min=1),
    batch_id: str | None = typer.Option(None, "--batch-id"),
    follow: bool = typer.Option(False, "--follow", help="Show progress until it ends."),
    deadline: str | None = typer.Option(
        None, "--deadline", help="Finish within (30m, 2h) or by (ISO time): the window "
        "widens up to --max-window when the batch falls behind."),
    max_window: int = typer.Option(64, "--max-window", min=1, max=4096),
    tenant: str = typer.Option(DEFAULT_TENANT, "--tenant", help=_BATCH_TENANT_HELP),
) -> None:
    """Run every record of SOURCE as a batch-lane job; results go to S3 as JSONL. The
    fleet is checked first, as submit's: an engine must serve the profile's model and,
    for a cost cap, declare a price."""
    if batch_id is not None and (bad := id_problem("batch", batch_id)):
        fail(bad)
    inp = _batch_input(source, profile, window, page_size, max_steps, deadline, max_window,
                       tenant)
    # as submit's: a batch no engine can serve would end every record at its first step
    prof = get_profile(profile)
    _fleet_must_serve(prof.model, prof.limits)
    bid = batch_id or f"batch-{profile}-{uuid.uuid4().hex[:8]}"
    wid = job_workflow_id(tenant, bid)
    settings = _settings()
    if (who := _signed_in_subject(settings)) is not None:  # the jobs record who started them
        inp = inp.model_copy(update={"submitted_by": who})

    async def go() -> None:
        client = await connect(settings)
        try:
            handle = await submit_batch(client, inp, bid, settings)
        except QuotaExceededError as e:
            fail(str(e))
        except WorkflowAlreadyStartedError:
            fail(f"batch {wid} already exists")
        console.print(f"started batch {wid}")
        if follow:
            await _follow_batch(handle)

    run(go())


async def _follow_batch(handle: Any) -> None:
    from rich.progress import Progress

    from warmloop.workflows.batch_run import BatchRun

    with Progress(console=console) as bar:
        task = bar.add_task("records", total=None)
        result_task = asyncio.ensure_future(handle.result())
        while not result_task.done():
            p = await handle.query(BatchRun.progress)
            eta = p.estimated_finish.strftime("%H:%M:%S") if p.estimated_finish else "?"
            bar.update(task, completed=p.done + p.failed + p.bad,
                       total=p.done + p.failed + p.bad + p.remaining,
                       description=f"done {p.done} failed {p.failed} bad {p.bad} "
                                   f"running {p.running}/{p.window} "
                                   f"{'>=' if p.cost_unknown_steps else ''}${p.cost_usd:.4f} "
                                   f"eta {eta}"
                                   + (" (waiting for the tenant's quota)"
                                      if p.waiting_for_quota else ""))
            await asyncio.wait([result_task], timeout=1.0)
    res = result_task.result()
    _print_batch(res)


def _quota_wait(desc: Any) -> str:
    """Why a batch's next job waits: the last refusal of its slot claim (Temporal keeps
    it with the pending activity), or what it waits for in general."""
    for act in desc.raw_description.pending_activities:
        if act.activity_type.name == "claim_job_slot" and act.last_failure.message:
            return str(act.last_failure.message)
    return ("the next job waits for its tenant's quota (a slot under max_jobs_in_flight, "
            "or the hour's tokens_per_hour)")


def _batch_cost(usd: float, unknown_steps: int) -> str:
    """A batch's dollars, said to be a lower bound when some steps ran on engines that
    declare no price (their cost is unknown, not zero)."""
    if not unknown_steps:
        return f"${usd:.6f}"
    return f"at least ${usd:.6f} ({unknown_steps} steps on unpriced engines)"


def _result_pages(res: Any) -> str:
    """The result pages' keys; past a few, where they all are."""
    if res.pages > 5 and res.results_prefix:
        return f"{res.pages} pages under {res.results_prefix} (page-00001.jsonl, ...)"
    return ", ".join(res.result_keys)


def _print_batch(res: Any) -> None:
    table = Table(title=f"batch {res.batch_id} ({res.profile})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    outcomes = ", ".join(f"{k} {v}" for k, v in res.by_state.items()) or "-"
    for name, value in [("state", f"{res.state}" + (f": {res.reason}" if res.reason else "")),
                        ("records", res.records), ("jobs ended", res.done),
                        ("failed", res.failed), ("bad records (skipped)", res.bad),
                        ("by outcome", outcomes),
                        ("cache hit share", f"{res.cache_hit_share:.1%}"),
                        ("cost", _batch_cost(res.cost_usd, res.cost_unknown_steps)),
                        ("cost per record", _batch_cost(res.cost_usd / max(1, res.done),
                                                        res.cost_unknown_steps)),
                        ("makespan", f"{res.makespan_s:.1f}s"),
                        ("results", _result_pages(res))]:
        table.add_row(name, str(value))
    console.print(table)


@batch_app.command("resume")
def batch_resume(
    batch_id: str = typer.Argument(..., help="A batch that was cancelled or terminated, "
                                   "or whose source could not be read."),
    new_batch_id: str | None = typer.Option(
        None, "--batch-id", help="The new batch's id (default <batch id>-from-L<line>)."),
    follow: bool = typer.Option(False, "--follow", help="Show progress until it ends."),
    keep_cancelled: bool = typer.Option(
        False, "--keep-cancelled", help="Do not run again the lines whose jobs the "
        "batch's cancel stopped (their outcome stays CANCELLED)."),
) -> None:
    """Go on where BATCH_ID stopped: a new batch over the same source, profile, tenant
    and options (not its deadline), from the first line without an outcome, and first
    the lines whose jobs its cancel stopped (the lines between them that finished are
    not run again). A terminated batch is read back from Temporal: the new batch first
    writes the page the old one never wrote, then runs that page's jobs that never
    started or that the stop cut short."""
    from warmloop.workers.jobs import resumed_batch

    if new_batch_id is not None and (bad := id_problem("batch", new_batch_id)):
        fail(bad)
    settings = _settings()

    async def go() -> None:
        client = await connect(settings)
        try:
            inp, ended, new = await resumed_batch(client, batch_id, new_batch_id,
                                                rerun_cancelled=not keep_cancelled)
        except InvalidJobError as e:
            fail(str(e))
        tenant = inp.tenant
        if (who := _signed_in_subject(settings)) is not None:  # whoever resumes starts it
            inp = inp.model_copy(update={"submitted_by": who})
        try:
            handle = await submit_batch(client, inp, new, settings)
        except (QuotaExceededError, InvalidJobError) as e:
            fail(str(e))
        except WorkflowAlreadyStartedError:
            fail(f"batch {job_workflow_id(tenant, new)} already exists; give --batch-id")
        skipped = (f", skipping {len(inp.skip_lines)} line(s) with outcomes"
                   if inp.skip_lines else "")
        console.print(f"started batch {job_workflow_id(tenant, new)} from line "
                      f"{inp.start_line} of {inp.source}{skipped} ({batch_id} {ended})")
        if follow:
            await _follow_batch(handle)

    run(go())


@batch_app.command("list")
def batch_list(
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's batches."),
    running: bool = typer.Option(False, "--running", help="Only batches still running."),
    limit: int = typer.Option(50, "--limit", min=1, max=1000, help="At most this many."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per batch."),
) -> None:
    """List batches (scheduled runs too) as Temporal's visibility shows them, running
    ones first; `batch status` tells how far one is."""
    from warmloop.workers.jobs import BatchListing, list_batches

    def row(b: BatchListing) -> list[str]:
        return [escape(b.batch_id), b.tenant, b.status.lower(), _when(b.started_at),
                _when(b.closed_at)]

    _print_listing(lambda client: list_batches(client, tenant=tenant, running=running,
                                               limit=limit),
                   as_json=as_json, what="batches", folded=2, row=row,
                   columns=("batch", "tenant", "status", "started (UTC)", "ended (UTC)"))


@batch_app.command("cancel")
def batch_cancel(batch_id: str) -> None:
    """Cancel a running batch: its running jobs are cancelled too (each ends CANCELLED,
    its transcript kept), their outcomes written with the page's; later records do not
    run. Waits for it to end and prints its result."""

    async def go() -> None:
        from warmloop.workflows.batch_run import BatchResult

        handle, desc = await _handle(batch_id, result_type=BatchResult, what="batch")
        if desc.status != WorkflowExecutionStatus.RUNNING:
            fail(f"batch {batch_id} is not running")
        await handle.cancel()
        _print_batch(await handle.result())

    run(go())


@batch_app.command("status")
def batch_status(batch_id: str) -> None:
    """Progress of a running batch, or its result (or, for one terminated, the page it
    stopped on)."""

    async def go() -> None:
        from warmloop.workflows.batch_run import BatchResult, BatchRun, results_prefix

        client = await connect(_settings())
        handle, desc = await _handle(batch_id, result_type=BatchResult, what="batch",
                                     client=client)
        if desc.status == WorkflowExecutionStatus.RUNNING:
            p = await handle.query(BatchRun.progress)
            eta = p.estimated_finish.isoformat(timespec="seconds") if p.estimated_finish else "?"
            console.print(f"{batch_id}: running page {p.pages + 1}; done {p.done}, failed "
                          f"{p.failed}, bad {p.bad}, running {p.running} of window {p.window}, "
                          f"{p.remaining} left, ${p.cost_usd:.6f}, estimated finish {eta}"
                          + (f" (deadline {p.deadline.isoformat(timespec='seconds')})"
                             if p.deadline else ""))
            if p.window_why:
                console.print(f"window: {p.window_why}")
            if p.waiting_for_quota:
                console.print(f"waiting: {_quota_wait(desc)}")
        elif desc.status == WorkflowExecutionStatus.COMPLETED:
            _print_batch(await handle.result())
        else:  # terminated, failed, timed out: no result says where it stopped
            from warmloop.activities.batch_recovery import run_input

            inp = await run_input(client, (await handle.fetch_history()).events)
            pages = inp.pages_done
            how = stopped_how(desc.status, unknown="ended")
            console.print(f"{batch_id}: {how} without a result, on its page {pages + 1} "
                          f"({pages} page(s) of outcomes under {results_prefix(batch_id)}); "
                          f"`warmloop batch resume {batch_id}` writes that page from its "
                          "jobs and goes on")

    run(go())


@schedule_app.command("create")
def schedule_create(
    name: str,
    cron: str = typer.Option(..., "--cron", help='e.g. "0 2 * * *" (UTC)'),
    profile: str = typer.Option(..., "--profile"),
    input_source: str = typer.Option(..., "--input", help="JSONL file or s3://bucket/key"),
    window: int | None = typer.Option(
        None, "--window", min=1, max=1024, help="Jobs in progress at once. Default: asked "
        "of the fleet at each page."),
    tenant: str = typer.Option(DEFAULT_TENANT, "--tenant", help=_BATCH_TENANT_HELP),
) -> None:
    """Run a batch on a cron schedule; a run still going when the next is due is skipped."""
    from temporalio.client import (
        Schedule,
        ScheduleActionStartWorkflow,
        ScheduleAlreadyRunningError,
        ScheduleOverlapPolicy,
        SchedulePolicy,
        ScheduleSpec,
    )

    if (bad := id_problem("schedule", name)) is not None:
        fail(bad)  # its runs' ids start with it
    inp = _batch_input(input_source, profile, window, 100, None, tenant=tenant)

    async def go() -> None:
        from warmloop.workflows.agent_job import SA_TENANT
        from warmloop.workflows.batch_run import BatchRun

        client = await connect(_settings())
        try:
            # Temporal appends each run's time to the id: <tenant>/sched-<name>-<time>
            await client.create_schedule(name, Schedule(
                action=ScheduleActionStartWorkflow(
                    BatchRun.run, inp, id=job_workflow_id(tenant, f"sched-{name}"),
                    task_queue=AGENT_TASK_QUEUE, typed_search_attributes=TypedSearchAttributes(
                        [SearchAttributePair(SA_TENANT, tenant)])),
                spec=ScheduleSpec(cron_expressions=[cron]),
                policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
            ))
        except ScheduleAlreadyRunningError:
            fail(f"schedule {name} already exists")
        except RPCError as e:
            fail(f"cannot create schedule {name}: {e.message}")
        console.print(f"created schedule {name} ({cron}, {profile}, {inp.source})")

    run(go())


def _schedule_op(name: str, op: str) -> None:
    async def go() -> None:
        client = await connect(_settings())
        handle = client.get_schedule_handle(name)
        try:
            if op == "pause":
                await handle.pause(note="paused from the warmloop CLI")
            elif op == "unpause":
                await handle.unpause()
            elif op == "trigger":
                await handle.trigger()
            elif op == "delete":
                await handle.delete()
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:
                fail(f"unknown schedule {name}")
            raise
        console.print(f"{op}: {name}")

    run(go())


@schedule_app.command("list")
def schedule_list() -> None:
    """List schedules."""

    async def go() -> None:
        client = await connect(_settings())
        table = Table("schedule", "paused", "next run (UTC)", "recent runs")
        async for s in await client.list_schedules():
            info = s.info
            nxt = info.next_action_times[0].strftime("%Y-%m-%d %H:%M") if info and \
                info.next_action_times else "-"
            recent = str(len(info.recent_actions)) if info else "0"
            table.add_row(s.id, "yes" if s.schedule and s.schedule.state.paused else "no",
                          nxt, recent)
        console.print(table)

    run(go())


@schedule_app.command("pause")
def schedule_pause(name: str) -> None:
    """Pause a schedule."""
    _schedule_op(name, "pause")


@schedule_app.command("unpause")
def schedule_unpause(name: str) -> None:
    """Resume a paused schedule."""
    _schedule_op(name, "unpause")


@schedule_app.command("trigger")
def schedule_trigger(name: str) -> None:
    """Start a scheduled batch now."""
    _schedule_op(name, "trigger")


@schedule_app.command("delete")
def schedule_delete(name: str) -> None:
    """Delete a schedule (running batches go on)."""
    _schedule_op(name, "delete")


def _held(worker_tokens: int, worker_holds: int, gateway: list[dict[str, Any]]) -> str:
    tokens = worker_tokens + sum(int(h.get("tokens", 0)) for h in gateway)
    return f"{tokens:,} tok in {worker_holds + len(gateway)} holds"


@app.command()
def engines(as_json: bool = typer.Option(False, "--json", help="One JSON object per engine.")
            ) -> None:
    """List the live engines: load, KV pool, and what the prefix directory knows."""

    async def go() -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        from warmloop.activities.admission import batch_slots_in_use
        from warmloop.activities.directory import PrefixDirectory
        from warmloop.activities.holds import HOLDS_KEY
        from warmloop.activities.registry import EngineRegistry
        from warmloop.workers.gateway.holds import gateway_hold_records

        s = _settings()
        r = aioredis.Redis.from_url(s.redis_url, **redis_options(s))
        try:
            registry = EngineRegistry(r, ttl_s=s.engine_ttl_s)
            live = await registry.live()
            ids = [hb.engine_id for hb in live]
            in_flight = await registry.in_flight(ids)
            directory = PrefixDirectory(r)
            blocks = {e: await directory.engine_blocks(e) for e in ids}
            holds = {e: int(await r.hlen(HOLDS_KEY.format(e))) for e in ids}
            # the gateways' holds (sessions of agents with their own loop), a table per
            # gateway replica: the inference worker rewrites its own whole at every tick
            gateway_holds = await gateway_hold_records(r, ids, await registry.gateways())
            # batch calls running now, fleet-wide: the worker's and every gateway's
            slots = await batch_slots_in_use(r, ids)
        except RedisError as err:
            fail(f"cannot reach Redis at {s.redis_url} ({err}); is the stack up?")
        if as_json:
            for hb in live:
                print(json.dumps({**hb.model_dump(), "in_flight": in_flight[hb.engine_id],
                                  "directory_blocks": blocks[hb.engine_id],
                                  "holds": holds[hb.engine_id],
                                  "batch_slots_in_use": slots[hb.engine_id],
                                  "gateway_holds": len(gateway_holds[hb.engine_id]),
                                  "gateway_held_tokens": sum(
                                      int(h.get("tokens", 0))
                                      for h in gateway_holds[hb.engine_id])}))
            return
        table = Table("engine", "model", "running", "waiting", "routed", "batch K",
                      "KV use", "KV pool", "held", "directory", "mode")
        for hb in live:
            table.add_row(hb.engine_id, hb.model + ("" if hb.priced else " (no price)"),
                          str(hb.running),
                          str(hb.waiting), str(in_flight[hb.engine_id]),
                          "-" if hb.batch_limit is None
                          else f"{slots[hb.engine_id]}/{hb.batch_limit}",
                          f"{hb.kv_usage:.0%}", f"{hb.kv_capacity_tokens:,} tok",
                          _held(hb.held_tokens, holds[hb.engine_id],
                                gateway_holds[hb.engine_id]),
                          f"{blocks[hb.engine_id]:,} blocks of {hb.block_size}",
                          "precise (KV events)" if hb.precise else "estimated")
        console.print(table if live else "no live engines")

    run(go())


@app.command()
def calibrate(
    engine_id: str = typer.Argument(..., help="A configured engine's id (warmloop engines)."),
    out: Path = typer.Option(None, "--out", help="The JSON file to write. Default: "
                             "<state dir>/calibration/<engine>.json."),
    quick: bool = typer.Option(False, "--quick", help="A few seconds' load, for a first look."),
    gpu_hour_usd: float = typer.Option(None, "--gpu-hour-usd", min=0.0, help="What an hour "
                                       "of the engine costs. Default: its declared price's, "
                                       "else its preset's."),
    no_store: bool = typer.Option(False, "--no-store", help="Print and write the file; do "
                                  "not publish it to Redis (the engine's worker reads it there)."),
) -> None:
    """Measure an engine (prefill rate by prompt length, decode step by batch size, KV
    pool) and publish the calibration its worker heartbeats with and every policy reads.
    Run it while the engine serves nothing else."""
    from warmloop.workers.calibrate import (
        QUICK_LOAD,
        CalibrationError,
        CalibrationLoad,
        calibration_file,
        measure_engine,
        store_calibration,
        summary,
        write_calibration_file,
    )

    s = _settings(plugins=False)
    try:
        engine = s.engine(engine_id)
    except ValueError as e:
        fail(str(e))
    base = s.engine_calibration_base(engine)
    usd = gpu_hour_usd if gpu_hour_usd is not None else (
        engine.price.gpu_usd_per_hour if engine.price is not None
        and engine.price.gpu_usd_per_hour is not None else base.gpu_hour_usd)

    async def go() -> None:
        import httpx
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as http:
            try:
                cal = await measure_engine(
                    http, engine.url, engine.model, engine_id=engine.id, gpu_hour_usd=usd,
                    base=base,
                    max_model_len=s.engine_max_model_len if s.manages_engines else None,
                    load=QUICK_LOAD if quick else CalibrationLoad())
            except CalibrationError as e:
                fail(str(e))
        path = out or calibration_file(s.state_dir, engine.id)
        write_calibration_file(path, cal)
        console.print(summary(cal))
        console.print(f"written to {path}")
        if no_store:
            return
        r = aioredis.Redis.from_url(s.redis_url, **redis_options(s))
        try:
            await store_calibration(r, engine.id, cal)
        except RedisError as err:
            fail(f"measured, but cannot reach Redis at {s.redis_url} ({err}); the file "
                 f"{path} has it")
        finally:
            await r.aclose()
        console.print(f"published: engine {engine.id}'s worker heartbeats with it from its "
                      "next refresh")

    run(go())


@app.command()
def profiles() -> None:
    """List every loaded profile, its tools (and where each runs) and the plugin it came
    from (entry points, WARMLOOP_PLUGINS, WARMLOOP_PROFILE_PATHS)."""
    from warmloop.workflows.profiles import REGISTRY, ActivityRunner, HttpRunner, PythonRunner

    _settings()
    table = Table("profile", "model", "tools", "approvals", "source")
    for reg in REGISTRY.registered():
        p = reg.profile
        tools = []
        for t in sorted(p.tools, key=lambda t: t.name):
            r = t.runner
            where = ("finish" if t.finishes_job else "python" if isinstance(r, PythonRunner)
                     else "http" if isinstance(r, HttpRunner)
                     else f"activity@{r.task_queue}" if isinstance(r, ActivityRunner)
                     else "toolset")
            tools.append(f"{t.name} ({where})")
        table.add_row(p.name, p.model or "any", ", ".join(tools),
                      ", ".join(a.kind for a in p.approvals) or "-", reg.source)
    console.print(table)


@app.command()
def pauses() -> None:
    """How long each tool and approval kind keeps jobs waiting (the hold/release input)."""

    async def go() -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        from warmloop.activities.pauses import PauseStats
        from warmloop.workflows.profiles import REGISTRY

        s = _settings()
        r = aioredis.Redis.from_url(s.redis_url, **redis_options(s))
        try:
            rows = await PauseStats(r).summaries(
                {n: REGISTRY.get(n) for n in REGISTRY.names()})
        except RedisError as err:
            fail(f"cannot reach Redis at {s.redis_url} ({err}); is the stack up?")
        if not rows:
            console.print("no pauses recorded yet")
            return
        table = Table("profile", "pause", "samples", "p50", "p90", "p99", "from")
        for row in rows:
            table.add_row(row.profile, row.kind, str(row.samples), _duration(row.p50_s),
                          _duration(row.p90_s), _duration(row.p99_s),
                          "profile prior" if row.from_prior else "observed")
        console.print(table)

    run(go())


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


@app.command()
def view(job_id: str, approval_id: str = typer.Argument(None)) -> None:
    """Open a job's pending approvals (as the person your token names): prints them and
    tells the job, which warms its prefix again so the step after your decision starts
    from a warm cache."""
    from warmloop.workflows.contracts import PendingApproval

    settings = _settings(plugins=False)
    pending = [PendingApproval.model_validate(p)
               for p in _api(settings, "GET", "/api/approvals")]
    mine = [p for p in pending if p.job_id == job_id
            and (not approval_id or p.approval_id == approval_id)]
    if not mine:
        console.print(f"{escape(job_id)} has no pending approvals you may decide")
        return
    for p in mine:
        console.print(escape(f"{p.approval_id}: {p.tool} {json.dumps(p.arguments)} "
                             f"(approvers: {', '.join(p.approvers)}; deadline "
                             f"{p.deadline:%Y-%m-%d %H:%M:%S} UTC)"))
        _api(settings, "POST", _approval_path(job_id, p.approval_id, "viewed"))


async def _doctor_timers(settings: Settings) -> bool:
    """Print whether the Temporal server fires a short timer when due; True if late."""
    from warmloop.workers.timer_check import TIMER_SETTINGS_HINT, check_timers

    try:
        client = await connect(settings)
    except RuntimeError as err:
        console.print(f"temporal timers: not checked (cannot reach Temporal: {err})")
        return False
    check = await check_timers(client, timeout_s=20.0)
    if check.late_s is None:
        console.print("temporal timers: not checked (the probe did not finish within 20 s; "
                      f"is an agent worker up? {check.error})")
        return False
    if check.late:
        console.print(f"[bold red]temporal timers[/]: a {check.sleep_s:.1f} s timer fired "
                      f"{check.late_s * 1000:.0f} ms late; {TIMER_SETTINGS_HINT}")
        return True
    console.print(f"temporal timers: a {check.sleep_s:.1f} s timer fired "
                  f"{check.late_s * 1000:.0f} ms after due")
    return False


@app.command()
def doctor(timers: bool = typer.Option(
        True, "--timers/--no-timers",
        help="Time one short Temporal timer (an agent worker must be up; up to 20 s).")
           ) -> None:
    """Check what costs cache hits and time: prompt prefixes that changed where they
    should not (cache busts), how well the prefix directory predicts the engines'
    caches, and whether the Temporal server fires short timers when due."""

    async def go() -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        from warmloop.activities.cachebust import bust_report
        from warmloop.activities.directory import PrefixDirectory

        s = _settings()
        r = aioredis.Redis.from_url(s.redis_url, **redis_options(s))
        try:
            counts, recent = await bust_report(r)
            acc = await PrefixDirectory(r).accuracy()
        except RedisError as err:
            fail(f"cannot reach Redis at {s.redis_url} ({err}); is the stack up?")
        if not counts:
            console.print("cache busts: none seen (every job of a profile shared its stable "
                          "prefix; every step extended its job's previous prompt)")
        else:
            table = Table("profile", "kind", "busts", "last job", "first differing block")
            for (profile, kind), n in sorted(counts.items()):
                last = next((b for b in recent if b.profile == profile and b.kind == kind), None)
                table.add_row(profile, kind, str(n), last.job_id if last else "-",
                              f"{last.block} (token {last.token_offset})" if last else "-")
            console.print("[bold red]cache busts[/]: a prefix changed where it should not; "
                          "look for a timestamp, id or reordered tools before that token")
            console.print(table)
        steps = acc.get("steps", 0)
        if steps:
            console.print(
                f"prefix directory: {steps} steps; predicted {acc['predicted']:,} cached tokens, "
                f"engines reported {acc['actual']:,} "
                f"({acc['predicted'] / max(1, acc['actual']):.0%}); exact on "
                f"{acc['exact'] / steps:.0%} of steps; mean abs error "
                f"{acc['abs_error'] / steps:.0f} tokens")
        else:
            console.print("prefix directory: no routed steps yet")
        late = timers and await _doctor_timers(s)
        if counts or late:
            raise typer.Exit(1)

    run(go())


@app.command()
def demo(
    jobs: int = typer.Option(20, "--jobs", min=1, max=500),
    max_steps: int = typer.Option(8, "--max-steps", min=1, max=50),
    invoices: int = typer.Option(0, "--invoices", min=0, max=500,
                                 help="Also run this many invoice-reconciliation jobs."),
) -> None:
    """Run ticket-triage jobs (and invoice jobs) on the running stack, grade each against
    its ground truth and print the report."""
    from warmloop.workers.demo import run_demo

    run(run_demo(_settings(), n_jobs=jobs, max_steps=max_steps, console=console,
                 invoice_jobs=invoices))


@app.command()
def replay(
    trace: Path = typer.Argument(..., help="JSONL: one recorded job per line (README: "
                                 "Replay your traces)."),
    window: int = typer.Option(8, "--window", min=1, max=1024, help="Jobs running at once."),
    routing: list[str] = typer.Option(
        ["cache_aware"], "--routing",
        help="Routing policy; repeat it to compare side by side: cache_aware (warmloop), "
        "round_robin, least_loaded."),
    reset: bool = typer.Option(True, "--reset/--no-reset",
                               help="Reset the engines' prefix caches before each policy."),
    arrivals: bool = typer.Option(
        False, "--arrivals", help="Start each job at its line's arrival_s (seconds after "
        "the earliest line's), as production did, instead of keeping --window jobs "
        "running; every line needs one."),
    speed: float = typer.Option(1.0, "--speed", min=0.01, max=1000.0,
                                help="With --arrivals: play the arrivals this many times "
                                "faster."),
) -> None:
    """Replay recorded jobs on the real engines, once per routing policy: every step is
    generated through the real routing and holds, but the transcript gets the recorded
    calls and results, so each policy sends the same prompts. Prints hit rate and prefill
    tokens (the engines' counters), cost, TTFT, makespan and a prompt digest per policy."""
    from warmloop.workers import replay as rp
    from warmloop.workflows.trace import TraceError

    settings = _settings()
    try:
        policies = [rp.routing_policy(r) for r in routing]
        prepared = rp.prepare(rp.load_trace(trace), str(trace))
    except (TraceError, ValueError) as e:
        fail(f"{trace}: {e}" if isinstance(e, TraceError) else str(e))
    if arrivals and (why := rp.arrival_problem(prepared)):
        fail(f"{trace}: {why}")
    pace = speed if arrivals else None
    err = Console(stderr=True)

    async def go() -> None:
        client = await connect(settings)
        try:
            runs = await rp.replay(settings, prepared, policies, client=client, window=window,
                                   reset=reset, log=err, speed=pace)
        except RuntimeError as e:
            fail(str(e))
        rp.print_report(console, prepared, runs, window, pace)

    run(go())


_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True,
                 "help_option_names": []}


@app.command(context_settings=_PASS_THROUGH)
def simulate(ctx: typer.Context) -> None:
    """Simulate a GPU fleet running warmloop's own policies (--help for options)."""
    from warmloop.sim.cli import simulate_main
    raise typer.Exit(simulate_main(list(ctx.args)))


@app.command(context_settings=_PASS_THROUGH)
def forecast(ctx: typer.Context) -> None:
    """Forecast a profile's cost per task from observed jobs (--help for options)."""
    from warmloop.sim.cli import forecast_main
    raise typer.Exit(forecast_main(list(ctx.args)))


def main() -> None:
    """The console script. Exits without interpreter teardown: temporalio's native
    runtime has been seen to crash there (SIGSEGV after a command had finished)."""
    code = 0
    try:
        app()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
