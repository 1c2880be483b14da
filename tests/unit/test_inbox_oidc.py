"""The inbox's sign-in at an identity provider (OpenID Connect's authorization code flow)
against a real OpenID provider server (``oidc-provider-mock``: authlib's provider, its
own HTTP server, keys and JWKS) on loopback, the inbox on a fake backend. The person's
subject and roles come from the provider's ID token; an answer this browser did not
ask for, a refusal at the provider, an ID token for another sign-in or another client,
and a provider that is down each end on a clear page, signed out. The same in a real
browser: tests/browser/test_inbox_oidc_browser.py."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx
import oidc_provider_mock
import pytest
from starlette.testclient import TestClient

from tests.unit.test_inbox import FakeVerifier, csrf_of, make_backend
from warmloop.workers.identity import ClaimNames
from warmloop.workers.inbox import create_app
from warmloop.workers.inbox.oidc import OidcLogin, azp_problem, pkce_challenge
from warmloop.workers.inbox.session import COOKIE_NAME, LOGIN_COOKIE_NAME, Session, SessionSealer
from warmloop.workers.settings import Settings

CLIENT = "warmloop-inbox"
KEY = b"k" * 32


@pytest.fixture(scope="module")
def idp() -> Iterator[str]:
    """A real OpenID provider on loopback; any client id, any redirect URI."""
    with oidc_provider_mock.run_server_in_thread() as server:
        url = f"http://localhost:{server.server_port}"
        for sub, roles in (("bob", ["finance-lead"]), ("mallory", [])):
            httpx.put(f"{url}/users/{sub}", json={"roles": roles}).raise_for_status()
        yield url


def inbox(issuer: str, client_id: str = CLIENT, *,
          claim_names: ClaimNames | None = None) -> TestClient:
    """The inbox as a confidential client (the provider takes any secret)."""
    oidc = OidcLogin(issuer=issuer, client_id=client_id, client_secret="inbox-secret",
                     claim_names=claim_names)
    app = create_app(Settings(), backend=make_backend(), verifier=FakeVerifier(),
                     session_key=KEY, oidc=oidc)
    return TestClient(app, follow_redirects=False)


def start(web: TestClient, next_url: str = "/history") -> str:
    """The inbox's redirect to the provider (its login cookie kept by the client)."""
    r = web.get("/signin/oidc", params={"next": next_url})
    assert r.status_code == 303, r.text
    assert LOGIN_COOKIE_NAME in r.cookies
    return r.headers["location"]


def authorize(authorize_url: str, sub: str = "bob", *, deny: bool = False,
              **replace: str) -> str:
    """The person at the provider's form: the callback URL it sends them back to.
    ``replace``: authorization request parameters changed on the way (an attacker's)."""
    if replace:
        parts = urlsplit(authorize_url)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()} | replace
        authorize_url = urlunsplit(parts._replace(query=urlencode(query)))
    form = {"action": "deny"} if deny else {"sub": sub}
    r = httpx.post(authorize_url, data=form)
    assert r.status_code == 302, r.text
    return r.headers["location"]


def come_back(web: TestClient, callback_url: str) -> Any:
    parts = urlsplit(callback_url)
    assert parts.path == "/signin/callback"
    return web.get(f"{parts.path}?{parts.query}")


def test_a_person_signs_in_at_the_provider_with_its_roles(idp: str) -> None:
    with inbox(idp) as web:
        page = web.get("/signin")
        assert 'href="/signin/oidc?next=/"' in page.text  # offered beside the token form
        to_provider = start(web, "/history")
        query = parse_qs(urlsplit(to_provider).query)
        assert to_provider.startswith(f"{idp}/oauth2/authorize?")
        assert query["client_id"] == [CLIENT] and query["response_type"] == ["code"]
        assert query["redirect_uri"] == ["http://testserver/signin/callback"]
        assert query["code_challenge_method"] == ["S256"] and "openid" in query["scope"][0]
        r = come_back(web, authorize(to_provider, "bob"))
        assert r.status_code == 200, r.text
        # a same-site refresh to where the person was headed (the Strict session cookie
        # is not sent on the provider's redirect chain)
        assert '<meta http-equiv="refresh" content="0; url=/history">' in r.text
        assert COOKIE_NAME in r.cookies
        # the sign-in under way is over: its cookie deleted, in the response and the jar
        assert any(h.startswith(f"{LOGIN_COOKIE_NAME}=") and "Max-Age=0" in h
                   for h in r.headers.get_list("set-cookie"))
        assert web.cookies.get(LOGIN_COOKIE_NAME) is None
        history = web.get("/history")
        assert history.status_code == 200
        assert re.search(r'data-testid="subject">bob<', history.text)
        assert "finance-lead" in history.text and "Signed in as bob." in history.text
        # the session holds the provider's ID token, verified as this client's
        session = SessionSealer(KEY).open(web.cookies.get(COOKIE_NAME))
        assert session is not None and session.source == "oidc" and session.token
        # a person the provider knows without roles signs in, and may decide nothing
        with inbox(idp) as web2:
            assert come_back(web2, authorize(start(web2, "/"), "mallory")).status_code == 200
            assert "no roles" in web2.get("/").text


