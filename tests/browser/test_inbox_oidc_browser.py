"""Sign-in at an identity provider in a real browser: Chromium goes from the inbox to a
real OpenID provider (``oidc-provider-mock``, on another site: localhost against the
inbox's 127.0.0.1, so the cookies' SameSite rules apply as in production), signs in
as a finance lead the provider knows, comes back signed in and approves a payment on
the real stack (the job records the provider's subject as the approver), then signs
out of the inbox and, through the provider's end-session page, of the provider."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx
import oidc_provider_mock
import pytest
from playwright.async_api import BrowserContext, expect
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from tests.browser.conftest import InboxServer, Screenshots
from tests.browser.test_inbox_browser import decide, row, start_payment
from tests.polling import eventually
from warmloop.infra.stack import Stack
from warmloop.workers.approvals import list_pending
from warmloop.workers.inbox import create_app
from warmloop.workers.inbox.oidc import OidcLogin
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import JobResult, JobState

pytestmark = [pytest.mark.browser, pytest.mark.integration]


async def test_a_person_signs_in_at_the_identity_provider_and_approves(
        stack: Stack, client: Client, settings: Settings, browser: BrowserContext,
        screenshots: Screenshots,
) -> None:
    person = f"fiona-{uuid.uuid4().hex[:6]}@example.com"
    started: list[WorkflowHandle[AgentJob, JobResult]] = []
    with oidc_provider_mock.run_server_in_thread() as provider:
        idp = f"http://localhost:{provider.server_port}"
        async with httpx.AsyncClient() as http:
            (await http.put(f"{idp}/users/{person}",
                            json={"roles": ["finance-lead"]})).raise_for_status()
        oidc = OidcLogin(issuer=idp, client_id="warmloop-inbox", client_secret="inbox-secret")
        with InboxServer(create_app(settings, oidc=oidc)) as inbox:
            try:
                pay = await start_payment(client, started, 7301, 9_100.00)

                async def listed() -> bool:  # the inbox lists by visibility
                    return pay.approval.job_id in {p.job_id for p in await list_pending(client)}

                await eventually(listed, attempts=400)
                page = await browser.new_page()
                await page.goto(f"{inbox.url}/")  # signed out: to the sign-in page
                await page.wait_for_url(f"{inbox.url}/signin?next=/")
                await page.get_by_test_id("sso").click()
                await page.wait_for_url(f"{idp}/oauth2/authorize**")
                await screenshots.take(page, "oidc-provider-form")
                await page.fill('input[name="sub"]', person)
                await page.get_by_role("button", name="Authorize").click()
                # back at the inbox, signed in as the provider's subject with its roles
                await page.wait_for_url(f"{inbox.url}/")
                await expect(page.get_by_test_id("subject")).to_have_text(person)
                await expect(page.get_by_test_id("flash")).to_contain_text(
                    f"Signed in as {person}.")
                await expect(page.locator(row(pay))).to_be_visible()
                await screenshots.take(page, "oidc-signed-in")
                await decide(page, inbox.url, pay, "Approve", "signed in at the provider")
                res = await asyncio.wait_for(pay.handle.result(), timeout=300)
                # signing out ends the session at the provider too (RP-initiated
                # logout), and the provider sends the browser back to the sign-in page
                await page.goto(f"{inbox.url}/signout")
                await page.get_by_role("button", name="Sign out").click()
                await page.wait_for_url(f"{idp}/oauth2/end_session?**")
                assert "id_token_hint=" in page.url
                await screenshots.take(page, "oidc-provider-end-session")
                await page.get_by_role("button", name="End session").click()
                await page.wait_for_url(f"{inbox.url}/signin")
                await page.goto(f"{inbox.url}/")
                await page.wait_for_url(f"{inbox.url}/signin?next=/")  # signed out here
            finally:
                for h in started:
                    with contextlib.suppress(RPCError):  # already ended
                        await h.cancel()
                await oidc.aclose()
    assert res.state == JobState.FINISHED
    assert [(r.outcome, r.decided_by, r.comment) for r in res.approvals] == [
        ("approved", person, "signed in at the provider")]
