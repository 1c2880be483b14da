"""Who an approver is: bearer tokens verified into an identity, and the signed
decision assertions the approvals service issues for a verified identity.

Two token sources:

- ``JwtVerifier``: OIDC access or ID tokens (JWT) checked against the configured
  issuer's JWKS, audience and expiry; roles come from a claim (``roles`` by default).
- ``TokenFileVerifier``: the embedded stack's local token file, written by
  ``warmloop dev up``: each token's SHA-256 with a subject and roles (the file never
  holds a usable token).

``AssertionSigner`` (the approvals service, holding the Ed25519 private key) turns a
verified identity into a short-lived assertion for one decision; the agent worker
installs the public keys with ``install_verify_keys`` and the ``decide`` validator
calls ``verify_assertion``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from warmloop.workflows.approval_auth import (
    AssertionRefused,
    DecisionClaims,
    comment_digest,
    encode_assertion,
    parse_assertion,
    signing_input,
)

log = structlog.get_logger(__name__)

if TYPE_CHECKING:
    from warmloop.workers.settings import Settings


@dataclass(frozen=True)
class Identity:
    """A person verified from a token."""

    subject: str
    roles: frozenset[str]
    tenants: frozenset[str] | None = None
    """The tenants whose approvals the person may see and decide; None: every tenant."""


class AuthError(Exception):
    """A token that does not verify; the message is safe to show the person."""


class KeysUnavailableError(Exception):
    """The issuer's signing keys could not be fetched: a token's validity is unknown,
    not refused. Callers answer "try again" (503) and keep the person signed in."""


class TokenVerifier(ABC):
    """Turns a bearer token into a verified identity."""

    @abstractmethod
    def verify(self, token: str) -> Identity:
        """The token's identity; raises AuthError for a bad, unknown or expired token."""


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None for anything else."""
    scheme, _, token = (authorization or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenFileVerifier(TokenVerifier):
    """Local tokens for the embedded stack (``<state_dir>/auth/tokens.json``):
    ``{"users": [{"subject": ..., "roles": [...], "token_sha256": ...}]}``. The file
    is read on every verify, so revoking a token is editing the file."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def verify(self, token: str) -> Identity:
        if not token:
            raise AuthError("no token")
        try:
            users = json.loads(self._path.read_text())["users"]
        except (OSError, ValueError, KeyError) as e:
            raise AuthError(f"the token file {self._path} cannot be read ({e})") from None
        digest = token_digest(token)
        for u in users:
            if hmac.compare_digest(str(u.get("token_sha256", "")), digest):
                tenants = u.get("tenants")
                return Identity(subject=str(u["subject"]), roles=frozenset(u.get("roles", [])),
                                tenants=None if tenants is None else frozenset(tenants))
        raise AuthError("unknown token")


@dataclass(frozen=True)
class ClaimNames:
    """How a verified JWT names the person's roles and tenants (identity providers use
    claims of their own: ``groups``, ``https://acme.example/tenants``)."""

    roles_claim: str = "roles"
    """The claim that lists the approver's roles."""
    tenants_claim: str = "tenants"
    """The claim that lists the tenants whose approvals the person may see and decide."""
    all_tenants_role: str | None = None
    """None: a token without ``tenants_claim`` sees every tenant (a single-tenant
    deployment's tokens name none). Set (e.g. ``operator``): only a token with this
    role sees every tenant; one without it and without the claim sees none. Hazard:
    unset in a multi-tenant deployment, a token your provider issues without the claim
    decides every tenant's approvals its roles allow."""

    @classmethod
    def from_settings(cls, settings: Settings) -> ClaimNames:
        return cls(roles_claim=settings.oidc_roles_claim,
                   tenants_claim=settings.oidc_tenants_claim,
                   all_tenants_role=settings.oidc_all_tenants_role)

    def identity(self, claims: dict[str, Any]) -> Identity:
        """The person verified claims name: subject, roles and tenants."""
        roles = _names(claims.get(self.roles_claim, []), self.roles_claim)
        named = claims.get(self.tenants_claim)
        tenants = None if named is None else _names(named, self.tenants_claim)
        if self.all_tenants_role is not None:
            if self.all_tenants_role in roles:
                tenants = None
            elif tenants is None:
                tenants = frozenset()
        return Identity(subject=str(claims["sub"]), roles=roles, tenants=tenants)


