"""The web approval inbox and its JSON API, on a fake backend and a fake verifier:
sign-in, who sees what, decisions and refusals, CSRF, escaping, 401s."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import boto3
import pytest
from moto import mock_aws
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.testclient import TestClient
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from warmloop.activities.transcripts import TranscriptStore
from warmloop.workers.approvals import ApprovalRefused
from warmloop.workers.identity import (
    AssertionSigner,
    AuthError,
    Identity,
    TokenVerifier,
    ensure_dev_identities,
)
from warmloop.workers.inbox import backend as backend_module
from warmloop.workers.inbox import create_app
from warmloop.workers.inbox.app import age, money, until
from warmloop.workers.inbox.backend import (
    TRANSCRIPT_MAX_MESSAGES,
    TemporalBackend,
    TranscriptUnavailable,
    load_transcript,
)
from warmloop.workers.inbox.session import COOKIE_NAME, Session, SessionSealer
from warmloop.workers.settings import Settings
from warmloop.workflows.contracts import (
    ApprovalRecord,
    ChatMessage,
    FunctionCall,
    JobResult,
    JobState,
    JobStatus,
    PendingApproval,
    ToolCall,
)

XSS = "<script>alert('x')</script>"
NOW = datetime.now(UTC)

PEOPLE = {
    "tok-bob": Identity("bob", frozenset({"finance-lead"})),
    "tok-alice": Identity("alice", frozenset({"team-lead", "support-manager"})),
    "tok-mallory": Identity("mallory", frozenset()),
}


class FakeVerifier(TokenVerifier):
    """Knows PEOPLE; a token can be revoked mid-session."""

    def __init__(self) -> None:
        self.tokens = dict(PEOPLE)

    def verify(self, token: str) -> Identity:
        if not token:
            raise AuthError("no token")
        if token not in self.tokens:
            raise AuthError("unknown token")
        return self.tokens[token]


def pending(job_id: str, kind: str = "large_payment", *, approvers: tuple[str, ...] = (
        "finance-lead", "cfo"), amount: float | None = 12_500.0, needed: int = 1,
            approved_by: tuple[str, ...] = (), arguments: dict[str, Any] | None = None
            ) -> PendingApproval:
    return PendingApproval(
        approval_id=f"{kind}-3", job_id=job_id, kind=kind,
        tool="approve_payment" if kind == "large_payment" else "set_priority",
        arguments=arguments or {"invoice_id": "INV0042", "amount": amount}, step=3,
        approvers=list(approvers), requested_at=NOW - timedelta(minutes=5),
        deadline=NOW + timedelta(hours=4), profile="invoice-reconciliation",
        amount=amount, approvals_needed=needed, approved_by=list(approved_by))


@dataclass
class FakeBackend:
    """Jobs by id, each with its pending approvals; records what the app asked."""

    approvals: list[PendingApproval] = field(default_factory=list)
    transcripts: dict[str, list[ChatMessage]] = field(default_factory=dict)
    records: list[ApprovalRecord] = field(default_factory=list)
    refuse: str | None = None
    down: bool = False
    transcript_down: bool = False
    decided: list[tuple[str, str, str, bool, str]] = field(default_factory=list)
    viewed_by: list[tuple[str, str, str]] = field(default_factory=list)

    def _check(self) -> None:
        if self.down:
            raise RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")

    async def pending(self) -> list[PendingApproval]:
        self._check()
        return list(self.approvals)

    async def job(self, job_id: str) -> JobStatus | None:
        self._check()
        mine = [p for p in self.approvals if p.job_id == job_id]
        if not mine and job_id not in self.transcripts:
            return None
        return JobStatus(job_id=job_id, profile="invoice-reconciliation",
                         state=JobState.RUNNING, step=3, engine_id="e0",
                         pending_approvals=mine, submitted_by="submitter")

    async def decide(self, who: Identity, *, job_id: str, approval_id: str, approve: bool,
                     comment: str) -> PendingApproval:
        self._check()
        if self.refuse is not None:
            raise ApprovalRefused(self.refuse)
        self.decided.append((who.subject, job_id, approval_id, approve, comment))
        p = next(a for a in self.approvals if a.job_id == job_id
                 and a.approval_id == approval_id)
        if approve:
            p.approved_by.append(who.subject)
        if not approve or len(p.approved_by) >= p.approvals_needed:
            self.approvals.remove(p)
        return p

    async def viewed(self, who: Identity, *, job_id: str, approval_id: str) -> None:
        self._check()
        self.viewed_by.append((who.subject, job_id, approval_id))

    async def transcript(self, job_id: str) -> list[ChatMessage]:
        if self.transcript_down:
            raise TranscriptUnavailable("the transcript store cannot be read (boom)")
        return self.transcripts.get(job_id, [])

    async def history(self) -> list[ApprovalRecord]:
        self._check()
        return list(self.records)


def make_backend() -> FakeBackend:
    """A payment and an urgent ticket pending; two decisions in the history."""
    invoice = pending("inv-1", arguments={"invoice_id": "INV0042", "amount": 12_500.0,
                                          "memo": XSS})
    ticket = pending("tkt-1", "urgent_priority", approvers=("team-lead", "support-manager"),
                     amount=None, arguments={"priority": "urgent"})
    transcript = [
        ChatMessage(role="user", content=f"Invoice INV0042 note: {XSS}"),
        ChatMessage(role="assistant", tool_calls=[ToolCall(id="c1", function=FunctionCall(
            name="fetch_invoice", arguments='{"invoice_id": "INV0042"}'))]),
        ChatMessage(role="tool", tool_call_id="c1", content="total 12500.00"),
    ]
    decided = ApprovalRecord(approval=pending("inv-0"), outcome="rejected", decided_by="carol",
                             comment=f"wrong vendor {XSS}", decided_at=NOW)
    ticket_done = ApprovalRecord(
        approval=pending("tkt-0", "urgent_priority", approvers=("team-lead",), amount=None),
        outcome="approved", decided_by="alice", decided_at=NOW)
    return FakeBackend(approvals=[invoice, ticket], transcripts={"inv-1": transcript},
                       records=[decided, ticket_done])


@pytest.fixture
def backend() -> FakeBackend:
    return make_backend()


@pytest.fixture
def verifier() -> FakeVerifier:
    return FakeVerifier()


@pytest.fixture
def app(backend: FakeBackend, verifier: FakeVerifier) -> Starlette:
    return create_app(Settings(), backend=backend, verifier=verifier)


@pytest.fixture
def web(app: Starlette) -> Iterator[TestClient]:
    with TestClient(app, follow_redirects=False) as c:
        yield c


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m, "no CSRF field on the page"
    return m.group(1)


def sign_in(web: TestClient, token: str) -> None:
    page = web.get("/signin")
    r = web.post("/signin", data={"csrf": csrf_of(page.text), "token": token, "next": "/"})
    assert r.status_code == 303, r.text


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ---- sign-in and sessions ------------------------------------------------------------------

def test_healthz_needs_no_sign_in(web: TestClient) -> None:
    r = web.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_pages_redirect_to_sign_in_and_back(web: TestClient) -> None:
    r = web.get("/approvals/inv-1/large_payment-3")
    assert r.status_code == 303
    assert r.headers["location"] == "/signin?next=/approvals/inv-1/large_payment-3"
    page = web.get(r.headers["location"])
    assert 'name="next" value="/approvals/inv-1/large_payment-3"' in page.text
    assert "Sign in to see your approvals." in page.text
    r = web.post("/signin", data={"csrf": csrf_of(page.text), "token": "tok-bob",
                                  "next": "/approvals/inv-1/large_payment-3"})
    assert r.status_code == 303 and r.headers["location"] == "/approvals/inv-1/large_payment-3"


def test_the_session_cookie_is_httponly_and_samesite_strict(web: TestClient) -> None:
    page = web.get("/signin")
    r = web.post("/signin", data={"csrf": csrf_of(page.text), "token": "tok-bob"})
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE_NAME}=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert "tok-bob" not in cookie  # sealed, not merely signed


def test_a_bad_token_is_refused_on_the_page(web: TestClient) -> None:
    page = web.get("/signin")
    r = web.post("/signin", data={"csrf": csrf_of(page.text), "token": "forged"})
    assert r.status_code == 401
    assert "Sign-in refused: unknown token." in r.text
    assert web.get("/").status_code == 303  # still signed out


def test_sign_in_without_the_forms_csrf_token_is_refused(web: TestClient) -> None:
    web.get("/signin")
    r = web.post("/signin", data={"csrf": "guessed", "token": "tok-bob"})
    assert r.status_code == 403 and "The form expired" in r.text
    assert web.get("/").status_code == 303


def test_sign_in_never_redirects_to_another_site(web: TestClient) -> None:
    page = web.get("/signin?next=//evil.example/x")
    assert 'value="/"' in page.text
    r = web.post("/signin", data={"csrf": csrf_of(page.text), "token": "tok-bob",
                                  "next": "https://evil.example/"})
    assert r.headers["location"] == "/"


def test_a_revoked_token_ends_the_session_at_the_next_click(
        web: TestClient, verifier: FakeVerifier) -> None:
    sign_in(web, "tok-bob")
    assert web.get("/").status_code == 200
    del verifier.tokens["tok-bob"]
    r = web.get("/")
    assert r.status_code == 303 and r.headers["location"].startswith("/signin")
    assert "Your session ended: unknown token." in web.get(r.headers["location"]).text


def test_a_tampered_cookie_is_a_signed_out_visitor(web: TestClient) -> None:
    sign_in(web, "tok-bob")
    value = web.cookies[COOKIE_NAME]
    web.cookies.clear()
    web.cookies.set(COOKIE_NAME, value)
    assert web.get("/").status_code == 200  # the cookie as sealed still opens
    web.cookies.clear()
    web.cookies.set(COOKIE_NAME, value[:-4] + ("AAAA" if not value.endswith("AAAA") else "BBBB"))
    assert web.get("/").status_code == 303


def test_sign_out_needs_the_csrf_token_and_ends_the_session(web: TestClient) -> None:
    sign_in(web, "tok-bob")
    assert web.post("/signout", data={"csrf": "nope"}).status_code == 403
    assert web.get("/").status_code == 200
    r = web.post("/signout", data={"csrf": csrf_of(web.get("/signout").text)})
    assert r.status_code == 303 and r.headers["location"] == "/signin"
    assert web.get("/").status_code == 303


def test_sealed_sessions_expire_and_do_not_open_under_another_key() -> None:
    sealer = SessionSealer(b"k" * 32)
    s = Session.signed_in("tok", now=1000.0)
    value = sealer.seal(s)
    assert sealer.open(value, now=1001.0) == s
    assert sealer.open(value, now=s.expires + 1) is None
    assert SessionSealer(b"j" * 32).open(value, now=1001.0) is None
    assert sealer.open("not base64 !!", now=1001.0) is None
    assert not s.csrf_ok(None) and not s.csrf_ok("") and s.csrf_ok(s.csrf)


def test_cookies_are_secure_when_the_inbox_url_is_https() -> None:
    """Behind a TLS proxy that does not forward the scheme, the request looks like
    http: ``WARMLOOP_INBOX_URL=https://...`` still marks the cookies Secure."""
    for url, secure in (("https://approvals.example.com", True), (None, False)):
        app = create_app(Settings(inbox_url=url), backend=make_backend(),
                         verifier=FakeVerifier())
        with TestClient(app, follow_redirects=False) as web:
            cookie = web.get("/signin").headers["set-cookie"]
            assert ("; secure" in cookie.lower()) == secure, cookie