def test_with_an_all_tenants_role_an_id_token_naming_no_tenants_sees_none(idp: str) -> None:
    """bob's ID token names no tenants: without the setting he sees every tenant's
    approvals his roles allow (the payment); with ``all_tenants_role`` he sees none,
    and an operator sees them all."""
    httpx.put(f"{idp}/users/olga", json={"roles": ["finance-lead", "operator"]}
              ).raise_for_status()

    def rows(names: ClaimNames | None, sub: str) -> int:
        with inbox(idp, claim_names=names) as web:
            assert come_back(web, authorize(start(web, "/"), sub)).status_code == 200
            return web.get("/").text.count('data-testid="approval-row"')

    assert rows(None, "bob") == 1
    strict = ClaimNames(all_tenants_role="operator")
    assert rows(strict, "bob") == 0
    assert rows(strict, "olga") == 1


def test_an_answer_this_browser_did_not_ask_for_is_refused(idp: str) -> None:
    with inbox(idp) as web, inbox(idp) as other:
        callback = authorize(start(web))
        # another browser (no login cookie: a code sent to a victim's inbox)
        r = come_back(other, callback)
        assert r.status_code == 401 and "no sign-in was under way" in r.text
        assert other.get("/").status_code == 303  # still signed out
        # this browser, the state changed
        tampered = callback.replace("state=", "state=x")
        r = come_back(web, tampered)
        assert r.status_code == 401 and "state mismatch" in r.text
        # the login cookie went with the failed answer: the genuine one is refused now
        assert come_back(web, callback).status_code == 401


def test_a_refusal_at_the_provider_signs_no_one_in(idp: str) -> None:
    with inbox(idp) as web:
        r = come_back(web, authorize(start(web), deny=True))
        assert r.status_code == 401 and "refused the sign-in (access_denied: " in r.text
        assert web.get("/").status_code == 303


def test_an_id_token_issued_for_another_sign_in_is_refused(idp: str) -> None:
    """The nonce the provider puts in the ID token is the one the inbox asked for."""
    with inbox(idp) as web:
        r = come_back(web, authorize(start(web), nonce="someone-elses"))
        assert r.status_code == 401 and "nonce mismatch" in r.text
        assert web.get("/").status_code == 303


def test_an_id_token_of_another_client_does_not_open_a_session(idp: str) -> None:
    """A session whose ID token was issued to another client (its aud) is signed out at
    the next request, as an expired one would be."""
    with inbox(idp, client_id="someone-else") as foreign:
        come_back(foreign, authorize(start(foreign)))
        stolen = SessionSealer(KEY).open(foreign.cookies.get(COOKIE_NAME))
        assert stolen is not None and stolen.token
    with inbox(idp) as web:
        web.cookies.set(COOKIE_NAME, SessionSealer(KEY).seal(
            Session.signed_in(stolen.token, source="oidc")))
        r = web.get("/")
        assert r.status_code == 303 and r.headers["location"].startswith("/signin")


def test_a_provider_that_is_down_gets_a_clear_page() -> None:
    with inbox("http://127.0.0.1:1") as web:
        r = web.get("/signin/oidc")
        assert r.status_code == 503
        assert "discovery document" in r.text and "Identity provider unavailable" in r.text


def test_without_a_client_id_no_sign_in_at_a_provider_is_offered() -> None:
    app = create_app(Settings(), backend=make_backend(), verifier=FakeVerifier())
    with TestClient(app, follow_redirects=False) as web:
        assert "/signin/oidc" not in web.get("/signin").text
        assert web.get("/signin/oidc").status_code == 404
        assert web.get("/signin/callback?code=x&state=y").status_code == 404


def test_pkce_challenge_is_rfc_7636s_example() -> None:
    assert pkce_challenge("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk") == \
        "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"


def test_no_redirect_off_site_after_signing_in(idp: str) -> None:
    """A next path with a tab (browsers drop it: ``/<tab>/evil`` is ``//evil``) or a
    scheme-relative one lands on the inbox's front page."""
    for bad in ("/\t/evil.example", "//evil.example", "/\\evil.example", "/ok\n/x"):
        with inbox(idp) as web:
            r = come_back(web, authorize(start(web, bad)))
            assert r.status_code == 200
            assert '<meta http-equiv="refresh" content="0; url=/">' in r.text, bad


