"""The inbox's browser session: one sealed cookie, and the CSRF token inside it.

The cookie is sealed with AES-GCM (integrity and secrecy): it carries the person's
bearer token, which the inbox verifies again on every request, so a token revoked
or expired at its issuer ends the session at the next click, not at the cookie's
expiry. Nothing here is kept server-side: any replica holding the same key can read
the cookie, and a key made at start (the default) signs everyone out on a restart.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

COOKIE_NAME = "warmloop_inbox"
SIGNED_IN_TTL_S = 8 * 3600
"""A signed-in session lasts a working day at most, whatever the token's own expiry."""
ANONYMOUS_TTL_S = 3600
"""A signed-out session (only its CSRF token, for the sign-in form) lasts an hour."""
_AAD = b"warmloop-inbox-session-v1"
_LOGIN_AAD = b"warmloop-inbox-login-v1"
_NONCE_BYTES = 12


@dataclass(frozen=True)
class Session:
    """What the cookie holds. ``token`` is None until the person signs in."""

    csrf: str
    expires: float
    token: str | None = None
    flash: str | None = None
    """A one-line notice shown once on the next page (after a decision's redirect)."""
    source: str = "token"
    """Where ``token`` came from: "token", pasted (a bearer token for the API's
    verifier), or "oidc", the ID token of the identity provider's sign-in (verified as
    this client's)."""

    @classmethod
    def anonymous(cls, now: float | None = None) -> Session:
        return cls(csrf=secrets.token_urlsafe(32),
                   expires=(now or time.time()) + ANONYMOUS_TTL_S)

    @classmethod
    def signed_in(cls, token: str, now: float | None = None, *,
                  source: str = "token") -> Session:
        """A fresh CSRF token at sign-in: one planted before it (session fixation)
        is worth nothing after it."""
        return cls(csrf=secrets.token_urlsafe(32), token=token, source=source,
                   expires=(now or time.time()) + SIGNED_IN_TTL_S)

    def with_flash(self, flash: str | None) -> Session:
        return replace(self, flash=flash)

    def csrf_ok(self, presented: str | None) -> bool:
        """Constant-time comparison with the form's hidden field."""
        return bool(presented) and hmac.compare_digest(self.csrf, str(presented))


LOGIN_COOKIE_NAME = "warmloop_inbox_login"
LOGIN_TTL_S = 600
"""A sign-in at the identity provider must come back within ten minutes."""


@dataclass(frozen=True)
class LoginState:
    """A sign-in at the identity provider under way, kept in its own cookie until the
    provider sends the person back: the ``state`` the callback must echo (it binds the
    answer to this browser), the ID token's expected ``nonce``, PKCE's code verifier,
    and where to go afterwards. Its cookie is SameSite=Lax: the session's, Strict, is
    not sent on the provider's redirect back."""

    state: str
    nonce: str
    code_verifier: str
    next: str
    expires: float

    @classmethod
    def new(cls, next_url: str, now: float | None = None) -> LoginState:
        return cls(state=secrets.token_urlsafe(32), nonce=secrets.token_urlsafe(32),
                   code_verifier=secrets.token_urlsafe(64), next=next_url,
                   expires=(now or time.time()) + LOGIN_TTL_S)


_Sealed = TypeVar("_Sealed", Session, LoginState)


class SessionSealer:
    """Seals a Session into a cookie value and opens it again.

    ``key``: 32 bytes; None makes a random one (sessions then end when the process
    does). A cookie that was tampered with, sealed under another key or has expired
    opens as None: the person is simply signed out."""

    def __init__(self, key: bytes | None = None) -> None:
        self._aead = AESGCM(key if key is not None else AESGCM.generate_key(bit_length=256))

    def seal(self, session: Session) -> str:
        return self._seal(asdict(session), _AAD)

    def open(self, value: str | None, now: float | None = None) -> Session | None:
        return self._open_as(Session, value, _AAD, now)

    def seal_login(self, login: LoginState) -> str:
        return self._seal(asdict(login), _LOGIN_AAD)

    def open_login(self, value: str | None, now: float | None = None) -> LoginState | None:
        """The sign-in under way, or None (none, tampered, another key, expired). A
        session cookie never opens as one, nor one as a session (another AAD)."""
        return self._open_as(LoginState, value, _LOGIN_AAD, now)

    def _open_as(self, kind: type[_Sealed], value: str | None, aad: bytes,
                 now: float | None) -> _Sealed | None:
        data = self._open(value, aad)
        if data is None:
            return None
        try:
            opened = kind(**data)
        except TypeError:  # another version's fields
            return None
        return opened if opened.expires > (now or time.time()) else None

    def _seal(self, data: dict[str, Any], aad: bytes) -> str:
        nonce = os.urandom(_NONCE_BYTES)
        raw = json.dumps(data, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(nonce + self._aead.encrypt(nonce, raw, aad)).decode()

    def _open(self, value: str | None, aad: bytes) -> dict[str, Any] | None:
        if not value:
            return None
        try:
            raw = base64.urlsafe_b64decode(value.encode())
            data = json.loads(self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], aad))
        except (InvalidTag, ValueError, TypeError, binascii.Error):
            return None
        return data if isinstance(data, dict) else None