def test_replicas_with_the_same_session_key_share_sessions() -> None:
    """``WARMLOOP_INBOX_SESSION_KEY``: a session made by one inbox (a replica, or before
    a restart) opens in another; without it each start makes its own key."""
    key = base64.b64encode(b"s" * 32).decode()
    settings = Settings(inbox_session_key=key)

    def replica(s: Settings) -> TestClient:
        return TestClient(create_app(s, backend=make_backend(), verifier=FakeVerifier()),
                          follow_redirects=False)

    with replica(settings) as a, replica(settings) as b, replica(Settings()) as other:
        sign_in(a, "tok-bob")
        cookie = a.cookies.get(COOKIE_NAME)
        assert cookie
        b.cookies.set(COOKIE_NAME, cookie)
        assert b.get("/").status_code == 200  # signed in on the other replica
        other.cookies.set(COOKIE_NAME, cookie)
        assert other.get("/").status_code == 303  # a random key: signed out
    with pytest.raises(ValueError, match="inbox_session_key decodes to 9 bytes"):
        Settings(inbox_session_key=base64.b64encode(b"too-short").decode())
    with pytest.raises(ValueError, match="inbox_session_key is not base64"):
        Settings(inbox_session_key="not a key!")


# ---- the inbox, the detail page and decisions ---------------------------------------------

