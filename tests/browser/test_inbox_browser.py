"""The web inbox in a real browser (Chromium, through Playwright) on the real stack:
a support lead is refused a payment and approves an urgent ticket; a finance lead
approves one payment and rejects another with a comment (written as markup, shown
as text); the jobs' histories and results say who decided what. Screenshots of each
page go to the test's tmp dir and <state_dir>/screenshots/ (with run.json: timings).

Jobs reach their approvals on the real engines by replaying recorded calls with
``ask_approvals`` (every step is still generated on the engines; the recorded call
then waits for real approvers): the tiny random model's own invoice ids would never
match the task's, and its priorities are chance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass

import pytest
from playwright.async_api import BrowserContext, Dialog, Page, expect
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
)
from temporalio.service import RPCError

from tests.browser.conftest import Screenshots
from tests.polling import eventually
from warmloop.infra.stack import Stack
from warmloop.workers.approvals import list_pending
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    FunctionCall,
    JobInput,
    JobResult,
    JobState,
    PendingApproval,
    ReplayScript,
    ReplayStep,
    ToolCall,
)

pytestmark = [pytest.mark.browser, pytest.mark.integration]

FINANCE = "bob"
"""finance-lead: may decide large_payment approvals."""
SUPPORT = "alice"
"""team-lead and support-manager: may decide urgent_priority, not payments."""
REJECT_COMMENT = "<script>alert('pwned')</script> amount differs from PO7102"


@dataclass
class Waiting:
    handle: WorkflowHandle[AgentJob, JobResult]
    approval: PendingApproval


def _call(name: str, args: dict[str, object], n: int) -> ToolCall:
    return ToolCall(id=f"call-{n}", function=FunctionCall(name=name, arguments=json.dumps(args)))


async def _pending_of(handle: WorkflowHandle[AgentJob, JobResult], kind: str, *,
                      timeout_s: float) -> PendingApproval | None:
    """The job's pending approval of ``kind``; None when the job ended without one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = [p for p in await handle.query(AgentJob.pending_approvals) if p.kind == kind]
        except (WorkflowQueryFailedError, RPCError):  # before its first workflow task
            found = []
        if found:
            return found[0]
        if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
            return None
        await asyncio.sleep(0.25)
    raise AssertionError(f"{handle.id} asked for no {kind} approval in {timeout_s:.0f} s")


async def start_payment(client: Client, started: list[WorkflowHandle[AgentJob, JobResult]],
                        invoice: int, amount: float) -> Waiting:
    """An invoice job whose recorded approve_payment (over 5,000, under the two-person
    threshold) waits for a finance approver, then finishes."""
    task = {"invoice_id": f"INV{invoice:04d}", "vendor_id": "V101",
            "po_number": f"PO{invoice:04d}", "note": "browser test"}
    script = ReplayScript(ask_approvals=True, steps=[
        ReplayStep(call=_call("approve_payment", {"invoice_id": task["invoice_id"],
                                                  "amount": amount}, 1),
                   result=f"payment of {amount:.2f} scheduled", output_tokens=12,
                   pause_kind="approval:large_payment"),
        ReplayStep(call=_call("finish", {"outcome": "paid"}, 2), result="done",
                   output_tokens=8),
    ])
    handle = await client.start_workflow(
        AgentJob.run, JobInput(profile="invoice-reconciliation", task=task, replay=script,
                               hold_policy="never"),
        id=f"inbox-pay-{uuid.uuid4().hex[:8]}", task_queue=AGENT_TASK_QUEUE)
    started.append(handle)
    p = await _pending_of(handle, "large_payment", timeout_s=300)
    if p is None:
        pytest.fail("a replayed approve_payment over the threshold did not wait for approval "
                    f"({handle.id} ended without one): replayed calls must pass approval rules")
    return Waiting(handle, p)