class JwtVerifier(TokenVerifier):
    """OIDC bearer tokens: signature against the issuer's JWKS (cached, refetched for
    an unknown key id), ``iss``, ``aud`` and ``exp``; asymmetric algorithms only, so
    a token signed with the public key as an HMAC secret is refused."""

    ALGORITHMS = ["RS256", "RS384", "RS512", "ES256", "ES384", "PS256", "EdDSA"]

    def __init__(self, *, issuer: str, audience: str, jwks_url: str | None = None,
                 claim_names: ClaimNames | None = None, keys_timeout_s: float = 5.0,
                 keys_lifespan_s: float = 300.0) -> None:
        import jwt

        self._issuer, self._audience = issuer, audience
        self._names = claim_names or ClaimNames()
        url = jwks_url or issuer.rstrip("/") + "/.well-known/jwks.json"
        # The JWKS is cached (``keys_lifespan_s``) but single keys are not: a key the
        # issuer removed stops verifying when the cache expires, not at the next restart.
        self._jwks = jwt.PyJWKClient(url, cache_keys=False, lifespan=keys_lifespan_s,
                                     timeout=keys_timeout_s)
        self._last_keys: list[Any] = []
        """The keys of the last JWKS fetched: used while the issuer cannot be reached
        (its keys past the cache's lifespan), so an outage of the identity provider
        does not refuse every token signed with a key it published."""

    def _signing_key(self, token: str) -> Any:
        """The JWKS key the token names (its ``kid``, or the issuer's one key), refetched
        for a key id the cached set lacks (a rotation; PyJWT's cooldown keeps a flood of
        made-up ids from hammering the issuer). The issuer unreachable: its last keys."""
        import jwt

        kid = jwt.get_unverified_header(token).get("kid")
        try:
            if kid is None:
                self._last_keys = self._jwks.get_signing_keys()
                key = _pick(self._last_keys, None)
            else:
                key = self._jwks.get_signing_key(kid)
                self._last_keys = self._jwks.get_signing_keys()  # the set just used: cached
        except jwt.PyJWKClientConnectionError as e:
            if not self._last_keys:
                raise KeysUnavailableError(
                    f"the identity provider's keys could not be fetched "
                    f"({type(e).__name__}); try again shortly") from None
            log.warning("jwks_unreachable_using_last_keys", error=str(e)[:200])
            key = _pick(self._last_keys, kid)
        if key is None:
            raise AuthError(f"the token's signing key is unknown (no key {kid!r} among the "
                            "issuer's)" if kid is not None else
                            "the token names no key id and the issuer has several signing "
                            "keys")
        return key

    def verify(self, token: str) -> Identity:
        return self.identity(self.claims(token))

    def claims(self, token: str) -> dict[str, Any]:
        """The token's claims once its signature, issuer, audience and expiry hold."""
        import jwt

        if not token:
            raise AuthError("no token")
        try:
            key = self._signing_key(token)
            claims: dict[str, Any] = jwt.decode(
                token, key.key, algorithms=self.ALGORITHMS, audience=self._audience,
                issuer=self._issuer, options={"require": ["exp", "iss", "aud", "sub"]})
        except jwt.ExpiredSignatureError:
            raise AuthError("the token has expired; sign in again") from None
        except jwt.PyJWKClientError as e:
            raise AuthError(f"the token's signing key is unknown ({e})") from None
        except jwt.InvalidTokenError as e:
            raise AuthError(f"the token is not valid ({e})") from None
        return claims

    def identity(self, claims: dict[str, Any]) -> Identity:
        """The person verified claims name: subject, roles and tenants."""
        return self._names.identity(claims)


def _pick(keys: list[Any], kid: str | None) -> Any:
    """The key ``kid`` names, or the only key when the token names none (OIDC lets an
    issuer with one key leave the id out); None otherwise."""
    if kid is None:
        return keys[0] if len(keys) == 1 else None
    return next((k for k in keys if k.key_id == kid), None)


def _names(value: Any, claim: str) -> frozenset[str]:
    """A claim listing names: a list of strings, or one space-separated string."""
    if isinstance(value, str):
        return frozenset(value.split())
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return frozenset(value)
    raise AuthError(f"the token's {claim!r} claim is not a list of names")