def test_the_inbox_lists_only_what_the_person_may_decide(web: TestClient) -> None:
    sign_in(web, "tok-bob")
    r = web.get("/")
    assert r.status_code == 200
    assert "Signed in as bob." in r.text
    assert 'data-approval="large_payment-3"' in r.text and "inv-1" in r.text
    assert "tkt-1" not in r.text and "urgent_priority" not in r.text
    assert "12,500.00" in r.text and "invoice-reconciliation" in r.text
    # NOW is taken at import: a long suite reaches this test minutes later
    assert "0 of 1" in r.text and re.search(r"in 3h \d{1,2}m", r.text)
    assert "1 other pending approval needs roles you do not have." in r.text
    assert "Signed in as bob." not in web.get("/").text  # a flash shows once


def test_an_approval_waiting_for_a_second_person_is_listed_apart(
        web: TestClient, backend: FakeBackend) -> None:
    backend.approvals[0] = pending("inv-1", amount=75_000.0, needed=2, approved_by=("bob",))
    sign_in(web, "tok-bob")
    html = web.get("/").text
    assert "Nothing is waiting for you." in html
    assert "waiting for a second person" in html and "1 of 2" in html
    r = web.get("/approvals/inv-1/large_payment-3")
    assert r.status_code == 403 and "a second person must approve it too" in r.text


