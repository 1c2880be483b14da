"""Sign-in at the identity provider: OpenID Connect's authorization code flow with PKCE.

The inbox is the client (the relying party). ``start`` sends the person to the issuer's
authorization endpoint with a fresh ``state``, ``nonce`` and PKCE challenge, kept in a
sealed cookie (``LoginState``); ``finish`` takes the provider's answer at
``/signin/callback``, checks the ``state`` against the cookie's, trades the code for
tokens at the token endpoint (with the PKCE verifier, and the client secret for a
confidential client), and verifies the ID token: the issuer's signature (its JWKS),
``iss``, ``aud`` (this client), ``exp`` and the ``nonce``. The ID token is the session's
token from then on, verified again on every request like a pasted one.

Signing out of the inbox signs the person out at the provider too, where it publishes an
``end_session_endpoint`` (OpenID Connect RP-initiated logout): the browser goes there
with the ID token as ``id_token_hint`` and comes back to ``/signin``.

Endpoints come from the issuer's discovery document
(``<issuer>/.well-known/openid-configuration``), read once and kept.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx
import structlog

from warmloop.workers.identity import AuthError, ClaimNames, Identity, JwtVerifier
from warmloop.workers.inbox.session import LoginState

CALLBACK_PATH = "/signin/callback"
SIGNED_OUT_PATH = "/signin"
"""Where the provider sends a person it signed out (the post-logout redirect URI)."""

log = structlog.get_logger(__name__)
DISCOVERY_TIMEOUT_S = 5.0
RETRY_DISCOVERY_S = 10.0


class ProviderUnavailableError(Exception):
    """The identity provider did not answer as it should (discovery or the token
    endpoint); the message is safe to show the person."""


@dataclass(frozen=True)
class ProviderEndpoints:
    """What the inbox reads of the issuer's discovery document."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    end_session_endpoint: str | None = None
    """OpenID Connect RP-initiated logout's endpoint, if the provider has one."""


