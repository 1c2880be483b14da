"""Approver identity and signed decision assertions.

``warmloop.workers.identity``: bearer tokens verified into an ``Identity`` (OIDC JWTs
against a real JWKS served over local HTTP, and the embedded stack's token file), the
dev identities ``warmloop dev up`` creates, and the Ed25519 assertions binding one
person to one decision. ``warmloop.workflows.approval_auth``: the pure checks the
``decide`` validator runs on an assertion's claims. ``ApprovalRule.approvals_needed``:
when the two-person rule applies.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import stat
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from warmloop.workers.identity import (
    DEV_USERS,
    AssertionSigner,
    AuthError,
    ClaimNames,
    Identity,
    JwtVerifier,
    KeysUnavailableError,
    TokenFileVerifier,
    ensure_dev_identities,
    install_verify_keys,
    key_id,
    token_digest,
    verifier_from_settings,
    verify_assertion,
)
from warmloop.workers.settings import Settings
from warmloop.workflows.approval_auth import (
    CLOCK_SKEW,
    AssertionRefused,
    DecisionClaims,
    b64url,
    check_claims,
    check_rules,
    comment_digest,
    unb64url,
)
from warmloop.workflows.profiles import ApprovalRule, ToolSpec

ISSUER = "https://idp.example.test/realms/warmloop"
AUDIENCE = "warmloop-approvals"
KID = "test-key-1"


# ---- a real JWKS over local HTTP --------------------------------------------------------

def _rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _jwk(key: rsa.RSAPrivateKey, kid: str) -> dict[str, Any]:
    jwk: dict[str, Any] = jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
    jwk.update({"kid": kid, "use": "sig", "alg": "RS256"})
    return jwk


class Jwks:
    """A JWKS endpoint on 127.0.0.1: its keys can change while it serves."""

    def __init__(self) -> None:
        self.keys: list[dict[str, Any]] = []
        self.requests = 0
        jwks = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                jwks.requests += 1
                if self.path != "/jwks.json":
                    self.send_error(404)
                    return
                body = json.dumps({"keys": jwks.keys}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/jwks.json"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return _rsa_key()


@pytest.fixture
def jwks(rsa_key: rsa.RSAPrivateKey) -> Iterator[Jwks]:
    server = Jwks()
    server.keys.append(_jwk(rsa_key, KID))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def verifier(jwks: Jwks) -> JwtVerifier:
    return JwtVerifier(issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks.url)


def _claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    claims: dict[str, Any] = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "iat": now,
                              "exp": now + 300, "roles": ["team-lead", "support-manager"]}
    claims.update(over)
    return {k: v for k, v in claims.items() if v is not None}


def _token(key: rsa.RSAPrivateKey, kid: str = KID, **over: Any) -> str:
    return jwt.encode(_claims(**over), key, algorithm="RS256", headers={"kid": kid})


def _hand_made(header: dict[str, Any], claims: dict[str, Any], secret: bytes | None) -> str:
    """A JWT built by hand (PyJWT refuses to encode the attacks below)."""
    head = b64url(json.dumps(header).encode()) + "." + b64url(json.dumps(claims).encode())
    if secret is None:
        return head + "."
    sig = hmac.new(secret, head.encode(), hashlib.sha256).digest()
    return head + "." + b64url(sig)


def test_a_valid_token_gives_the_subject_and_roles(rsa_key: rsa.RSAPrivateKey,
                                                     verifier: JwtVerifier) -> None:
    who = verifier.verify(_token(rsa_key))
    assert who == Identity(subject="alice", roles=frozenset({"team-lead", "support-manager"}),
                           tenants=None)


def test_a_tenants_claim_becomes_the_identitys_tenants(rsa_key: rsa.RSAPrivateKey,
                                                        verifier: JwtVerifier) -> None:
    who = verifier.verify(_token(rsa_key, tenants=["acme", "globex"]))
    assert who.tenants == frozenset({"acme", "globex"})
    assert verifier.verify(_token(rsa_key, tenants="acme globex")).tenants == frozenset(
        {"acme", "globex"})


def test_an_all_tenants_role_makes_a_token_without_tenants_see_none(
        rsa_key: rsa.RSAPrivateKey, jwks: Jwks) -> None:
    """``WARMLOOP_OIDC_ALL_TENANTS_ROLE``: only that role sees every tenant; a token
    naming no tenants sees none (not every one, as without the setting); the claim's
    name is the provider's."""
    names = ClaimNames(tenants_claim="https://acme.example/tenants", all_tenants_role="operator")
    v = JwtVerifier(issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks.url, claim_names=names)
    assert v.verify(_token(rsa_key)).tenants == frozenset()
    assert v.verify(_token(rsa_key, roles=["operator"])).tenants is None
    named: dict[str, Any] = {"https://acme.example/tenants": ["acme"]}
    assert v.verify(_token(rsa_key, roles=["operator"], **named)).tenants is None
    assert v.verify(_token(rsa_key, **named)).tenants == frozenset({"acme"})
    assert v.verify(_token(rsa_key, tenants=["acme"])).tenants == frozenset()  # not its claim