def test_pages_carry_security_headers(web: TestClient) -> None:
    r = web.get("/signin")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
    assert web.get("/static/inbox.css").headers["content-type"].startswith("text/css")


def test_the_detail_page_shows_the_call_and_transcript_escaped_and_sends_viewed(
        web: TestClient, backend: FakeBackend) -> None:
    sign_in(web, "tok-bob")
    r = web.get("/approvals/inv-1/large_payment-3")
    assert r.status_code == 200
    assert "<script>" not in r.text
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in r.text  # argument + transcript
    assert "approve_payment" in r.text and "fetch_invoice" in r.text
    assert "total 12500.00" in r.text and "submitter" in r.text
    assert backend.viewed_by == [("bob", "inv-1", "large_payment-3")]


def test_the_detail_page_survives_an_unreadable_transcript(
        web: TestClient, backend: FakeBackend) -> None:
    backend.transcript_down = True
    sign_in(web, "tok-bob")
    r = web.get("/approvals/inv-1/large_payment-3")
    assert r.status_code == 200 and "cannot be read (boom)" in r.text


def test_a_person_without_the_role_sees_a_refusal_not_the_job(
        web: TestClient, backend: FakeBackend) -> None:
    sign_in(web, "tok-alice")
    r = web.get("/approvals/inv-1/large_payment-3")
    assert r.status_code == 403
    assert "alice may not decide large_payment approvals" in r.text
    assert "finance-lead, cfo" in r.text
    assert "INV0042" not in r.text and backend.viewed_by == []


def test_an_approval_no_longer_pending_is_a_404_page(web: TestClient) -> None:
    sign_in(web, "tok-bob")
    r = web.get("/approvals/inv-9/large_payment-3")
    assert r.status_code == 404 and "is not pending" in r.text
    assert web.get("/approvals/bad%20id/x").status_code == 404