async def start_urgent_ticket(client: Client,
                              started: list[WorkflowHandle[AgentJob, JobResult]]) -> Waiting:
    """A ticket job whose recorded set_priority(urgent) waits for a team lead."""
    task = {"ticket_id": "T7001", "customer_id": "C101", "subject": "charged twice",
            "body": "I was charged twice for order 7001. Please fix this today."}
    script = ReplayScript(ask_approvals=True, steps=[
        ReplayStep(call=_call("set_priority", {"priority": "urgent"}, 1),
                   result="priority set to urgent", output_tokens=10,
                   pause_kind="approval:urgent_priority"),
        ReplayStep(call=_call("finish", {"resolution": "escalated", "priority": "urgent"}, 2),
                   result="done", output_tokens=8),
    ])
    handle = await client.start_workflow(
        AgentJob.run, JobInput(profile="ticket-triage", task=task, replay=script,
                               hold_policy="never"),
        id=f"inbox-ticket-{uuid.uuid4().hex[:8]}", task_queue=AGENT_TASK_QUEUE)
    started.append(handle)
    p = await _pending_of(handle, "urgent_priority", timeout_s=300)
    if p is None:
        pytest.fail(f"the recorded urgent set_priority did not wait for approval ({handle.id})")
    return Waiting(handle, p)


# ---- the browser side ---------------------------------------------------------------------

async def sign_in(page: Page, url: str, token: str) -> None:
    await page.goto(f"{url}/signin")
    await page.fill("#token", token)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(f"{url}/")


async def sign_out(page: Page, url: str) -> None:
    await page.get_by_role("button", name="Sign out").click()
    await page.wait_for_url(f"{url}/signin")


def row(w: Waiting) -> str:
    return f'tr[data-testid="approval-row"][data-job="{w.approval.job_id}"]'


async def decide(page: Page, url: str, w: Waiting, button: str, comment: str) -> None:
    """Open the approval from the inbox, write the comment, press the button."""
    await page.goto(f"{url}/")
    await page.locator(f"{row(w)} a").click()
    await page.wait_for_url(f"**/approvals/{w.approval.job_id}/{w.approval.approval_id}")
    await page.fill("#comment", comment)
    await page.get_by_role("button", name=button).click()
    await page.wait_for_url(f"{url}/")


async def test_approvers_decide_in_the_browser(
        stack: Stack, client: Client, settings: Settings, inbox_url: str,
        dev_tokens: dict[str, str], browser: BrowserContext, screenshots: Screenshots,
) -> None:
    began = time.monotonic()
    started: list[WorkflowHandle[AgentJob, JobResult]] = []
    try:
        ticket, pay_a, pay_b = await asyncio.gather(
            start_urgent_ticket(client, started),
            start_payment(client, started, 7101, 12_500.00),
            start_payment(client, started, 7102, 8_200.00))
        jobs_ready = time.monotonic()
        wanted = {w.approval.job_id for w in (ticket, pay_a, pay_b)}

        async def listed() -> bool:  # the inbox lists by visibility, a moment behind
            return wanted <= {p.job_id for p in await list_pending(client)}

        await eventually(listed, attempts=400)
        page = await browser.new_page()
        dialogs: list[str] = []

        async def on_dialog(dialog: Dialog) -> None:  # CSP allows no script: never called
            dialogs.append(dialog.message)
            await dialog.dismiss()

        page.on("dialog", on_dialog)
        await run_support_lead(page, inbox_url, dev_tokens[SUPPORT], ticket, pay_a,
                               screenshots)
        await run_finance_lead(page, inbox_url, dev_tokens[FINANCE], pay_a, pay_b,
                               screenshots)
        assert dialogs == [], "a script ran in the page"
        browsing = time.monotonic()
        await check_the_jobs(ticket, pay_a, pay_b)
    finally:
        for h in started:
            with contextlib.suppress(RPCError):  # already ended
                await h.cancel()
    done = time.monotonic()
    timings = {"jobs_reach_approvals_s": round(jobs_ready - began, 1),
               "browser_s": round(browsing - jobs_ready, 1), "total_s": round(done - began, 1),
               "screenshots": [p.name for p in screenshots.taken]}
    (screenshots.keep / "run.json").write_text(json.dumps(timings, indent=2))
    print(f"browser test: {json.dumps(timings)}")