def test_a_forged_callback_signs_no_one_out(idp: str) -> None:
    """The callback is reached from other sites, where the browser sends no session
    cookie: its refusals set none, so a link to it cannot end a session."""
    with inbox(idp) as web:
        come_back(web, authorize(start(web)))
        for query in ("error=access_denied", "code=x&state=y"):
            r = web.get(f"/signin/callback?{query}")
            assert r.status_code == 401
            assert not any(h.startswith(f"{COOKIE_NAME}=")
                           for h in r.headers.get_list("set-cookie"))
        assert web.get("/").status_code == 200  # still signed in


def test_a_provider_down_after_a_restart_keeps_people_signed_in(idp: str) -> None:
    """An inbox restarted (same session key) while its provider is unreachable answers
    503 and keeps the session: the ID token's validity is unknown, not refused."""
    with inbox(idp) as web:
        come_back(web, authorize(start(web)))
        cookie = web.cookies.get(COOKIE_NAME)
    with inbox("http://127.0.0.1:1") as restarted:  # its provider unreachable
        restarted.cookies.set(COOKIE_NAME, cookie or "")
        r = restarted.get("/")
        assert r.status_code == 503 and "Identity provider unavailable" in r.text
        kept = SessionSealer(KEY).open(r.cookies.get(COOKIE_NAME))  # what the page set
        assert kept is not None and kept.token and kept.source == "oidc"
        api = restarted.get("/api/approvals")
        assert api.status_code == 401  # the API takes bearer tokens, not the cookie


def test_an_id_token_for_several_audiences_must_name_this_client_its_azp() -> None:
    assert azp_problem({"aud": CLIENT}, CLIENT) is None
    assert azp_problem({"aud": [CLIENT]}, CLIENT) is None
    assert azp_problem({"aud": [CLIENT, "other"], "azp": CLIENT}, CLIENT) is None
    assert "azp" in (azp_problem({"aud": [CLIENT, "other"], "azp": "other"}, CLIENT) or "")
    assert "azp" in (azp_problem({"aud": [CLIENT, "other"]}, CLIENT) or "")


def test_signing_out_signs_out_at_the_provider_too(idp: str) -> None:
    """RP-initiated logout: the inbox's session ends and the browser goes to the
    provider's end-session endpoint with the ID token as the hint and the sign-in page
    to come back to; the provider's confirmation sends it there."""
    with inbox(idp) as web:
        come_back(web, authorize(start(web)))
        session = SessionSealer(KEY).open(web.cookies.get(COOKIE_NAME))
        assert session is not None and session.token
        r = web.post("/signout", data={"csrf": csrf_of(web.get("/signout").text)})
        # a page that goes on to the provider (a 303 would break the CSP's form-action)
        assert r.status_code == 200
        found = re.search(r'<meta http-equiv="refresh" content="0; url=([^"]+)">', r.text)
        assert found is not None, r.text
        to_provider = html.unescape(found.group(1))
        assert to_provider.startswith(f"{idp}/oauth2/end_session?")
        assert f'href="{found.group(1)}"' in r.text  # and a link, should refresh be off
        query = parse_qs(urlsplit(to_provider).query)
        assert query["id_token_hint"] == [session.token] and query["client_id"] == [CLIENT]
        assert query["post_logout_redirect_uri"] == ["http://testserver/signin"]
        ended = SessionSealer(KEY).open(r.cookies.get(COOKIE_NAME))
        assert ended is not None and ended.token is None  # signed out here at once
        assert web.get("/").status_code == 303
        form = httpx.get(to_provider)  # the provider asks the person to confirm
        assert form.status_code == 200
        back = httpx.post(f"{idp}/oauth2/end_session/confirm",
                          data={"redirect_uri": query["post_logout_redirect_uri"][0]})
        assert back.status_code == 302
        assert back.headers["location"] == "http://testserver/signin"


def test_a_pasted_token_or_a_provider_down_signs_out_here_alone(idp: str) -> None:
    """Only a session opened at the provider ends there; with the provider unreachable
    the inbox still signs the person out (an outage must not keep anyone signed in)."""
    with inbox(idp) as web:
        web.cookies.set(COOKIE_NAME, SessionSealer(KEY).seal(Session.signed_in("alice")))
        r = web.post("/signout", data={"csrf": csrf_of(web.get("/signout").text)})
        assert (r.status_code, r.headers["location"]) == (303, "/signin")
    with inbox(idp) as web:
        come_back(web, authorize(start(web)))
        cookie = web.cookies.get(COOKIE_NAME) or ""
    with inbox("http://127.0.0.1:1") as down:
        down.cookies.set(COOKIE_NAME, cookie)
        session = SessionSealer(KEY).open(cookie)
        assert session is not None
        r = down.post("/signout", data={"csrf": session.csrf})
        assert (r.status_code, r.headers["location"]) == (303, "/signin")
        ended = SessionSealer(KEY).open(r.cookies.get(COOKIE_NAME))
        assert ended is not None and ended.token is None