def test_approve_with_the_form(web: TestClient, backend: FakeBackend) -> None:
    sign_in(web, "tok-bob")
    page = web.get("/approvals/inv-1/large_payment-3")
    r = web.post("/approvals/inv-1/large_payment-3",
                 data={"csrf": csrf_of(page.text), "decision": "approve", "comment": " ok "})
    assert r.status_code == 303 and r.headers["location"] == "/"
    assert backend.decided == [("bob", "inv-1", "large_payment-3", True, "ok")]
    assert "Approved large_payment-3 of job inv-1." in web.get("/").text


def test_reject_with_a_comment(web: TestClient, backend: FakeBackend) -> None:
    sign_in(web, "tok-bob")
    page = web.get("/approvals/inv-1/large_payment-3")
    r = web.post("/approvals/inv-1/large_payment-3",
                 data={"csrf": csrf_of(page.text), "decision": "reject", "comment": XSS})
    assert r.status_code == 303
    assert backend.decided == [("bob", "inv-1", "large_payment-3", False, XSS)]
    assert "Rejected large_payment-3 of job inv-1." in web.get("/").text


def test_the_first_of_two_approvals_says_a_second_person_is_needed(
        web: TestClient, backend: FakeBackend) -> None:
    backend.approvals[0] = pending("inv-1", amount=75_000.0, needed=2)
    sign_in(web, "tok-bob")
    page = web.get("/approvals/inv-1/large_payment-3")
    web.post("/approvals/inv-1/large_payment-3",
             data={"csrf": csrf_of(page.text), "decision": "approve"})
    assert "a second person must approve it before it runs" in web.get("/").text


def test_a_decision_without_the_sessions_csrf_token_is_refused(
        web: TestClient, backend: FakeBackend, app: Starlette) -> None:
    sign_in(web, "tok-bob")
    r = web.post("/approvals/inv-1/large_payment-3", data={"decision": "approve"})
    assert r.status_code == 403 and "Form expired" in r.text
    # a token from another session (another browser) does not do either
    with TestClient(app, follow_redirects=False) as other:
        sign_in(other, "tok-bob")
        theirs = csrf_of(other.get("/approvals/inv-1/large_payment-3").text)
    r = web.post("/approvals/inv-1/large_payment-3",
                 data={"csrf": theirs, "decision": "approve"})
    assert r.status_code == 403
    assert backend.decided == []


def test_a_refusal_by_the_job_is_shown_escaped_with_403(
        web: TestClient, backend: FakeBackend) -> None:
    backend.refuse = f"bob submitted this job and may not decide it {XSS}"
    sign_in(web, "tok-bob")
    page = web.get("/approvals/inv-1/large_payment-3")
    r = web.post("/approvals/inv-1/large_payment-3",
                 data={"csrf": csrf_of(page.text), "decision": "approve"})
    assert r.status_code == 403
    assert "Refused by the job" in r.text and "may not decide it &lt;script&gt;" in r.text
    assert "Traceback" not in r.text and "<script>" not in r.text


def test_posting_a_decision_without_the_role_is_refused_before_the_job(
        web: TestClient, backend: FakeBackend) -> None:
    sign_in(web, "tok-mallory")
    csrf = csrf_of(web.get("/").text)
    r = web.post("/approvals/inv-1/large_payment-3",
                 data={"csrf": csrf, "decision": "approve"})
    assert r.status_code == 403 and "mallory may not decide" in r.text
    assert "yours: none" in r.text and backend.decided == []


def test_a_decision_must_say_approve_or_reject_and_fit_the_comment_limit(
        web: TestClient, backend: FakeBackend) -> None:
    sign_in(web, "tok-bob")
    csrf = csrf_of(web.get("/").text)
    url = "/approvals/inv-1/large_payment-3"
    assert web.post(url, data={"csrf": csrf, "decision": "maybe"}).status_code == 400
    r = web.post(url, data={"csrf": csrf, "decision": "reject", "comment": "x" * 2001})
    assert r.status_code == 400 and "2000 characters" in r.text
    assert backend.decided == []