async def run_support_lead(page: Page, url: str, token: str, ticket: Waiting, pay: Waiting,
                           shots: Screenshots) -> None:
    """Sees the urgent ticket, not the payments; is refused a payment's page; approves
    the ticket."""
    await page.goto(f"{url}/")
    await expect(page.get_by_role("button", name="Sign in")).to_be_visible()
    await shots.take(page, "signin")
    await sign_in(page, url, token)
    await expect(page.locator(row(ticket))).to_be_visible()
    await expect(page.locator(row(pay))).to_have_count(0)
    await shots.take(page, "inbox-support-lead")
    response = await page.goto(f"{url}/approvals/{pay.approval.job_id}/"
                               f"{pay.approval.approval_id}")
    assert response is not None and response.status == 403
    await expect(page.get_by_test_id("refusal")).to_contain_text(
        f"{SUPPORT} may not decide large_payment approvals")
    await shots.take(page, "refused-payment-without-role")
    await page.goto(f"{url}/")
    await page.locator(f"{row(ticket)} a").click()
    await expect(page.get_by_test_id("tool")).to_have_text("set_priority")
    await expect(page.get_by_test_id("arguments")).to_contain_text('"urgent"')
    await shots.take(page, "ticket-detail")
    await page.fill("#comment", "paging the on-call team")
    await page.get_by_role("button", name="Approve").click()
    await page.wait_for_url(f"{url}/")
    await expect(page.get_by_test_id("flash")).to_contain_text(
        f"Approved {ticket.approval.approval_id}")
    await sign_out(page, url)


async def run_finance_lead(page: Page, url: str, token: str, pay_a: Waiting, pay_b: Waiting,
                           shots: Screenshots) -> None:
    """Approves one payment, rejects the other with a comment written as markup, and
    finds both in the history, the comment shown as text."""
    await sign_in(page, url, token)
    for w in (pay_a, pay_b):
        await expect(page.locator(row(w))).to_be_visible()
    await shots.take(page, "inbox-finance-lead")
    await page.locator(f"{row(pay_a)} a").click()
    await expect(page.get_by_test_id("tool")).to_have_text("approve_payment")
    await expect(page.get_by_test_id("arguments")).to_contain_text("12500")
    await expect(page.get_by_test_id("transcript")).to_be_attached()
    await shots.take(page, "payment-detail")
    await page.fill("#comment", "matches PO7101")
    await page.get_by_role("button", name="Approve").click()
    await page.wait_for_url(f"{url}/")
    await expect(page.get_by_test_id("flash")).to_contain_text(
        f"Approved {pay_a.approval.approval_id} of job {pay_a.approval.job_id}")
    await expect(page.locator(row(pay_a))).to_have_count(0)
    await shots.take(page, "payment-approved")
    await decide(page, url, pay_b, "Reject", REJECT_COMMENT)
    await expect(page.get_by_test_id("flash")).to_contain_text(
        f"Rejected {pay_b.approval.approval_id} of job {pay_b.approval.job_id}")
    await shots.take(page, "payment-rejected")
    await page.goto(f"{url}/history")
    rejected = page.locator(f'tr[data-testid="history-row"][data-job="{pay_b.approval.job_id}"]')
    await expect(rejected.locator("td.comment")).to_have_text(REJECT_COMMENT)
    await expect(page.locator(f'tr[data-testid="history-row"]'
                              f'[data-job="{pay_a.approval.job_id}"]')).to_contain_text("approved")
    assert await page.locator("script").count() == 0
    await shots.take(page, "history")


async def check_the_jobs(ticket: Waiting, pay_a: Waiting, pay_b: Waiting) -> None:
    """What the browser did, as the jobs recorded it: verified subjects, the comment
    as typed, the viewed signal from opening the page."""
    a, b = await asyncio.wait_for(asyncio.gather(pay_a.handle.result(), pay_b.handle.result()),
                                  timeout=300)
    assert a.state == JobState.FINISHED and b.state == JobState.FINISHED
    assert [(r.outcome, r.decided_by) for r in a.approvals] == [("approved", FINANCE)]
    assert [(r.outcome, r.decided_by, r.comment) for r in b.approvals] == [
        ("rejected", FINANCE, REJECT_COMMENT)]
    status = await ticket.handle.query(AgentJob.status)
    assert [(r.approval.approval_id, r.outcome, r.decided_by) for r in status.approvals][:1] == [
        (ticket.approval.approval_id, "approved", SUPPORT)]
    history = await pay_a.handle.fetch_history()
    signals = [e.workflow_execution_signaled_event_attributes.signal_name
               for e in history.events
               if e.HasField("workflow_execution_signaled_event_attributes")]
    assert "viewed" in signals, "opening the approval did not send `viewed`"
