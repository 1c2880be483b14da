"""Tools the agents call, run as the ``run_tool`` activity on the agent task queue.

Three ways a tool runs here: the profile's ``Toolset`` (the bundled agents), a Python
function (``@warmloop.tool``) or an HTTP endpoint. The fourth, a user's own Temporal
activity, is scheduled by the workflow on the user's task queue and never comes here
(nor is it hedged).

A read-only tool's call may be hedged inside the one ``run_tool`` activity: past the
tool's p95 a second identical request runs beside the first, the first answer wins and
the other is cancelled (``warmloop.activities.tools.hedging``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from warmloop.activities.pauses import PauseStats, tool_kind
from warmloop.activities.tools.base import (
    EffectLedger,
    EffectRecord,
    LedgerUnavailableError,
    ToolOutcome,
    Toolset,
)
from warmloop.activities.tools.functions import resolve_function_tool
from warmloop.activities.tools.hedging import Hedging, race
from warmloop.activities.tools.ticket_triage import TicketTriageTools
from warmloop.workflows.contracts import ToolRequest, ToolResult
from warmloop.workflows.profiles import (
    HttpRunner,
    Profile,
    PythonRunner,
    ToolSpec,
    UnknownProfileError,
    get_profile,
)
from warmloop.workflows.profiles.function_tools import FunctionTool, ToolContext
from warmloop.workflows.tenants import s3_prefix, split_job_id
from warmloop.workflows.tool_results import (
    as_model_text,
    cut_for_prompt,
    effect_idempotency_key,
    idempotency_key,
)

log = structlog.get_logger(__name__)

RETRY_STATUSES = frozenset({408, 425, 429})
"""4xx answers that mean "try again", not "your arguments are wrong"."""


def call_key(req: ToolRequest) -> str:
    """The (job, step) idempotency key of a call: what a tool without an
    ``effect_key`` is made idempotent with."""
    return idempotency_key(req.job_id, req.step, req.name)


class ToolActivities:
    """Runs tools; large outputs go to S3 whole, the transcript keeps a cut preview.

    Side-effect tools apply at most once per effect: per the identity their spec
    declares (``ToolSpec.effect_key``: an invoice paid once, whatever the step), else
    per (job, step). A toolset's ``effect`` goes through the ledger; a function or HTTP
    tool's result is recorded there; a repeat of a call that already succeeded returns
    the recorded result without calling again. A call naming another record than the
    job's task (``ToolSpec.task_args``) is refused before anything runs. Without Redis
    a side-effect call fails retryably (``EffectLedgerUnavailable``) and applies
    nothing.

    A read-only tool (``ToolSpec.read_only``) in a job that allows it
    (``ToolRequest.hedge``) is hedged per ``hedging`` (default: thresholds from
    ``pauses``, counts kept in this process only). Side-effect tools never are.
    """

    def __init__(self, toolsets: list[Toolset] | dict[str, Toolset], ledger: EffectLedger, *,
                 s3: Any, bucket: str, pauses: PauseStats | None = None,
                 http: httpx.AsyncClient | None = None,
                 resolve_function: Callable[[str], FunctionTool] | None = None,
                 hedging: Hedging | None = None) -> None:
        self._pauses = pauses
        self.hedging = hedging or Hedging(pauses)
        self._toolsets = (dict(toolsets) if isinstance(toolsets, dict)
                          else {t.profile: t for t in toolsets})
        self._ledger = ledger
        self._s3 = s3
        self._bucket = bucket
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0))
        self._resolve = resolve_function or resolve_function_tool
        self._functions: dict[str, FunctionTool] = {}

    async def aclose(self) -> None:
        """Close the HTTP client (the worker's shutdown)."""
        await self._http.aclose()

    @activity.defn(name="run_tool")
    async def run_tool(self, req: ToolRequest) -> ToolResult:
        try:
            profile = get_profile(req.profile)
            spec = profile.tool(req.name)
        except (UnknownProfileError, KeyError) as e:
            raise ApplicationError(f"no tool {req.name!r} in profile {req.profile!r}: {e}",
                                   type="UnknownTool", non_retryable=True) from None
        with structlog.contextvars.bound_contextvars(job_id=req.job_id, step=req.step):
            started = time.monotonic()
            result = await self._run_once(profile, spec, req)
            if self._pauses is not None:
                await self._pauses.record(req.profile, tool_kind(req.name),
                                          time.monotonic() - started)
            result = await self._cut(profile, req, result)
            log.info("tool_ran", tool=req.name, ok=result.ok)
        return result

    async def _run_once(self, profile: Profile, spec: ToolSpec, req: ToolRequest) -> ToolResult:
        refusal = profile.out_of_task(spec, req.task_id, req.arguments)
        if refusal is not None:
            log.info("tool_refused_out_of_task", tool=req.name)
            return ToolResult(ok=False, output=refusal)
        if not spec.side_effect:
            return await self._read(profile, spec, req)
        try:
            return await self._apply_once(profile, spec, req)
        except LedgerUnavailableError as e:
            # Retryable: Temporal runs the call again per the tool's retry policy; an
            # effect is never applied without its ledger record.
            log.warning("effect_ledger_unavailable", tool=req.name, error=str(e))
            raise ApplicationError(f"tool {req.name} not run: {e}",
                                   type="EffectLedgerUnavailable") from e

    async def _read(self, profile: Profile, spec: ToolSpec, req: ToolRequest) -> ToolResult:
        """A call without side effect; hedged when the tool is read-only, the job allows
        it and the tool runs where a second request can run beside the first."""
        key = call_key(req)
        if not (self.hedging.eligible(spec, req.hedge) and self._concurrent(spec, req)):
            return (await self._call(spec, req, key)).result
        hedging, started = self.hedging, time.monotonic()
        hedging.earn(profile.name, spec.name)
        raced = await race(lambda second: self._call(spec, req, key, hedge=second),
                           delay_s=hedging.delay_s(profile, spec),
                           allow=lambda: hedging.allow(profile.name, spec.name))
        await hedging.record(profile.name, spec.name, raced, time.monotonic() - started)
        return raced.value.result

    def _concurrent(self, spec: ToolSpec, req: ToolRequest) -> bool:
        """A second request can run beside the first: a function or HTTP tool, or a
        toolset with its own ``arun`` (the default runs ``run`` on the event loop, which
        would block until the first request ends)."""
        if isinstance(spec.runner, PythonRunner | HttpRunner):
            return True
        toolset = self._toolsets.get(req.profile)
        return toolset is not None and type(toolset).arun is not Toolset.arun

    async def _apply_once(self, profile: Profile, spec: ToolSpec, req: ToolRequest
                          ) -> ToolResult:
        """A side-effect call, at most once per effect: the ledger is read before the
        tool runs (a repeat never runs it), and written after; the record that stands
        (ours, or a concurrent attempt's) is what the model reads."""
        identity = spec.effect_identity(req.task_id, req.arguments)
        owner = spec.effect_owner(req.job_id)
        done = await self._ledger.recorded(req.job_id, req.step, identity, owner)
        if done is not None and done.output is not None:
            await self._ledger.note_repeat(req.job_id)
            return self._repeat(profile, spec, req, done)
        outcome = await self._call(spec, req, effect_idempotency_key(
            req.job_id, req.step, req.name, identity, owner=owner))
        if isinstance(spec.runner, PythonRunner | HttpRunner):
            if not outcome.result.ok:
                return outcome.result  # nothing changed: the model may correct and retry
        elif outcome.effect is None:
            return outcome.result  # the toolset refused (not found, wrong amount, ...)
        record = await self._ledger.apply_once(
            req.job_id, req.step, req.name, ok=outcome.result.ok, output=outcome.result.output,
            effect=outcome.effect, identity=identity, owner=owner)
        if record.fresh or record.output is None:
            return outcome.result
        return self._repeat(profile, spec, req, record)

    @staticmethod
    def _repeat(profile: Profile, spec: ToolSpec, req: ToolRequest, done: EffectRecord
                ) -> ToolResult:
        """The answer to a call whose effect the ledger holds: a retry of the applying
        call reads its own result unchanged; a call at another step reads that result
        marked "already applied", so the model knows nothing changed this time."""
        output = done.output or ""
        other_job = done.job_id is not None and done.job_id != req.job_id
        if done.step == req.step and not other_job:
            return ToolResult(ok=done.ok, output=output)
        log.info("effect_deduplicated", tool=req.name, applied_at=done.step,
                 applied_by=done.job_id)
        per = list(dict.fromkeys([profile.task_id_field, *(spec.effect_key or ())]))
        where = (f"by job {done.job_id} at step {done.step}" if other_job
                 else f"at step {done.step}")
        scope = " across the tenant's jobs" if spec.effect_scope == "tenant" else ""
        return ToolResult(ok=done.ok, output=(
            f"already applied {where} ({req.name} applies once per "
            f"{' and '.join(per)}{scope}); not applied again. It answered: {output}"))

    async def _call(self, spec: ToolSpec, req: ToolRequest, key: str, *,
                    hedge: bool = False) -> ToolOutcome:
        """Run the tool wherever it runs; ``key`` is the idempotency key a function or
        HTTP tool passes on to what it changes; ``hedge``: this is a hedged call's
        second request (an HTTP tool is told so in ``X-Warmloop-Hedge``)."""
        if isinstance(spec.runner, PythonRunner):
            return ToolOutcome(await self._run_function(spec.runner, req, key))
        if isinstance(spec.runner, HttpRunner):
            return ToolOutcome(await self._run_http(spec, spec.runner, req, key, hedge=hedge))
        toolset = self._toolsets.get(req.profile)
        if toolset is None:
            raise ApplicationError(f"no toolset for profile {req.profile!r}",
                                   type="UnknownProfile", non_retryable=True)
        return await toolset.arun(req)

    def _function(self, path: str) -> FunctionTool:
        fn = self._functions.get(path)
        if fn is None:
            try:
                fn = self._functions[path] = self._resolve(path)
            except (ImportError, AttributeError, TypeError) as e:
                raise ApplicationError(f"tool function {path} cannot be loaded: {e}",
                                       type="ToolNotLoaded", non_retryable=True) from None
        return fn

    async def _run_function(self, runner: PythonRunner, req: ToolRequest, key: str
                            ) -> ToolResult:
        fn = self._function(runner.function)
        parsed = fn.spec.args.model_validate(req.arguments)
        kwargs = {name: getattr(parsed, name) for name in type(parsed).model_fields}
        if fn.context_param is not None:
            kwargs[fn.context_param] = ToolContext(
                job_id=req.job_id, step=req.step, task_id=req.task_id,
                idempotency_key=key)
        value = (await fn.fn(**kwargs) if fn.is_async
                 else await asyncio.to_thread(fn.fn, **kwargs))
        return ToolResult(ok=True, output=as_model_text(value))

    async def _run_http(self, spec: ToolSpec, runner: HttpRunner, req: ToolRequest,
                        key: str, *, hedge: bool = False) -> ToolResult:
        headers = {**dict(runner.headers), "X-Warmloop-Job": req.job_id,
                   "X-Warmloop-Step": str(req.step)}
        if hedge:
            headers["X-Warmloop-Hedge"] = "1"
        if spec.side_effect:
            headers["Idempotency-Key"] = key
        cap = runner.max_response_bytes
        async with self._http.stream("POST", runner.url, json=req.arguments, headers=headers,
                                     timeout=spec.timeout_s) as r:
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > cap:
                    return ToolResult(ok=False, output=f"tool {spec.name}: response larger "
                                      f"than {cap} bytes; ask for less")
        text = body.decode("utf-8", errors="replace")
        if r.status_code >= 500 or r.status_code in RETRY_STATUSES:
            # Temporal retries it per the tool's retry policy; the model reads the last.
            # (Not the URL: it may carry a key, and this text reaches the prompt.)
            raise ApplicationError(f"tool {spec.name}: HTTP {r.status_code}: {text[:300]}",
                                   type="ToolUnavailable")
        if r.status_code >= 400:
            return ToolResult(ok=False, output=f"HTTP {r.status_code}: {text[:2000]}")
        if r.status_code >= 300:
            return ToolResult(ok=False, output=f"tool {spec.name}: HTTP {r.status_code} "
                              "redirect not followed (point the tool at the final URL)")
        return ToolResult(ok=True, output=text)

    async def _cut(self, profile: Profile, req: ToolRequest, result: ToolResult) -> ToolResult:
        limit = profile.max_tool_output_chars
        if len(result.output) <= limit:
            return result
        tenant, bare = split_job_id(req.job_id)
        key = f"{s3_prefix(tenant)}tool-outputs/{bare}/{req.step}.txt"
        await asyncio.to_thread(self._s3.put_object, Bucket=self._bucket, Key=key,
                                Body=result.output.encode())
        return ToolResult(ok=result.ok, output_key=key,
                          output=cut_for_prompt(result.output, limit))


__all__ = ["EffectLedger", "EffectRecord", "Hedging", "LedgerUnavailableError",
           "TicketTriageTools", "ToolActivities", "ToolOutcome", "Toolset", "call_key"]