def test_temporal_down_is_a_503_page_not_a_trace(web: TestClient, backend: FakeBackend) -> None:
    sign_in(web, "tok-bob")
    backend.down = True
    r = web.get("/")
    assert r.status_code == 503 and "connection refused" in r.text
    assert "Traceback" not in r.text


def test_history_shows_decisions_the_person_made_or_could_have_made_escaped(
        web: TestClient) -> None:
    sign_in(web, "tok-bob")
    r = web.get("/history")
    assert r.status_code == 200
    assert "inv-0" in r.text and "tkt-0" not in r.text  # bob has no support role
    assert "wrong vendor &lt;script&gt;" in r.text and "<script>" not in r.text
    assert "rejected" in r.text and "carol" in r.text
    sign_in(web, "tok-alice")
    html = web.get("/history").text
    assert "tkt-0" in html and "inv-0" not in html


# ---- the JSON API ------------------------------------------------------------------------

def test_the_api_needs_a_valid_bearer_token(web: TestClient) -> None:
    r = web.get("/api/approvals")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization: Bearer" in r.json()["error"]
    r = web.get("/api/approvals", headers=bearer("forged"))
    assert r.status_code == 401 and r.json() == {"error": "unknown token"}
    r = web.post("/api/approvals/inv-1/large_payment-3/decide", json={"approve": True})
    assert r.status_code == 401


def test_the_api_does_not_accept_the_session_cookie(web: TestClient) -> None:
    sign_in(web, "tok-bob")  # the cookie is in the jar now: a CSRF would ride on it
    r = web.post("/api/approvals/inv-1/large_payment-3/decide", json={"approve": True})
    assert r.status_code == 401


def test_the_api_lists_what_the_caller_may_decide(web: TestClient) -> None:
    r = web.get("/api/approvals", headers=bearer("tok-alice"))
    assert r.status_code == 200
    body = r.json()
    assert [p["job_id"] for p in body] == ["tkt-1"]
    assert PendingApproval.model_validate(body[0]).kind == "urgent_priority"
    assert web.get("/api/whoami", headers=bearer("tok-alice")).json() == {
        "subject": "alice", "roles": ["support-manager", "team-lead"]}


def test_the_api_decides(web: TestClient, backend: FakeBackend) -> None:
    r = web.post("/api/approvals/inv-1/large_payment-3/decide", headers=bearer("tok-bob"),
                 json={"approve": False, "comment": "duplicate"})
    assert r.status_code == 200
    assert PendingApproval.model_validate(r.json()).approval_id == "large_payment-3"
    assert backend.decided == [("bob", "inv-1", "large_payment-3", False, "duplicate")]


def test_the_api_refusals(web: TestClient, backend: FakeBackend) -> None:
    url = "/api/approvals/inv-1/large_payment-3/decide"
    r = web.post(url, headers=bearer("tok-alice"), json={"approve": True})
    assert r.status_code == 403 and "alice may not decide" in r.json()["error"]
    r = web.post(url, headers=bearer("tok-bob"), json={"approve": "yes"})
    assert r.status_code == 400 and r.json()["error"].startswith("approve:")
    r = web.post(url, headers=bearer("tok-bob"), content=b"{not json")
    assert r.status_code == 400
    r = web.post("/api/approvals/inv-9/large_payment-3/decide", headers=bearer("tok-bob"),
                 json={"approve": True})
    assert r.status_code == 404 and "is not pending" in r.json()["error"]
    backend.refuse = "the assertion has expired"
    r = web.post(url, headers=bearer("tok-bob"), json={"approve": True})
    assert r.status_code == 403 and r.json() == {"error": "the assertion has expired"}
    assert backend.decided == []


def test_the_api_marks_an_approval_viewed(web: TestClient, backend: FakeBackend) -> None:
    url = "/api/approvals/inv-1/large_payment-3/viewed"
    assert web.post(url, headers=bearer("tok-mallory")).status_code == 403
    r = web.post(url, headers=bearer("tok-bob"))
    assert r.status_code == 200 and r.json()["approval_id"] == "large_payment-3"
    assert backend.viewed_by == [("bob", "inv-1", "large_payment-3")]


