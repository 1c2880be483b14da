"""The web approval inbox (``warmloop ui``): server-rendered pages for people who
approve in a browser, and the JSON API the CLI's approval commands call.

Every decision goes through ``warmloop.workers.approvals.decide_as``: the person is
verified from their bearer token on every request (the session cookie carries the
token, sealed), and the job's own validator has the last word. Pages escape
everything (Jinja autoescape): arguments are the model's output and comments are
people's text, both untrusted. Forms carry a per-session CSRF token; the API takes
only ``Authorization: Bearer``, never the cookie, so a cross-site request has no
credential to ride on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import jinja2
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from temporalio.client import Client
from temporalio.service import RPCError

from warmloop.workers.approvals import ApprovalRefused, may_decide
from warmloop.workers.identity import (
    AssertionSigner,
    AuthError,
    ClaimNames,
    Identity,
    KeysUnavailableError,
    TokenVerifier,
    bearer_token,
)
from warmloop.workers.inbox.backend import InboxBackend, TemporalBackend, TranscriptUnavailable
from warmloop.workers.inbox.oidc import CALLBACK_PATH, OidcLogin, ProviderUnavailableError
from warmloop.workers.inbox.session import (
    COOKIE_NAME,
    LOGIN_COOKIE_NAME,
    LOGIN_TTL_S,
    LoginState,
    Session,
    SessionSealer,
)
from warmloop.workers.settings import Settings, decode_payload_key
from warmloop.workflows.contracts import (
    ApprovalRecord,
    ChatMessage,
    JobStatus,
    PendingApproval,
    id_problem,
)
from warmloop.workflows.tenants import split_job_id

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
MAX_COMMENT = 2000
"""As the ``Decision`` contract allows; a longer comment is refused, not cut."""
MAX_TOKEN_CHARS = 2800
"""The sealed cookie must stay under browsers' 4 KiB per cookie."""
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
"""On every response of the inbox's own routes (not on mounted apps): no script runs,
nothing is framed, nothing is cached (pages show who may pay what)."""


class _SignInNeeded(Exception):
    """No (valid) session or bearer token: pages redirect to /signin, the API says 401."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Refusal(Exception):
    """A request the inbox answers with a clear page or JSON error, never a trace."""

    def __init__(self, status: int, title: str, message: str) -> None:
        super().__init__(message)
        self.status, self.title, self.message = status, title, message


class DecideBody(BaseModel):
    """The API's decision body."""

    model_config = ConfigDict(extra="forbid")

    approve: StrictBool
    comment: str = Field(default="", max_length=MAX_COMMENT)


class _SecurityHeaders:
    """Adds PAGE_HEADERS to the inbox's own responses; mounted apps (the codec server,
    which the Temporal Web UI calls cross-origin) keep their own headers."""

    def __init__(self, app: ASGIApp, skip: tuple[str, ...] = ()) -> None:
        self._app, self._skip = app, skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self._skip and scope["path"].startswith(self._skip)):
            await self._app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for k, v in PAGE_HEADERS.items():
                    headers.setdefault(k, v)
            await send(message)

        await self._app(scope, receive, send_with_headers)


# ---- formatting for the templates ---------------------------------------------------------