def _write_private(path: Path, data: bytes) -> None:
    """Create or replace ``path`` readable by its owner only, never briefly wider."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    path.chmod(0o600)


def verifier_from_settings(settings: Settings) -> TokenVerifier:
    if settings.oidc_issuer:
        if not settings.oidc_audience:
            raise ValueError("WARMLOOP_OIDC_ISSUER is set without WARMLOOP_OIDC_AUDIENCE; "
                             "set the audience your tokens are issued for")
        return JwtVerifier(issuer=settings.oidc_issuer, audience=settings.oidc_audience,
                           jwks_url=settings.oidc_jwks_url,
                           claim_names=ClaimNames.from_settings(settings))
    path = settings.auth_token_file or settings.state_dir / "auth" / "tokens.json"
    if not path.exists():
        raise ValueError(f"no approver tokens: {path} does not exist; run `warmloop dev up` "
                         "or set WARMLOOP_OIDC_ISSUER / WARMLOOP_AUTH_TOKEN_FILE")
    return TokenFileVerifier(path)


# ---- assertions -------------------------------------------------------------------------

def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


class AssertionSigner:
    """Signs one decision of a verified person; held only by the approvals service."""

    def __init__(self, private_key: Ed25519PrivateKey, *, ttl_s: float = 120.0) -> None:
        self._key, self._ttl = private_key, timedelta(seconds=ttl_s)
        self.kid = key_id(private_key.public_key())

    def sign_decision(self, who: Identity, *, job_id: str, approval_id: str, approve: bool,
                      comment: str, now: datetime | None = None) -> str:
        now = now or datetime.now(UTC)
        claims = DecisionClaims(sub=who.subject, roles=tuple(sorted(who.roles)), job=job_id,
                                approval=approval_id, approve=approve,
                                comment_sha256=comment_digest(comment), iat=now,
                                exp=now + self._ttl, jti=secrets.token_hex(16),
                                tenants=(None if who.tenants is None
                                         else tuple(sorted(who.tenants))))
        return encode_assertion(self.kid, claims, self._key.sign(signing_input(claims)))


def load_private_key(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(path.read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} is not an Ed25519 public key")
    return key


def signer_from_settings(settings: Settings) -> AssertionSigner:
    path = settings.approval_signing_key or settings.state_dir / "auth" / "approval-signing.pem"
    if not path.exists():
        raise ValueError(f"no approval signing key at {path}; run `warmloop dev up` or set "
                         "WARMLOOP_APPROVAL_SIGNING_KEY")
    return AssertionSigner(load_private_key(path), ttl_s=settings.approval_assertion_ttl_s)


def verify_key_paths(settings: Settings) -> list[Path]:
    if settings.approval_verify_keys.strip():
        return [Path(p.strip()) for p in settings.approval_verify_keys.split(",") if p.strip()]
    return [settings.state_dir / "auth" / "approval-verify.pem"]


_VERIFY_KEYS: dict[str, Ed25519PublicKey] = {}
"""The keys this process accepts assertions from, by key id; set at worker start.
The workflow imports this module passed through the sandbox, so it sees these."""


def install_verify_keys(keys: list[Ed25519PublicKey]) -> list[str]:
    """Replace the accepted keys (at worker start); returns their key ids."""
    _VERIFY_KEYS.clear()
    _VERIFY_KEYS.update({key_id(k): k for k in keys})
    return list(_VERIFY_KEYS)


def install_verify_keys_from_settings(settings: Settings) -> list[str]:
    """The agent worker's start: without keys, every decision is refused (safe, and the
    refusal says which setting to fix)."""
    return install_verify_keys([load_public_key(p) for p in verify_key_paths(settings)
                                if p.exists()])


def verify_assertion(token: str) -> DecisionClaims:
    """The claims of an assertion whose signature holds under an installed key.
    Raises AssertionRefused; called by the ``decide`` validator (not on replay)."""
    parsed = parse_assertion(token)
    if not _VERIFY_KEYS:
        raise AssertionRefused("this worker accepts no approval assertions: no verify key "
                               "installed (set WARMLOOP_APPROVAL_VERIFY_KEYS)")
    key = _VERIFY_KEYS.get(parsed.kid)
    if key is None:
        raise AssertionRefused(f"the assertion is signed with an unknown key {parsed.kid}")
    try:
        key.verify(parsed.signature, parsed.signed)
    except InvalidSignature:
        raise AssertionRefused("the assertion's signature does not verify") from None
    return parsed.claims


# ---- the embedded stack's dev identities ------------------------------------------------

DEV_USERS: dict[str, tuple[str, ...]] = {
    "alice": ("team-lead", "support-manager"),
    "bob": ("finance-lead",),
    "carol": ("cfo", "finance-lead"),
    "dave": ("support-director", "cfo-office"),
    "erin": ("reviewer",),
    "mallory": (),
    "demo-bot": ("team-lead", "support-manager", "support-director", "finance-lead", "cfo",
                 "cfo-office", "reviewer"),
}
"""Who ``warmloop dev up`` creates tokens for: one person per approver role of the
bundled profiles, a person with no role, and the demo's approving bot."""


def ensure_dev_identities(auth_dir: Path) -> dict[str, dict[str, Any]]:
    """Create (once) the embedded stack's signing key pair, its token file and the
    plain tokens of the dev users (``dev-tokens.json``, mode 0600, for tests and the
    demo). Existing files are kept, so tokens survive ``dev down``/``dev up``."""
    auth_dir.mkdir(parents=True, exist_ok=True)
    signing, verify = auth_dir / "approval-signing.pem", auth_dir / "approval-verify.pem"
    if not signing.exists():
        key = Ed25519PrivateKey.generate()
        _write_private(signing, key.private_bytes(serialization.Encoding.PEM,
                                                  serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
        verify.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    plain_path, tokens_path = auth_dir / "dev-tokens.json", auth_dir / "tokens.json"
    plain: dict[str, dict[str, Any]] = (json.loads(plain_path.read_text())
                                        if plain_path.exists() else {})
    for subject, roles in DEV_USERS.items():
        if subject not in plain:
            plain[subject] = {"token": f"wl_dev_{subject}_{secrets.token_urlsafe(18)}",
                              "roles": list(roles)}
    _write_private(plain_path, json.dumps(plain, indent=2).encode())
    users = [{"subject": s, "roles": u["roles"], "token_sha256": token_digest(u["token"])}
             for s, u in plain.items()]
    tokens_path.write_text(json.dumps({"users": users}, indent=2))
    return plain


def dev_token(settings: Settings, subject: str) -> str:
    """A dev user's plain token (tests, the demo's approving bot)."""
    plain = json.loads((settings.state_dir / "auth" / "dev-tokens.json").read_text())
    return str(plain[subject]["token"])