def test_a_mounted_app_is_served_without_the_inbox_headers(
        backend: FakeBackend, verifier: FakeVerifier) -> None:
    async def codec(request: Request) -> Response:
        return JSONResponse({"codec": True})

    app = create_app(Settings(), backend=backend, verifier=verifier,
                     mounts=[Mount("/codec", routes=[Route("/decode", codec,
                                                          methods=["POST"])])])
    with TestClient(app) as c:
        r = c.post("/codec/decode")
        assert r.json() == {"codec": True} and "content-security-policy" not in r.headers
        assert c.get("/healthz").headers["x-frame-options"] == "DENY"


# ---- pieces ---------------------------------------------------------------------------

def test_time_and_money_formatting() -> None:
    now = datetime(2025, 1, 1, 12, tzinfo=UTC)
    assert age(now - timedelta(seconds=42), now) == "42s"
    assert age(now - timedelta(minutes=5), now) == "5m"
    assert until(now + timedelta(hours=3, minutes=59, seconds=30), now) == "in 3h 59m"
    assert until(now - timedelta(days=1, hours=2), now) == "overdue by 1d 2h"
    assert money(None) == "—" and money(12500) == "12,500.00"


@pytest.fixture
def s3() -> Iterator[Any]:
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="wl-inbox")
        yield client


def test_the_transcript_is_read_from_the_message_store_in_order(s3: Any) -> None:
    for i in (2, 0, 1):
        s3.put_object(Bucket="wl-inbox", Key=TranscriptStore.key("job-a", i),
                      Body=ChatMessage(role="user", content=f"m{i}").model_dump_json())
    s3.put_object(Bucket="wl-inbox", Key=TranscriptStore.key("job-ab", 0),
                  Body=ChatMessage(role="user", content="other job").model_dump_json())
    assert [m.content for m in load_transcript(s3, "wl-inbox", "job-a")] == ["m0", "m1", "m2"]
    assert load_transcript(s3, "wl-inbox", "nothing") == []


def test_a_long_transcript_shows_its_last_messages(s3: Any) -> None:
    n = TRANSCRIPT_MAX_MESSAGES + 3
    for i in range(n):
        s3.put_object(Bucket="wl-inbox", Key=TranscriptStore.key("long", i),
                      Body=ChatMessage(role="tool", content=str(i)).model_dump_json())
    out = load_transcript(s3, "wl-inbox", "long")
    assert len(out) == TRANSCRIPT_MAX_MESSAGES and out[-1].content == str(n - 1)


def test_an_unreachable_store_is_transcript_unavailable(s3: Any) -> None:
    with pytest.raises(TranscriptUnavailable, match="cannot be read"):
        load_transcript(s3, "no-such-bucket", "job-a")


# ---- the real backend's wiring, on a fake Temporal client -----------------------------------

@dataclass
class FakeExecution:
    id: str
    run_id: str
    status: WorkflowExecutionStatus


class FakeHandle:
    def __init__(self, records: list[ApprovalRecord], fail: bool = False) -> None:
        self.records, self.fail = records, fail

    async def query(self, query: Any) -> JobStatus:
        if self.fail:
            raise RPCError("gone", RPCStatusCode.NOT_FOUND, b"")
        return JobStatus(job_id="x", profile="p", state=JobState.RUNNING, step=1,
                         engine_id=None, approvals=self.records)

    async def result(self, follow_runs: bool = True) -> JobResult:
        assert not follow_runs  # the run listed, not a later one
        return JobResult(job_id="x", profile="p", state=JobState.FINISHED, reason="done",
                         approvals=self.records)


class FakeClient:
    def __init__(self, jobs: dict[str, tuple[WorkflowExecutionStatus, FakeHandle]]) -> None:
        self.jobs = jobs

    async def list_workflows(self, query: str, *, limit: int) -> Any:
        assert "AgentJob" in query and limit >= 1
        for job_id, (status, _) in self.jobs.items():
            yield FakeExecution(job_id, "run", status)

    def get_workflow_handle_for(self, run: Any, job_id: str, *, run_id: str) -> FakeHandle:
        return self.jobs[job_id][1]