def pkce_challenge(code_verifier: str) -> str:
    """PKCE's S256 challenge of a code verifier (RFC 7636)."""
    digest = hashlib.sha256(code_verifier.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def azp_problem(claims: Mapping[str, Any], client_id: str) -> str | None:
    """Why an ID token naming several audiences is not this client's (OpenID Connect
    Core 3.1.3.7: then ``azp`` must be the client); None when it is."""
    aud = claims.get("aud")
    if isinstance(aud, list) and len(aud) > 1 and claims.get("azp") != client_id:
        return "the ID token was issued to another party (its azp is not this client)"
    return None


class OidcLogin:
    """The inbox's sign-in at ``issuer`` as client ``client_id``.

    Hazard: the redirect URI must be the one registered for the client at the provider;
    behind a proxy, give ``inbox_url`` (``WARMLOOP_INBOX_URL``) or the provider refuses
    the sign-in (or, if it allowed any, the code could be sent elsewhere)."""

    def __init__(self, *, issuer: str, client_id: str, client_secret: str | None = None,
                 claim_names: ClaimNames | None = None, inbox_url: str | None = None,
                 scope: str = "openid profile email",
                 http: httpx.AsyncClient | None = None) -> None:
        if not issuer or not client_id:
            raise ValueError("OIDC sign-in needs WARMLOOP_OIDC_ISSUER and "
                             "WARMLOOP_OIDC_CLIENT_ID")
        self.issuer = issuer.rstrip("/")
        self.client_id, self._secret = client_id, client_secret
        self._claim_names, self._scope = claim_names, scope
        self._inbox_url = inbox_url.rstrip("/") if inbox_url else None
        self._http = http or httpx.AsyncClient(timeout=DISCOVERY_TIMEOUT_S)
        self._endpoints: ProviderEndpoints | None = None
        self._verifier: JwtVerifier | None = None
        self._lock = asyncio.Lock()
        self._failed: tuple[float, str] | None = None
        """When discovery last failed, and why: repeated within ``RETRY_DISCOVERY_S``
        without asking again, so a provider that is down does not stack up requests
        each waiting out its own timeout."""

    async def aclose(self) -> None:
        await self._http.aclose()

    def redirect_uri(self, base_url: str) -> str:
        """Where the provider sends the person back: ``inbox_url`` if set, else the
        base URL the request arrived on."""
        return (self._inbox_url or base_url.rstrip("/")) + CALLBACK_PATH

    async def endpoints(self) -> ProviderEndpoints:
        """The issuer's endpoints (its discovery document, fetched once)."""
        async with self._lock:
            if self._endpoints is None:
                if self._failed is not None and \
                        time.monotonic() - self._failed[0] < RETRY_DISCOVERY_S:
                    raise ProviderUnavailableError(self._failed[1])
                url = self.issuer + "/.well-known/openid-configuration"
                try:
                    resp = await self._http.get(url)
                    resp.raise_for_status()
                    doc = resp.json()
                    found = ProviderEndpoints(
                        issuer=str(doc["issuer"]).rstrip("/"),
                        authorization_endpoint=str(doc["authorization_endpoint"]),
                        token_endpoint=str(doc["token_endpoint"]),
                        jwks_uri=str(doc["jwks_uri"]),
                        end_session_endpoint=(str(doc["end_session_endpoint"])
                                              if doc.get("end_session_endpoint") else None))
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                    why = (f"the identity provider's discovery document ({url}) could not "
                           f"be read ({type(e).__name__})")
                    self._failed = (time.monotonic(), why)
                    raise ProviderUnavailableError(why) from None
                if found.issuer != self.issuer:
                    raise ProviderUnavailableError(
                        f"the discovery document names issuer {found.issuer}, not "
                        f"{self.issuer}; set WARMLOOP_OIDC_ISSUER to the issuer exactly")
                self._endpoints = found
                self._verifier = JwtVerifier(issuer=found.issuer, audience=self.client_id,
                                             jwks_url=found.jwks_uri,
                                             claim_names=self._claim_names)
            return self._endpoints

    def signed_out_uri(self, base_url: str) -> str:
        """Where the provider sends the person after signing them out there (register
        it as the client's post-logout redirect URI)."""
        return (self._inbox_url or base_url.rstrip("/")) + SIGNED_OUT_PATH

    async def end_session_url(self, id_token: str, base_url: str) -> str | None:
        """Where to send a person signing out of the inbox so that the provider signs
        them out too (RP-initiated logout: the ID token as the hint, back to the sign-in
        page); None when the provider has no such endpoint or cannot be reached (the
        inbox then signs them out alone: a provider outage must not keep anyone in)."""
        try:
            ep = await self.endpoints()
        except ProviderUnavailableError as e:
            log.warning("oidc_end_session_skipped", error=str(e)[:200])
            return None
        if ep.end_session_endpoint is None:
            return None
        query = urlencode({"id_token_hint": id_token, "client_id": self.client_id,
                           "post_logout_redirect_uri": self.signed_out_uri(base_url)})
        sep = "&" if "?" in ep.end_session_endpoint else "?"
        return f"{ep.end_session_endpoint}{sep}{query}"

    async def start(self, login: LoginState, base_url: str) -> str:
        """The authorization request's URL for ``login`` (whose state, nonce and code
        verifier the caller keeps in the login cookie)."""
        ep = await self.endpoints()
        query = urlencode({
            "response_type": "code", "client_id": self.client_id,
            "redirect_uri": self.redirect_uri(base_url), "scope": self._scope,
            "state": login.state, "nonce": login.nonce,
            "code_challenge": pkce_challenge(login.code_verifier),
            "code_challenge_method": "S256"})
        sep = "&" if "?" in ep.authorization_endpoint else "?"
        return f"{ep.authorization_endpoint}{sep}{query}"

    async def finish(self, login: LoginState | None, params: Mapping[str, str],
                     base_url: str) -> tuple[str, Identity]:
        """The provider's answer at the callback, checked: (the ID token, the person).
        Raises AuthError for an answer this browser did not ask for, a refusal at the
        provider, or an ID token that does not verify; ProviderUnavailableError when the
        token endpoint fails."""
        if login is None:
            raise AuthError("no sign-in was under way in this browser (or it took more "
                            "than ten minutes); start again")
        if "error" in params:
            # before the state: some providers leave it out of a refusal, which carries
            # no code and opens no session either way
            why = params["error"][:60]
            if params.get("error_description"):
                why += ": " + params["error_description"][:200]
            raise AuthError(f"the identity provider refused the sign-in ({why})")
        if not hmac.compare_digest(login.state, params.get("state", "")):
            raise AuthError("the answer does not belong to this browser's sign-in "
                            "(state mismatch); start again")
        code = params.get("code", "")
        if not code:
            raise AuthError("the identity provider sent no authorization code")
        ep = await self.endpoints()
        form = {"grant_type": "authorization_code", "code": code,
                "redirect_uri": self.redirect_uri(base_url), "client_id": self.client_id,
                "code_verifier": login.code_verifier}
        if self._secret:
            form["client_secret"] = self._secret
        try:
            resp = await self._http.post(ep.token_endpoint, data=form,
                                         headers={"Accept": "application/json"})
            body: Any = resp.json()
        except (httpx.HTTPError, ValueError) as e:
            raise ProviderUnavailableError(
                f"the identity provider's token endpoint did not answer "
                f"({type(e).__name__})") from None
        if resp.status_code != 200 or not isinstance(body, dict):
            refusal = body.get("error") if isinstance(body, dict) else None
            raise AuthError(f"the identity provider refused the code "
                            f"({str(refusal or resp.status_code)[:200]})")
        id_token = body.get("id_token")
        if not isinstance(id_token, str) or not id_token:
            raise AuthError("the identity provider sent no ID token (is 'openid' among "
                            "the client's scopes?)")
        verifier = await self._id_tokens()
        claims = await asyncio.to_thread(verifier.claims, id_token)
        if not hmac.compare_digest(str(claims.get("nonce", "")), login.nonce):
            raise AuthError("the ID token was not issued for this sign-in (nonce mismatch)")
        if (not_ours := azp_problem(claims, self.client_id)) is not None:
            raise AuthError(not_ours)
        return id_token, verifier.identity(claims)

    async def verify(self, id_token: str) -> Identity:
        """A session's ID token, verified again (on every request): the person, or
        AuthError once it has expired or its key is gone. In a thread: the issuer's
        keys may be fetched."""
        return await asyncio.to_thread((await self._id_tokens()).verify, id_token)

    async def _id_tokens(self) -> JwtVerifier:
        """The verifier of ID tokens issued to this client (signature, iss, aud, exp),
        made with the endpoints."""
        await self.endpoints()
        assert self._verifier is not None  # set with the endpoints
        return self._verifier