def test_the_tenant_settings_reach_the_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMLOOP_OIDC_TENANTS_CLAIM", "orgs")
    monkeypatch.setenv("WARMLOOP_OIDC_ALL_TENANTS_ROLE", "operator")
    names = ClaimNames.from_settings(Settings())
    assert (names.tenants_claim, names.all_tenants_role) == ("orgs", "operator")


def test_roles_as_a_space_separated_string(rsa_key: rsa.RSAPrivateKey,
                                           verifier: JwtVerifier) -> None:
    who = verifier.verify(_token(rsa_key, roles="cfo  finance-lead"))
    assert who.roles == frozenset({"cfo", "finance-lead"})


def test_no_roles_claim_means_no_roles(rsa_key: rsa.RSAPrivateKey,
                                       verifier: JwtVerifier) -> None:
    claims = _claims()
    del claims["roles"]
    token = jwt.encode(claims, rsa_key, algorithm="RS256", headers={"kid": KID})
    assert verifier.verify(token).roles == frozenset()


def test_the_roles_claim_is_configurable(rsa_key: rsa.RSAPrivateKey, jwks: Jwks) -> None:
    v = JwtVerifier(issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks.url,
                    claim_names=ClaimNames(roles_claim="groups"))
    who = v.verify(_token(rsa_key, groups=["reviewer"]))
    assert who.roles == frozenset({"reviewer"})


def test_an_expired_token_is_refused(rsa_key: rsa.RSAPrivateKey,
                                     verifier: JwtVerifier) -> None:
    now = int(time.time())
    with pytest.raises(AuthError, match="expired"):
        verifier.verify(_token(rsa_key, iat=now - 600, exp=now - 60))


def test_a_token_without_exp_is_refused(rsa_key: rsa.RSAPrivateKey,
                                        verifier: JwtVerifier) -> None:
    claims = _claims()
    del claims["exp"]
    with pytest.raises(AuthError, match="not valid"):
        verifier.verify(jwt.encode(claims, rsa_key, algorithm="RS256", headers={"kid": KID}))


def test_a_token_for_another_audience_is_refused(rsa_key: rsa.RSAPrivateKey,
                                                 verifier: JwtVerifier) -> None:
    with pytest.raises(AuthError, match="not valid"):
        verifier.verify(_token(rsa_key, aud="some-other-app"))


def test_a_token_from_another_issuer_is_refused(rsa_key: rsa.RSAPrivateKey,
                                                verifier: JwtVerifier) -> None:
    with pytest.raises(AuthError, match="not valid"):
        verifier.verify(_token(rsa_key, iss="https://evil.example.test"))


def test_a_token_signed_by_another_key_with_the_same_kid_is_refused(
        verifier: JwtVerifier) -> None:
    with pytest.raises(AuthError, match="not valid"):
        verifier.verify(_token(_rsa_key(), kid=KID))


def test_a_token_with_an_unknown_kid_is_refused(rsa_key: rsa.RSAPrivateKey,
                                                verifier: JwtVerifier) -> None:
    with pytest.raises(AuthError, match="signing key is unknown"):
        verifier.verify(_token(rsa_key, kid="no-such-kid"))


def test_an_hs256_token_signed_with_the_public_key_is_refused(
        rsa_key: rsa.RSAPrivateKey, verifier: JwtVerifier) -> None:
    """The algorithm-confusion attack: the public key (which anyone can fetch) used as
    an HMAC secret must not verify."""
    pem = rsa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    forged = _hand_made({"alg": "HS256", "typ": "JWT", "kid": KID}, _claims(sub="mallory"), pem)
    with pytest.raises(AuthError):
        verifier.verify(forged)
    # the same claims, properly signed, do verify: the refusal is the algorithm's
    assert verifier.verify(_token(rsa_key, sub="mallory")).subject == "mallory"