def record(job_id: str, minutes_ago: int) -> ApprovalRecord:
    return ApprovalRecord(approval=pending(job_id), outcome="approved", decided_by="bob",
                          decided_at=NOW - timedelta(minutes=minutes_ago))


async def test_the_real_backend_reads_history_from_running_and_finished_jobs() -> None:
    running = WorkflowExecutionStatus.RUNNING
    client = FakeClient({
        "run-1": (running, FakeHandle([record("run-1", 5)])),
        "done-1": (WorkflowExecutionStatus.COMPLETED, FakeHandle([record("done-1", 1)])),
        "moved-on": (WorkflowExecutionStatus.CONTINUED_AS_NEW, FakeHandle([record("x", 0)])),
        "failed": (WorkflowExecutionStatus.FAILED, FakeHandle([record("y", 0)])),
        "broken": (running, FakeHandle([], fail=True)),
    })
    made: list[int] = []

    async def factory() -> Client:
        made.append(1)
        return cast(Client, client)

    backend = TemporalBackend(factory, cast(AssertionSigner, None), None, "b")
    records = await backend.history()
    assert [r.approval.job_id for r in records] == ["done-1", "run-1"]  # newest first
    await backend.history()
    assert made == [1]  # one client, made on first use


async def test_the_real_backend_calls_the_approvals_service(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    p = pending("inv-1")

    async def decide_as(client: Any, who: Identity, signer: Any, **kw: Any) -> PendingApproval:
        calls.append(("decide_as", (who.subject, signer, kw)))
        return p

    async def mark_viewed(client: Any, who: Identity, **kw: Any) -> None:
        calls.append(("mark_viewed", (who.subject, kw)))

    async def job_status(client: Any, job_id: str) -> JobStatus:
        raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")

    async def list_pending(client: Any) -> list[PendingApproval]:
        return [p]

    for name, fn in [("decide_as", decide_as), ("mark_viewed", mark_viewed),
                     ("job_status", job_status), ("list_pending", list_pending)]:
        monkeypatch.setattr(backend_module.approvals, name, fn)

    async def factory() -> Client:
        return cast(Client, object())

    signer = cast(AssertionSigner, "the-signer")
    backend = TemporalBackend(factory, signer, None, "b")
    bob = PEOPLE["tok-bob"]
    assert await backend.pending() == [p]
    assert await backend.job("nope") is None
    assert await backend.decide(bob, job_id="inv-1", approval_id="a", approve=False,
                                comment="c") is p
    await backend.viewed(bob, job_id="inv-1", approval_id="a")
    assert calls == [
        ("decide_as", ("bob", "the-signer", {"job_id": "inv-1", "approval_id": "a",
                                             "approve": False, "comment": "c"})),
        ("mark_viewed", ("bob", {"job_id": "inv-1", "approval_id": "a"})),
    ]


def test_the_app_built_from_settings_signs_in_with_the_dev_token_file(tmp_path: Path) -> None:
    # As `warmloop ui` builds it: verifier and signer from the state dir that
    # `warmloop dev up` fills; Temporal is not contacted until a page needs it.
    plain = ensure_dev_identities(tmp_path / "auth")
    settings = Settings(state_dir=tmp_path)

    async def no_temporal() -> Client:
        raise AssertionError("Temporal contacted at start")

    with TestClient(create_app(settings, client_factory=no_temporal, s3=object()),
                    follow_redirects=False) as web:
        assert web.get("/healthz").status_code == 200
        page = web.get("/signin")
        r = web.post("/signin", data={"csrf": csrf_of(page.text),
                                      "token": plain["carol"]["token"]})
        assert r.status_code == 303
        r = web.get("/api/whoami", headers=bearer(plain["carol"]["token"]))
        assert r.json() == {"subject": "carol", "roles": ["cfo", "finance-lead"]}


def test_the_app_refuses_to_start_without_approver_tokens(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no approver tokens"):
        create_app(Settings(state_dir=tmp_path), backend=make_backend())