def _span(seconds: float) -> str:
    s = int(abs(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def age(when: datetime, now: datetime | None = None) -> str:
    """How long ago, e.g. '3m'."""
    return _span(((now or datetime.now(UTC)) - when).total_seconds())


def until(when: datetime, now: datetime | None = None) -> str:
    """Time left, e.g. 'in 3h 59m', or how long overdue."""
    left = (when - (now or datetime.now(UTC))).total_seconds()
    return f"in {_span(left)}" if left >= 0 else f"overdue by {_span(left)}"


def money(amount: float | None) -> str:
    return "—" if amount is None else f"{amount:,.2f}"


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def _environment() -> jinja2.Environment:
    """Autoescape on for every template, whatever its file name: nothing a model or a
    person wrote can become markup."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters.update(age=age, until=until, money=money, pretty_json=pretty_json)
    return env


def _ids(request: Request) -> tuple[str, str]:
    """The path's job and approval ids, refused unless they are well-formed ids."""
    job_id = request.path_params["job_id"]
    approval_id = request.path_params["approval_id"]
    if id_problem("job", job_id) or id_problem("approval", approval_id):
        raise _Refusal(404, "No such approval", "That address names no approval.")
    return job_id, approval_id


def _form_text(form: Mapping[str, Any], name: str) -> str:
    value = form.get(name)
    return value if isinstance(value, str) else ""


def _safe_next(target: str) -> str:
    """Only a path of this site: never an open redirect to another host. Whitespace and
    control characters are refused too: browsers drop tabs and newlines from a URL, so
    ``/<tab>/evil.example`` in a page (the sign-in's refresh) would become
    ``//evil.example``."""
    ok = (target.startswith("/") and not target.startswith("//") and "\\" not in target
          and not any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in target))
    return target if ok else "/"


def _visible(who: Identity, record: ApprovalRecord) -> bool:
    """A decision is shown to whoever made it and to anyone who could have (within the
    person's tenants)."""
    tenant, _ = split_job_id(record.approval.job_id)
    if who.tenants is not None and tenant not in who.tenants:
        return False
    return (who.subject in record.approval.approved_by or record.decided_by == who.subject
            or bool(who.roles & set(record.approval.approvers)))


class _Inbox:
    """The routes, over one backend, one verifier and one session sealer."""

    def __init__(self, backend: InboxBackend, verifier: TokenVerifier,
                 sealer: SessionSealer, oidc: OidcLogin | None = None, *,
                 https: bool = False) -> None:
        """``https``: browsers reach the inbox over https (``inbox_url`` says so), so its
        cookies are Secure even where the proxy before it does not say the scheme."""
        self.backend, self.verifier, self.sealer = backend, verifier, sealer
        self.oidc = oidc
        self.env = _environment()
        self._https = https

    def _secure(self, request: Request) -> bool:
        return self._https or request.url.scheme == "https"

    # ---- sessions and identity ------------------------------------------------------

    def _session(self, request: Request) -> Session:
        return self.sealer.open(request.cookies.get(COOKIE_NAME)) or Session.anonymous()

    async def _verify(self, token: str) -> Identity:
        """In a thread: a JWT verifier may fetch its issuer's keys over the network."""
        return await asyncio.to_thread(self.verifier.verify, token)

    async def _session_who(self, session: Session) -> Identity:
        """The session's person, its token verified again as where it came from says
        (a pasted token, or the identity provider's ID token). Raises AuthError."""
        if session.token is None:
            raise AuthError("not signed in")
        if session.source == "oidc":
            if self.oidc is None:
                raise AuthError("sign-in at the identity provider is not configured here")
            # the provider or its keys unreachable: ProviderUnavailableError or
            # KeysUnavailableError, a 503 that keeps the session (not a sign-out)
            return await self.oidc.verify(session.token)
        return await self._verify(session.token)

    async def _web_who(self, request: Request) -> tuple[Session, Identity]:
        session = self._session(request)
        if session.token is None:
            raise _SignInNeeded("Sign in to see your approvals.")
        try:
            return session, await self._session_who(session)
        except AuthError as e:
            raise _SignInNeeded(f"Your session ended: {e}. Sign in again.") from None

    async def _api_who(self, request: Request) -> Identity:
        token = bearer_token(request.headers.get("authorization"))
        if token is None:
            raise _SignInNeeded("send your token as 'Authorization: Bearer <token>'")
        try:
            return await self._verify(token)
        except AuthError as e:
            raise _SignInNeeded(str(e)) from None

    def _set_cookie(self, request: Request, response: Response, session: Session) -> None:
        response.set_cookie(COOKIE_NAME, self.sealer.seal(session), path="/", httponly=True,
                            samesite="strict", secure=self._secure(request),
                            max_age=max(1, int(session.expires - datetime.now(UTC).timestamp())))

    def page(self, request: Request, template: str, session: Session, *,
             who: Identity | None = None, status: int = 200, **context: Any) -> HTMLResponse:
        """Render a page; the session's flash is shown once and dropped."""
        response = HTMLResponse(self._render(template, session, who=who, **context),
                                status_code=status)
        self._set_cookie(request, response, session.with_flash(None))
        return response

    def _render(self, template: str, session: Session, *, who: Identity | None,
                **context: Any) -> str:
        return self.env.get_template(template).render(
            who=who, csrf=session.csrf, flash=session.flash, oidc=self.oidc is not None,
            **context)

    # ---- the approval a request is about ------------------------------------------------

    async def _find(self, who: Identity, job_id: str,
                    approval_id: str) -> tuple[JobStatus, PendingApproval]:
        """The pending approval, if this person may decide it (404 / 403 otherwise)."""
        status = await self.backend.job(job_id)
        p = next((a for a in status.pending_approvals if a.approval_id == approval_id),
                 None) if status else None
        if status is None or p is None:
            raise _Refusal(404, "Not pending",
                           f"Approval {approval_id} of job {job_id} is not pending: it was "
                           "decided, timed out, or never existed. See the history.")
        if who.subject in p.approved_by:
            raise _Refusal(403, "Already approved by you",
                           f"You already approved {approval_id}; a second person must "
                           "approve it too.")
        if not may_decide(who, p):
            raise _Refusal(403, "Not yours to decide",
                           f"{who.subject} may not decide {p.kind} approvals, which need "
                           f"one of the roles {', '.join(p.approvers)} (yours: "
                           f"{', '.join(sorted(who.roles)) or 'none'}).")
        return status, p

    # ---- pages -------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def stylesheet(self, request: Request) -> Response:
        css = (HERE / "static" / "inbox.css").read_text()
        return Response(css, media_type="text/css")

    async def signin_form(self, request: Request) -> Response:
        session = self._session(request)
        return self.page(request, "signin.html", session, error=None,
                         next=_safe_next(request.query_params.get("next", "/")))

    def _oidc(self) -> OidcLogin:
        """The sign-in at the identity provider, or a 404 where none is configured."""
        if self.oidc is None:
            raise _Refusal(404, "Not here", "Sign-in at an identity provider is not "
                           "configured (WARMLOOP_OIDC_CLIENT_ID).")
        return self.oidc

    async def signin_oidc(self, request: Request) -> Response:
        """Off to the identity provider, with this sign-in's state in its own cookie."""
        oidc = self._oidc()
        login = LoginState.new(_safe_next(request.query_params.get("next", "/")))
        try:
            url = await oidc.start(login, str(request.base_url))
        except ProviderUnavailableError as e:
            raise _Refusal(503, "Identity provider unavailable", str(e)) from None
        response = RedirectResponse(url, status_code=303)
        # Lax, not Strict: the provider's redirect back is a cross-site navigation
        response.set_cookie(LOGIN_COOKIE_NAME, self.sealer.seal_login(login), path="/signin",
                            httponly=True, samesite="lax",
                            secure=self._secure(request), max_age=LOGIN_TTL_S)
        return response

    async def signin_callback(self, request: Request) -> Response:
        """The provider's answer: checked, the ID token becomes the session's. The page
        goes on to where the person was headed with a same-site refresh: the session
        cookie (SameSite=Strict) is not sent on a redirect chain the provider started.
        Only a sign-in that succeeds sets the session cookie: this page is reached from
        another site, where the browser sends none, and answering a forged link with an
        empty session would sign the person out."""
        oidc = self._oidc()
        login = self.sealer.open_login(request.cookies.get(LOGIN_COOKIE_NAME))
        try:
            id_token, who = await oidc.finish(login, request.query_params,
                                              str(request.base_url))
            if len(id_token) > MAX_TOKEN_CHARS:
                raise AuthError(f"the identity provider's ID token is longer than "
                                f"{MAX_TOKEN_CHARS} characters; the session cannot hold it")
        except AuthError as e:
            response: Response = self._cookieless_error(
                401, "Sign-in refused", f"Sign-in refused: {e}. Sign in again from /signin.")
        except (ProviderUnavailableError, KeysUnavailableError) as e:
            response = self._cookieless_error(503, "Identity provider unavailable", str(e))
        else:
            signed_in = Session.signed_in(id_token, source="oidc")
            response = HTMLResponse(self._render(
                "continue.html", signed_in, who=who, next=login.next if login else "/"))
            # a long subject must not push the sealed cookie past browsers' 4 KiB
            self._set_cookie(request, response,
                             signed_in.with_flash(f"Signed in as {who.subject[:80]}."))
        response.delete_cookie(LOGIN_COOKIE_NAME, path="/signin")
        return response

    def _cookieless_error(self, status: int, title: str, message: str) -> HTMLResponse:
        return HTMLResponse(self._render("error.html", Session.anonymous(), who=None,
                                         title=title, message=message), status_code=status)

    async def signin(self, request: Request) -> Response:
        session = self._session(request)
        form = await request.form()
        target = _safe_next(_form_text(form, "next") or "/")
        token = _form_text(form, "token").strip()
        if not session.csrf_ok(_form_text(form, "csrf")):
            return self.page(request, "signin.html", Session.anonymous(), status=403,
                             error="The form expired; try again.", next=target)
        if len(token) > MAX_TOKEN_CHARS:
            return self.page(request, "signin.html", session, status=401, next=target,
                             error=f"That token is longer than {MAX_TOKEN_CHARS} characters.")
        try:
            who = await self._verify(token)
        except AuthError as e:
            return self.page(request, "signin.html", session, status=401, next=target,
                             error=f"Sign-in refused: {e}.")
        response = RedirectResponse(target, status_code=303)
        self._set_cookie(request, response,
                         Session.signed_in(token).with_flash(f"Signed in as {who.subject}."))
        return response

    async def signout_form(self, request: Request) -> Response:
        return self.page(request, "signout.html", self._session(request))

    async def signout(self, request: Request) -> Response:
        session = self._session(request)
        form = await request.form()
        if not session.csrf_ok(_form_text(form, "csrf")):
            raise _Refusal(403, "Form expired", "Reload the page and sign out again.")
        # signed in at the identity provider: signed out there too, where it can be
        at_provider = (await self.oidc.end_session_url(session.token, str(request.base_url))
                       if self.oidc is not None and session.source == "oidc"
                       and session.token else None)
        signed_out = Session.anonymous()
        response: Response
        if at_provider is None:
            response = RedirectResponse("/signin", status_code=303)
        else:
            # a page that goes on, not a 303: browsers hold a form's redirects to the
            # page's CSP form-action ('self'), and the provider is another origin
            response = HTMLResponse(self._render("signed_out.html", signed_out, who=None,
                                                 provider_url=at_provider))
        self._set_cookie(request, response, signed_out.with_flash("Signed out."))
        return response

    async def inbox(self, request: Request) -> Response:
        session, who = await self._web_who(request)
        pending = await self.backend.pending()
        mine = [p for p in pending if may_decide(who, p)]
        waiting = [p for p in pending if who.subject in p.approved_by]
        return self.page(request, "inbox.html", session, who=who, mine=mine, waiting=waiting,
                         others=len(pending) - len(mine) - len(waiting))

    async def detail(self, request: Request) -> Response:
        session, who = await self._web_who(request)
        job_id, approval_id = _ids(request)
        job, p = await self._find(who, job_id, approval_id)
        try:  # the pre-warm is a courtesy: a job that just ended must not break the page
            await self.backend.viewed(who, job_id=job_id, approval_id=approval_id)
        except RPCError as e:
            log.warning("viewed signal to %s failed: %s", job_id, e)
        transcript: list[ChatMessage] = []
        transcript_error = None
        try:
            transcript = await self.backend.transcript(job_id)
        except TranscriptUnavailable as e:
            transcript_error = str(e)
        return self.page(request, "detail.html", session, who=who, p=p, job=job,
                         transcript=transcript, transcript_error=transcript_error,
                         max_comment=MAX_COMMENT)

    async def decide(self, request: Request) -> Response:
        session, who = await self._web_who(request)
        job_id, approval_id = _ids(request)
        form = await request.form()
        if not session.csrf_ok(_form_text(form, "csrf")):
            raise _Refusal(403, "Form expired",
                           "This form was not issued to your session (or it expired): "
                           "reload the approval and decide again.")
        approve = {"approve": True, "reject": False}.get(_form_text(form, "decision"))
        comment = _form_text(form, "comment").strip()
        if approve is None:
            raise _Refusal(400, "No decision", "Choose approve or reject.")
        if len(comment) > MAX_COMMENT:
            raise _Refusal(400, "Comment too long",
                           f"A comment may hold {MAX_COMMENT} characters at most.")
        await self._find(who, job_id, approval_id)
        p = await self._decide(who, job_id, approval_id, approve, comment)
        response = RedirectResponse("/", status_code=303)
        self._set_cookie(request, response, session.with_flash(_outcome(p, approve)))
        return response

    async def _decide(self, who: Identity, job_id: str, approval_id: str, approve: bool,
                      comment: str) -> PendingApproval:
        try:
            return await self.backend.decide(who, job_id=job_id, approval_id=approval_id,
                                             approve=approve, comment=comment)
        except ApprovalRefused as e:
            raise _Refusal(403, "Refused by the job", str(e)) from None

    async def history(self, request: Request) -> Response:
        session, who = await self._web_who(request)
        records = [r for r in await self.backend.history() if _visible(who, r)]
        return self.page(request, "history.html", session, who=who, records=records)

    # ---- the JSON API ------------------------------------------------------------------

    async def api_pending(self, request: Request) -> Response:
        who = await self._api_who(request)
        mine = [p for p in await self.backend.pending() if may_decide(who, p)]
        return JSONResponse([p.model_dump(mode="json") for p in mine])

    async def api_decide(self, request: Request) -> Response:
        who = await self._api_who(request)
        job_id, approval_id = _ids(request)
        try:
            body = DecideBody.model_validate_json(await request.body())
        except ValidationError as e:
            raise _Refusal(400, "Bad request", _first_error(e)) from None
        await self._find(who, job_id, approval_id)
        p = await self._decide(who, job_id, approval_id, body.approve, body.comment)
        return JSONResponse(p.model_dump(mode="json"))

    async def api_viewed(self, request: Request) -> Response:
        who = await self._api_who(request)
        job_id, approval_id = _ids(request)
        _, p = await self._find(who, job_id, approval_id)
        await self.backend.viewed(who, job_id=job_id, approval_id=approval_id)
        return JSONResponse(p.model_dump(mode="json"))

    async def api_whoami(self, request: Request) -> Response:
        who = await self._api_who(request)
        return JSONResponse({"subject": who.subject, "roles": sorted(who.roles)})

    # ---- errors ------------------------------------------------------------------------

    def _is_api(self, request: Request) -> bool:
        return request.url.path.startswith("/api/")

    async def on_sign_in_needed(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, _SignInNeeded)
        if self._is_api(request):
            return JSONResponse({"error": exc.message}, status_code=401,
                                headers={"WWW-Authenticate": 'Bearer realm="warmloop"'})
        target = quote(_safe_next(request.url.path), safe="/")
        response = RedirectResponse(f"/signin?next={target}", status_code=303)
        self._set_cookie(request, response, Session.anonymous().with_flash(exc.message))
        return response

    async def on_refusal(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, _Refusal)
        if self._is_api(request):
            return JSONResponse({"error": exc.message}, status_code=exc.status)
        session = self._session(request)
        who = None
        if session.token is not None:
            try:
                who = await self._session_who(session)
            except (AuthError, KeysUnavailableError, ProviderUnavailableError):
                who = None
        return self.page(request, "error.html", session, who=who, status=exc.status,
                         title=exc.title, message=exc.message)

    async def on_provider_down(self, request: Request, exc: Exception) -> Response:
        """The identity provider (or its keys) unreachable: try again, still signed in."""
        return await self.on_refusal(request, _Refusal(503, "Identity provider unavailable",
                                                       str(exc)))

    async def on_unavailable(self, request: Request, exc: Exception) -> Response:
        """Temporal unreachable or refusing: say so, without a stack trace."""
        message = f"Temporal could not be reached or refused the request: {exc}"
        log.warning("inbox: %s", message)
        return await self.on_refusal(request, _Refusal(503, "Unavailable", message))

    async def on_http(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return await self.on_refusal(request, _Refusal(exc.status_code, "Not here",
                                                       str(exc.detail)))


def _outcome(p: PendingApproval, approve: bool) -> str:
    if not approve:
        return f"Rejected {p.approval_id} of job {p.job_id}."
    if len(p.approved_by) < p.approvals_needed:
        return (f"Your approval of {p.approval_id} is recorded; a second person must "
                "approve it before it runs.")
    return f"Approved {p.approval_id} of job {p.job_id}."


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "body"
    return f"{where}: {err['msg']}"


def create_app(settings: Settings, *, backend: InboxBackend | None = None,
               client_factory: Callable[[], Awaitable[Client]] | None = None,
               verifier: TokenVerifier | None = None, signer: AssertionSigner | None = None,
               s3: Any = None, mounts: Sequence[BaseRoute] = (),
               session_key: bytes | None = None, oidc: OidcLogin | None = None) -> Starlette:
    """The inbox as an ASGI app. Anything not given is built from ``settings`` once,
    here: the token verifier, the assertion signer (which needs the private signing
    key: only the approvals service should hold it), S3 and a lazily connected
    Temporal client. Tests pass ``backend`` (a fake) and ``verifier``.

    ``mounts``: extra routes, e.g. ``Mount("/codec", codec_app)``; they get none of the
    inbox's headers or sessions. ``session_key``: 32 bytes shared by replicas; None
    takes ``inbox_session_key``, else makes a random one (everyone is signed out when
    the process restarts). ``oidc``:
    sign-in at an identity provider; default from ``oidc_issuer`` and ``oidc_client_id``
    when both are set (none otherwise: pasted tokens only)."""
    if backend is None:
        from warmloop.workers.clients import build_s3, connect
        from warmloop.workers.identity import signer_from_settings

        async def connect_once() -> Client:
            return await connect(settings)

        backend = TemporalBackend(client_factory or connect_once,
                                  signer or signer_from_settings(settings),
                                  s3 if s3 is not None else build_s3(settings),
                                  settings.s3_bucket)
    if verifier is None:
        from warmloop.workers.identity import verifier_from_settings

        verifier = verifier_from_settings(settings)
    if oidc is None and settings.oidc_issuer and settings.oidc_client_id:
        secret = settings.oidc_client_secret
        oidc = OidcLogin(issuer=settings.oidc_issuer, client_id=settings.oidc_client_id,
                         client_secret=secret.get_secret_value() if secret else None,
                         claim_names=ClaimNames.from_settings(settings),
                         inbox_url=settings.inbox_url)
    if session_key is None and settings.inbox_session_key is not None:
        session_key = decode_payload_key("inbox_session_key",
                                         settings.inbox_session_key.get_secret_value())
    inbox = _Inbox(backend, verifier, SessionSealer(session_key), oidc,
                   https=(settings.inbox_url or "").startswith("https://"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if oidc is not None:
                await oidc.aclose()

    # a tenant's job ids hold a slash (<tenant>/<job id>)
    approval = "/approvals/{job_id:path}/{approval_id}"
    api = "/api/approvals/{job_id:path}/{approval_id}"
    routes: list[BaseRoute] = [
        Route("/healthz", inbox.healthz),
        Route("/static/inbox.css", inbox.stylesheet),
        Route("/signin", inbox.signin_form, methods=["GET"]),
        Route("/signin", inbox.signin, methods=["POST"]),
        Route("/signin/oidc", inbox.signin_oidc, methods=["GET"]),
        Route(CALLBACK_PATH, inbox.signin_callback, methods=["GET"]),
        Route("/signout", inbox.signout_form, methods=["GET"]),
        Route("/signout", inbox.signout, methods=["POST"]),
        Route("/", inbox.inbox),
        Route(approval, inbox.detail, methods=["GET"]),
        Route(approval, inbox.decide, methods=["POST"]),
        Route("/history", inbox.history),
        Route("/api/whoami", inbox.api_whoami),
        Route("/api/approvals", inbox.api_pending),
        Route(api + "/decide", inbox.api_decide, methods=["POST"]),
        Route(api + "/viewed", inbox.api_viewed, methods=["POST"]),
        *mounts,
    ]
    skip = tuple(p for p in (getattr(m, "path", None) for m in mounts) if p)
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(_SecurityHeaders, skip=skip)],
        exception_handlers={
            _SignInNeeded: inbox.on_sign_in_needed,
            _Refusal: inbox.on_refusal,
            RPCError: inbox.on_unavailable,
            KeysUnavailableError: inbox.on_provider_down,
            ProviderUnavailableError: inbox.on_provider_down,
            HTTPException: inbox.on_http,
        },
    )


def serve(settings: Settings, *, host: str = "127.0.0.1", port: int | None = None,
          mounts: Sequence[BaseRoute] = (),
          log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
          ) -> None:
    """Serve the inbox with uvicorn until interrupted (``warmloop ui``). Binds loopback
    by default: put it behind a TLS-terminating proxy to serve others (session cookies
    are marked Secure only when the request arrived over https, so the proxy must send
    X-Forwarded-Proto; uvicorn trusts it from 127.0.0.1 only)."""
    import uvicorn

    app = create_app(settings, mounts=mounts)
    uvicorn.run(app, host=host, port=port or settings.inbox_port, log_level=log_level,
                proxy_headers=True, forwarded_allow_ips="127.0.0.1", server_header=False)