def test_an_unsigned_alg_none_token_is_refused(verifier: JwtVerifier) -> None:
    forged = _hand_made({"alg": "none", "typ": "JWT", "kid": KID}, _claims(), None)
    with pytest.raises(AuthError):
        verifier.verify(forged)


def test_a_token_without_sub_is_refused(rsa_key: rsa.RSAPrivateKey,
                                        verifier: JwtVerifier) -> None:
    claims = _claims()
    del claims["sub"]
    with pytest.raises(AuthError, match="not valid"):
        verifier.verify(jwt.encode(claims, rsa_key, algorithm="RS256", headers={"kid": KID}))


@pytest.mark.parametrize("token", ["", "not-a-jwt", "a.b.c"])
def test_an_empty_or_garbage_token_is_refused(token: str, verifier: JwtVerifier) -> None:
    with pytest.raises(AuthError):
        verifier.verify(token)


class Clock:
    """The monotonic clock PyJWT's JWKS client and cache read, moved by hand."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    import jwt.api_jwk
    import jwt.jwk_set_cache
    import jwt.jwks_client

    c = Clock()
    for module in (jwt.api_jwk, jwt.jwk_set_cache, jwt.jwks_client):
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


def test_a_rotated_in_key_is_fetched_for_its_unknown_kid(rsa_key: rsa.RSAPrivateKey,
                                                         jwks: Jwks, clock: Clock) -> None:
    verifier = JwtVerifier(issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks.url)
    assert verifier.verify(_token(rsa_key)).subject == "alice"
    new_key = _rsa_key()
    jwks.keys.append(_jwk(new_key, "test-key-2"))
    new_token = _token(new_key, kid="test-key-2", sub="bob")
    # PyJWT (>= 2.10) refetches for an unknown kid at most once per 30 s cooldown
    clock.now += 31
    assert verifier.verify(new_token).subject == "bob"
    assert jwks.requests == 2


def test_an_unknown_kid_does_not_refetch_within_the_cooldown(
        rsa_key: rsa.RSAPrivateKey, jwks: Jwks, clock: Clock) -> None:
    """A flood of tokens with made-up kids cannot make the service hammer the IdP."""
    verifier = JwtVerifier(issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks.url)
    verifier.verify(_token(rsa_key))
    for i in range(5):
        with pytest.raises(AuthError, match="signing key is unknown"):
            verifier.verify(_token(rsa_key, kid=f"made-up-{i}"))
    assert jwks.requests == 1


def test_a_key_removed_from_the_jwks_stops_verifying(rsa_key: rsa.RSAPrivateKey, jwks: Jwks,
                                                     clock: Clock) -> None:
    verifier = JwtVerifier(issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks.url)
    assert verifier.verify(_token(rsa_key)).subject == "alice"
    replacement = _rsa_key()
    jwks.keys[:] = [_jwk(replacement, "test-key-2")]  # the old key is revoked
    clock.now += 3600  # well past the JWKS cache's 300 s lifespan and the cooldown
    assert verifier.verify(_token(replacement, kid="test-key-2")).subject == "alice"
    with pytest.raises(AuthError):
        verifier.verify(_token(rsa_key))


def test_an_unreachable_issuer_past_the_cache_verifies_with_its_last_keys(
        rsa_key: rsa.RSAPrivateKey, jwks: Jwks, clock: Clock) -> None:
    """The identity provider down past the JWKS cache's lifespan: tokens signed with a
    key it published still verify (not everyone signed out); a verifier that never
    fetched the keys (a restart) says they are unavailable, which is not a refusal."""
    verifier = JwtVerifier(issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks.url,
                           keys_timeout_s=1.0)
    assert verifier.verify(_token(rsa_key)).subject == "alice"
    jwks.close()  # the provider is down
    clock.now += 3600  # well past the cache's 300 s
    assert verifier.verify(_token(rsa_key)).subject == "alice"
    with pytest.raises(AuthError, match="signing key is unknown"):
        verifier.verify(_token(_rsa_key(), kid="made-up"))  # a key it never published
    with pytest.raises(KeysUnavailableError):
        JwtVerifier(issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks.url,
                    keys_timeout_s=1.0).verify(_token(rsa_key))


def test_the_jwks_is_cached_between_verifies(rsa_key: rsa.RSAPrivateKey, jwks: Jwks,
                                             verifier: JwtVerifier) -> None:
    for _ in range(3):
        verifier.verify(_token(rsa_key))
    assert jwks.requests == 1


@pytest.mark.parametrize("claim", ["roles", "tenants"])
def test_a_non_list_roles_or_tenants_claim_is_an_auth_error(
        claim: str, rsa_key: rsa.RSAPrivateKey, verifier: JwtVerifier) -> None:
    over: dict[str, Any] = {claim: 5}
    with pytest.raises(AuthError):
        verifier.verify(_token(rsa_key, **over))


# ---- verifier_from_settings -------------------------------------------------------------

def test_an_issuer_without_an_audience_is_a_configuration_error(tmp_path: Path) -> None:
    s = Settings(state_dir=tmp_path, oidc_issuer=ISSUER, oidc_audience=None)
    with pytest.raises(ValueError, match="WARMLOOP_OIDC_AUDIENCE"):
        verifier_from_settings(s)


def test_an_issuer_with_an_audience_gives_a_jwt_verifier(tmp_path: Path) -> None:
    s = Settings(state_dir=tmp_path, oidc_issuer=ISSUER, oidc_audience=AUDIENCE)
    assert isinstance(verifier_from_settings(s), JwtVerifier)


def test_no_token_file_is_a_configuration_error(tmp_path: Path) -> None:
    s = Settings(state_dir=tmp_path, oidc_issuer=None, auth_token_file=None)
    with pytest.raises(ValueError, match="warmloop dev up"):
        verifier_from_settings(s)


def test_the_dev_token_file_gives_a_token_file_verifier(tmp_path: Path) -> None:
    plain = ensure_dev_identities(tmp_path / "auth")
    s = Settings(state_dir=tmp_path, oidc_issuer=None, auth_token_file=None)
    v = verifier_from_settings(s)
    assert isinstance(v, TokenFileVerifier)
    assert v.verify(plain["bob"]["token"]).subject == "bob"


def test_a_named_token_file_is_used(tmp_path: Path) -> None:
    path = tmp_path / "elsewhere.json"
    path.write_text(json.dumps({"users": [{"subject": "zed", "roles": ["cfo"],
                                           "token_sha256": token_digest("t0k")}]}))
    s = Settings(state_dir=tmp_path / "state", oidc_issuer=None, auth_token_file=path)
    v = verifier_from_settings(s)
    assert isinstance(v, TokenFileVerifier)
    assert v.verify("t0k") == Identity(subject="zed", roles=frozenset({"cfo"}))


# ---- the token file and the dev identities ----------------------------------------------

def test_every_dev_user_token_verifies_to_its_roles(tmp_path: Path) -> None:
    plain = ensure_dev_identities(tmp_path / "auth")
    assert set(plain) == set(DEV_USERS)
    v = TokenFileVerifier(tmp_path / "auth" / "tokens.json")
    for subject, roles in DEV_USERS.items():
        who = v.verify(plain[subject]["token"])
        assert who == Identity(subject=subject, roles=frozenset(roles), tenants=None)


def test_an_unknown_or_empty_token_fails(tmp_path: Path) -> None:
    plain = ensure_dev_identities(tmp_path / "auth")
    v = TokenFileVerifier(tmp_path / "auth" / "tokens.json")
    with pytest.raises(AuthError, match="unknown token"):
        v.verify("wl_dev_alice_not-the-real-one")
    with pytest.raises(AuthError, match="unknown token"):
        v.verify(plain["alice"]["token"] + "x")
    with pytest.raises(AuthError, match="no token"):
        v.verify("")


def test_an_unreadable_token_file_fails_as_an_auth_error(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="cannot be read"):
        TokenFileVerifier(tmp_path / "missing.json").verify("t")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AuthError, match="cannot be read"):
        TokenFileVerifier(bad).verify("t")


def test_the_token_file_holds_no_plain_token(tmp_path: Path) -> None:
    plain = ensure_dev_identities(tmp_path / "auth")
    text = (tmp_path / "auth" / "tokens.json").read_text()
    for subject, u in plain.items():
        assert u["token"] not in text, subject
        assert token_digest(u["token"]) in text, subject


def test_dev_identities_are_kept_across_runs(tmp_path: Path) -> None:
    auth = tmp_path / "auth"
    first = ensure_dev_identities(auth)
    signing = (auth / "approval-signing.pem").read_bytes()
    verify = (auth / "approval-verify.pem").read_bytes()
    second = ensure_dev_identities(auth)
    assert {s: u["token"] for s, u in second.items()} == {s: u["token"]
                                                        for s, u in first.items()}
    assert (auth / "approval-signing.pem").read_bytes() == signing
    assert (auth / "approval-verify.pem").read_bytes() == verify
    v = TokenFileVerifier(auth / "tokens.json")
    assert v.verify(first["carol"]["token"]).subject == "carol"


def test_dev_tokens_are_unique_per_user_and_per_state_dir(tmp_path: Path) -> None:
    a = ensure_dev_identities(tmp_path / "a")
    b = ensure_dev_identities(tmp_path / "b")
    tokens_a = [u["token"] for u in a.values()]
    assert len(set(tokens_a)) == len(tokens_a)
    assert not set(tokens_a) & {u["token"] for u in b.values()}
    assert (tmp_path / "a" / "approval-signing.pem").read_bytes() != (
        tmp_path / "b" / "approval-signing.pem").read_bytes()


def test_secret_files_are_private(tmp_path: Path) -> None:
    auth = tmp_path / "auth"
    ensure_dev_identities(auth)
    for name in ("dev-tokens.json", "approval-signing.pem"):
        assert stat.S_IMODE((auth / name).stat().st_mode) == 0o600, name


def test_the_dev_keys_sign_and_verify_assertions(tmp_path: Path) -> None:
    from warmloop.workers.identity import load_private_key, load_public_key

    auth = tmp_path / "auth"
    ensure_dev_identities(auth)
    signer = AssertionSigner(load_private_key(auth / "approval-signing.pem"))
    try:
        install_verify_keys([load_public_key(auth / "approval-verify.pem")])
        token = signer.sign_decision(Identity("erin", frozenset({"reviewer"})), job_id="j",
                                     approval_id="a", approve=True, comment="")
        assert verify_assertion(token).sub == "erin"
    finally:
        install_verify_keys([Ed25519PrivateKey.generate().public_key()])


def test_a_token_file_entrys_tenants_come_back(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"users": [
        {"subject": "tina", "roles": ["reviewer"], "tenants": ["acme"],
         "token_sha256": token_digest("tina-token")},
        {"subject": "otto", "roles": ["reviewer"], "token_sha256": token_digest("otto-token")},
        {"subject": "nora", "roles": [], "tenants": [], "token_sha256": token_digest("nora")},
    ]}))
    v = TokenFileVerifier(path)
    assert v.verify("tina-token").tenants == frozenset({"acme"})
    assert v.verify("otto-token").tenants is None
    assert v.verify("nora").tenants == frozenset()


def test_the_token_file_is_read_on_every_verify(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    entry = {"subject": "x", "roles": ["cfo"], "token_sha256": token_digest("tok")}
    path.write_text(json.dumps({"users": [entry]}))
    v = TokenFileVerifier(path)
    assert v.verify("tok").subject == "x"
    path.write_text(json.dumps({"users": []}))  # revoked
    with pytest.raises(AuthError, match="unknown token"):
        v.verify("tok")


# ---- signed assertions ------------------------------------------------------------------

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def signer() -> Iterator[AssertionSigner]:
    key = Ed25519PrivateKey.generate()
    install_verify_keys([key.public_key()])
    yield AssertionSigner(key, ttl_s=120.0)
    install_verify_keys([Ed25519PrivateKey.generate().public_key()])


def _sign(signer: AssertionSigner, *, subject: str = "carol",
          roles: frozenset[str] = frozenset({"finance-lead", "cfo"}),
          tenants: frozenset[str] | None = None, approve: bool = True,
          comment: str = "looks right") -> str:
    return signer.sign_decision(Identity(subject, roles, tenants), job_id="job-1",
                                approval_id="appr-1", approve=approve, comment=comment,
                                now=NOW)


def test_an_assertion_round_trips(signer: AssertionSigner) -> None:
    token = _sign(signer, tenants=frozenset({"globex", "acme"}), approve=False)
    c = verify_assertion(token)
    assert c.sub == "carol"
    assert c.roles == ("cfo", "finance-lead")
    assert c.job == "job-1" and c.approval == "appr-1"
    assert c.approve is False
    assert c.comment_sha256 == comment_digest("looks right")
    assert c.tenants == ("acme", "globex")
    assert c.iat == NOW and c.exp == NOW + timedelta(seconds=120)
    assert 8 <= len(c.jti) <= 64
    assert token.split(".")[:2] == ["wl1", signer.kid]


def test_an_identity_for_every_tenant_signs_none(signer: AssertionSigner) -> None:
    assert verify_assertion(_sign(signer, tenants=None)).tenants is None


def test_each_assertion_has_its_own_jti(signer: AssertionSigner) -> None:
    assert verify_assertion(_sign(signer)).jti != verify_assertion(_sign(signer)).jti


def test_a_tampered_claims_part_does_not_verify(signer: AssertionSigner) -> None:
    version, kid, claims_part, sig = _sign(signer, subject="mallory").split(".")
    claims = json.loads(unb64url(claims_part))
    claims["sub"] = "carol"
    forged = ".".join([version, kid, b64url(json.dumps(claims).encode()), sig])
    with pytest.raises(AssertionRefused, match="signature does not verify"):
        verify_assertion(forged)


def test_a_signature_by_another_key_does_not_verify(signer: AssertionSigner) -> None:
    version, kid, claims_part, _ = _sign(signer).split(".")
    other = Ed25519PrivateKey.generate().sign(unb64url(claims_part))
    with pytest.raises(AssertionRefused, match="signature does not verify"):
        verify_assertion(".".join([version, kid, claims_part, b64url(other)]))


def test_an_unknown_key_is_refused(signer: AssertionSigner) -> None:
    stranger = AssertionSigner(Ed25519PrivateKey.generate())
    with pytest.raises(AssertionRefused, match="unknown key"):
        verify_assertion(_sign(stranger))


def test_several_verify_keys_are_accepted(signer: AssertionSigner) -> None:
    old = Ed25519PrivateKey.generate()
    new = Ed25519PrivateKey.generate()
    kids = install_verify_keys([old.public_key(), new.public_key()])
    assert kids == [key_id(old.public_key()), key_id(new.public_key())]
    assert verify_assertion(_sign(AssertionSigner(old))).sub == "carol"
    assert verify_assertion(_sign(AssertionSigner(new))).sub == "carol"
    with pytest.raises(AssertionRefused, match="unknown key"):
        verify_assertion(_sign(signer))  # its key was replaced


def test_no_installed_key_refuses_every_assertion(signer: AssertionSigner) -> None:
    token = _sign(signer)
    assert install_verify_keys([]) == []
    try:
        with pytest.raises(AssertionRefused, match="WARMLOOP_APPROVAL_VERIFY_KEYS"):
            verify_assertion(token)
    finally:
        install_verify_keys([Ed25519PrivateKey.generate().public_key()])


def _claims_part(**over: Any) -> str:
    claims: dict[str, Any] = {"sub": "carol", "roles": ["cfo"], "job": "j", "approval": "a",
                              "approve": True, "comment_sha256": comment_digest(""),
                              "iat": NOW.isoformat(), "exp": NOW.isoformat(),
                              "jti": "0123456789abcdef", "tenants": None}
    claims.update(over)
    return b64url(json.dumps(claims).encode())


@pytest.mark.parametrize("token", [
    "", ".", "...", "wl1", "wl1.a.b", "x.y.z.w", "wl2.k.e30.AA", "wl1.k.e30.AA.extra",
    "wl1.k.!!!!.????", "wl1.k.%%%.AA", "wl1.k.é.AA", "wl1.k.\x00.AA", "wl1.k.e30.AA",
    "wl1.k." + b64url(b"[1, 2]") + ".AA", "wl1.k." + b64url(b"\xff\xfe") + ".AA",
    "wl1.k." + _claims_part(extra="field") + ".AA",
    "wl1.k." + _claims_part(sub="") + ".AA",
    "wl1.k." + _claims_part(jti="short") + ".AA",
    "wl1.k." + _claims_part(iat="yesterday") + ".AA",
    "wl1.k." + _claims_part()[:-3] + ".AA",
])
def test_garbage_assertions_are_refused(token: str, signer: AssertionSigner) -> None:
    with pytest.raises(AssertionRefused):
        verify_assertion(token)


def test_a_well_formed_assertion_with_a_bad_signature_is_refused(
        signer: AssertionSigner) -> None:
    for sig in (b"", b"\x00", b"\x00" * 64, b"\x01" * 65):
        with pytest.raises(AssertionRefused, match="signature does not verify"):
            verify_assertion(".".join(["wl1", signer.kid, _claims_part(), b64url(sig)]))


_b64ish = st.text(alphabet=st.sampled_from(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=+/.!é\x00 "),
    max_size=40)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(
    st.text(max_size=200),
    st.builds(lambda a, b, c: f"wl1.{a}.{b}.{c}", _b64ish, _b64ish, _b64ish),
))
def test_arbitrary_text_is_only_ever_refused(text: str, signer: AssertionSigner) -> None:
    with pytest.raises(AssertionRefused):
        verify_assertion(text)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(claims=st.one_of(st.binary(max_size=120),
                        st.dictionaries(st.sampled_from(
                            ["sub", "roles", "job", "approval", "approve", "comment_sha256",
                             "iat", "exp", "jti", "tenants"]),
                            st.one_of(st.none(), st.booleans(), st.integers(),
                                      st.text(max_size=20), st.lists(st.text(max_size=5))),
                            ).map(lambda d: json.dumps(d).encode())),
       sig=st.binary(max_size=80))
def test_a_known_key_with_arbitrary_parts_is_only_ever_refused(
        claims: bytes, sig: bytes, signer: AssertionSigner) -> None:
    """Reaches the signature check (the kid is installed) with any claims and signature."""
    token = ".".join(["wl1", signer.kid, b64url(claims), b64url(sig)])
    with pytest.raises(AssertionRefused):
        verify_assertion(token)


# ---- check_claims / check_rules ---------------------------------------------------------

def _dc(**over: Any) -> DecisionClaims:
    fields: dict[str, Any] = {"sub": "carol", "roles": ("cfo", "finance-lead"), "job": "job-1",
                              "approval": "appr-1", "approve": True,
                              "comment_sha256": comment_digest("ok"), "iat": NOW,
                              "exp": NOW + timedelta(seconds=120), "jti": "0123456789abcdef",
                              "tenants": None}
    fields.update(over)
    return DecisionClaims(**fields)


def _check(claims: DecisionClaims, **over: Any) -> None:
    kw: dict[str, Any] = {"job_id": "job-1", "approval_id": "appr-1", "approve": True,
                          "comment": "ok", "now": NOW}
    kw.update(over)
    check_claims(claims, **kw)


def test_claims_for_this_decision_pass() -> None:
    _check(_dc())
    _check(_dc(approve=False), approve=False)


def test_claims_for_another_job_are_refused() -> None:
    with pytest.raises(AssertionRefused, match="approval appr-1 of job job-1, not appr-1 of "
                                               "job-2"):
        _check(_dc(), job_id="job-2")


def test_claims_for_another_approval_are_refused() -> None:
    with pytest.raises(AssertionRefused, match="not appr-2 of job-1"):
        _check(_dc(), approval_id="appr-2")


def test_claims_for_the_opposite_decision_are_refused() -> None:
    with pytest.raises(AssertionRefused, match="opposite decision"):
        _check(_dc(approve=True), approve=False)
    with pytest.raises(AssertionRefused, match="opposite decision"):
        _check(_dc(approve=False), approve=True)


def test_claims_for_another_comment_are_refused() -> None:
    with pytest.raises(AssertionRefused, match="comment differs"):
        _check(_dc(), comment="ok, and also pay the attacker")
    with pytest.raises(AssertionRefused, match="comment differs"):
        _check(_dc(), comment="")


def test_claims_expire_at_exactly_exp() -> None:
    exp = NOW + timedelta(seconds=120)
    _check(_dc(), now=exp - timedelta(microseconds=1))
    with pytest.raises(AssertionRefused, match="expired at " + exp.isoformat().replace("+",
                                                                                      r"\+")):
        _check(_dc(), now=exp)
    with pytest.raises(AssertionRefused, match="expired"):
        _check(_dc(), now=exp + timedelta(hours=1))


def test_claims_issued_too_far_in_the_future_are_refused() -> None:
    future = _dc(iat=NOW + CLOCK_SKEW + timedelta(seconds=1),
                 exp=NOW + CLOCK_SKEW + timedelta(seconds=121))
    with pytest.raises(AssertionRefused, match="issued in the future"):
        _check(future)


def test_claims_issued_within_the_clock_skew_are_accepted() -> None:
    _check(_dc(iat=NOW + CLOCK_SKEW, exp=NOW + CLOCK_SKEW + timedelta(seconds=120)))
    _check(_dc(iat=NOW + timedelta(seconds=1), exp=NOW + timedelta(seconds=121)))


def _rules(claims: DecisionClaims, **over: Any) -> None:
    kw: dict[str, Any] = {"kind": "payment", "allowed_roles": ("cfo", "finance-lead"),
                          "submitted_by": "dave", "already_approved_by": (),
                          "submitter_may_approve": False, "tenant": "default"}
    kw.update(over)
    check_rules(claims, **kw)


def test_an_allowed_role_passes_the_rules() -> None:
    _rules(_dc(roles=("finance-lead",)))
    _rules(_dc(roles=("cfo", "reviewer")), submitted_by=None)


def test_a_role_not_allowed_is_refused_naming_the_allowed_roles() -> None:
    with pytest.raises(AssertionRefused) as e:
        _rules(_dc(sub="erin", roles=("reviewer",)))
    msg = str(e.value)
    assert "erin (roles: reviewer)" in msg
    assert "may not decide payment approvals" in msg
    assert "allowed: cfo, finance-lead" in msg
    with pytest.raises(AssertionRefused, match=r"roles: none"):
        _rules(_dc(sub="mallory", roles=()))


def test_no_allowed_role_refuses_everyone() -> None:
    with pytest.raises(AssertionRefused, match="may not decide"):
        _rules(_dc(), allowed_roles=())


def test_the_submitter_is_refused_unless_allowed() -> None:
    with pytest.raises(AssertionRefused, match="carol submitted this job and may not decide "
                                               "its payment approval"):
        _rules(_dc(), submitted_by="carol")
    _rules(_dc(), submitted_by="carol", submitter_may_approve=True)


def test_the_same_person_twice_is_refused() -> None:
    with pytest.raises(AssertionRefused, match="carol already approved this"):
        _rules(_dc(), already_approved_by=["bob", "carol"])
    _rules(_dc(), already_approved_by=["bob"])
    # a generator is fine too
    with pytest.raises(AssertionRefused, match="already approved"):
        _rules(_dc(), already_approved_by=(s for s in ["carol"]))


def test_a_tenant_outside_the_claims_is_refused() -> None:
    scoped = _dc(tenants=("acme",))
    _rules(scoped, tenant="acme")
    with pytest.raises(AssertionRefused, match="carol may not decide approvals of tenant "
                                               "globex"):
        _rules(scoped, tenant="globex")
    with pytest.raises(AssertionRefused, match="tenant default"):
        _rules(scoped)  # the default tenant is a tenant like any other
    with pytest.raises(AssertionRefused, match="tenant acme"):
        _rules(_dc(tenants=()), tenant="acme")


def test_no_tenants_claim_accepts_any_tenant() -> None:
    for tenant in ("default", "acme", "globex"):
        _rules(_dc(tenants=None), tenant=tenant)


def test_the_tenant_is_checked_before_the_role() -> None:
    with pytest.raises(AssertionRefused, match="tenant globex"):
        _rules(_dc(roles=(), tenants=("acme",)), tenant="globex")


# ---- ApprovalRule: the two-person rule --------------------------------------------------

class PayArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    amount: float
    vendor_id: int


PAY = ToolSpec("pay", "Pay a vendor.", PayArgs, side_effect=True)


def _rule(**over: Any) -> ApprovalRule:
    fields: dict[str, Any] = {"kind": "payment", "tool": "pay", "approvers": ("cfo",),
                              "deadline_s": 3600.0, "field": "amount", "op": "gt",
                              "value": 1000, "two_approvers_over": 50_000}
    fields.update(over)
    return ApprovalRule(**fields)


def test_two_approvals_over_the_threshold() -> None:
    rule = _rule()
    assert rule.approvals_needed({"amount": 50_000.01}) == 2
    assert rule.approvals_needed({"amount": 1_000_000}) == 2


def test_one_approval_at_or_under_the_threshold() -> None:
    rule = _rule()
    assert rule.approvals_needed({"amount": 50_000}) == 1
    assert rule.approvals_needed({"amount": 50_000.0}) == 1
    assert rule.approvals_needed({"amount": 2_000}) == 1


@pytest.mark.parametrize("args", [{"amount": True}, {"amount": "999999"}, {}, {"amount": None},
                                  {"other": 10**9}])
def test_one_approval_for_a_non_number(args: dict[str, Any]) -> None:
    assert _rule().approvals_needed(args) == 1


def test_one_approval_without_a_two_person_rule() -> None:
    assert _rule(two_approvers_over=None).approvals_needed({"amount": 10**9}) == 1
    assert _rule(field=None, two_approvers_over=None).approvals_needed({"amount": 10**9}) == 1


def test_a_two_person_rule_needs_a_field() -> None:
    _rule().check(PAY)
    with pytest.raises(ValueError, match="two_approvers_over needs a field"):
        _rule(field=None).check(PAY)
    _rule(field=None, two_approvers_over=None).check(PAY)


def test_a_rule_on_a_misspelt_field_is_refused() -> None:
    with pytest.raises(ValueError, match="has no argument 'amuont'"):
        _rule(field="amuont").check(PAY)
