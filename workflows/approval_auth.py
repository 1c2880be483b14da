"""Signed decision assertions: what the ``decide`` Update's validator checks before a
human decision reaches a job's history.

The approvals service (web inbox, its API) verifies who a person is from their bearer
token, then signs a short-lived assertion binding that person to one decision: this
job, this approval, approve or reject, this comment. The agent worker holds only the
public key, so nobody who can merely reach Temporal can decide anything: a missing,
forged, expired, replayed or wrong-job assertion is refused by the validator, before
any history event, and ``decided_by`` is the verified subject.

Pure code (stdlib and pydantic): the signature itself is checked by a verifier the
worker installs (``warmloop.workers.identity``), since the crypto library is not
workflow-safe to import here.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ASSERTION_VERSION = "wl1"
CLOCK_SKEW = timedelta(seconds=30)
"""An assertion issued up to this far in the workflow's future is still accepted: the
service's clock and the workflow task's start time are different clocks."""


class AssertionRefused(ValueError):
    """A decision whose assertion does not hold; the message is safe to show the person."""


class DecisionClaims(BaseModel):
    """What the approvals service vouches for, signed as one JSON document."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sub: str = Field(min_length=1, max_length=200)
    """The verified subject (the person); becomes ``decided_by``."""
    roles: tuple[str, ...]
    """The person's roles when the assertion was issued."""
    job: str
    approval: str
    approve: bool
    comment_sha256: str
    """Binds the comment: a captured assertion cannot carry another text into the prompt."""
    iat: datetime
    exp: datetime
    jti: str = Field(min_length=8, max_length=64)
    """Unique per assertion: the job refuses one it has already seen."""
    tenants: tuple[str, ...] | None = None
    """The tenants whose jobs the person may decide; None: every tenant (an operator)."""


def comment_digest(comment: str) -> str:
    return hashlib.sha256(comment.encode()).hexdigest()


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_assertion(kid: str, claims: DecisionClaims, signature: bytes) -> str:
    return ".".join([ASSERTION_VERSION, kid, b64url(signing_input(claims)), b64url(signature)])


def signing_input(claims: DecisionClaims) -> bytes:
    """The exact bytes signed: canonical JSON of the claims."""
    return json.dumps(claims.model_dump(mode="json"), sort_keys=True,
                      separators=(",", ":")).encode()


class ParsedAssertion(BaseModel):
    """An assertion split into its parts; ``signed`` is what the signature covers."""

    kid: str
    claims: DecisionClaims
    signed: bytes
    signature: bytes


def parse_assertion(token: str) -> ParsedAssertion:
    """Split an assertion; refuses anything malformed (the signature is not checked here)."""
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != ASSERTION_VERSION:
        raise AssertionRefused("the decision carries no valid signed assertion "
                               "(decide through the approvals service: inbox or CLI)")
    try:
        signed, signature = unb64url(parts[2]), unb64url(parts[3])
        claims = DecisionClaims.model_validate_json(signed)
    except (ValueError, ValidationError):
        raise AssertionRefused("the decision's assertion is malformed") from None
    return ParsedAssertion(kid=parts[1], claims=claims, signed=signed, signature=signature)


def check_claims(claims: DecisionClaims, *, job_id: str, approval_id: str, approve: bool,
                 comment: str, now: datetime) -> None:
    """The assertion is for this very decision and still valid."""
    if claims.job != job_id or claims.approval != approval_id:
        raise AssertionRefused(f"the assertion is for approval {claims.approval} of job "
                               f"{claims.job}, not {approval_id} of {job_id}")
    if claims.approve != approve:
        raise AssertionRefused("the assertion was signed for the opposite decision")
    if claims.comment_sha256 != comment_digest(comment):
        raise AssertionRefused("the comment differs from the one the assertion was signed for")
    if claims.exp <= now:
        raise AssertionRefused(f"the assertion expired at {claims.exp.isoformat()}; "
                               "decide again")
    if claims.iat > now + CLOCK_SKEW:
        raise AssertionRefused("the assertion was issued in the future (clock skew?)")


def check_rules(claims: DecisionClaims, *, kind: str, allowed_roles: Iterable[str],
                submitted_by: str | None, already_approved_by: Iterable[str],
                submitter_may_approve: bool, tenant: str = "default") -> None:
    """The approval kind's rules: the job's tenant is the person's, a role allowed for
    the kind, not the job's own submitter, and not the same person twice under a
    two-person rule."""
    if claims.tenants is not None and tenant not in claims.tenants:
        raise AssertionRefused(f"{claims.sub} may not decide approvals of tenant {tenant}")
    allowed = list(allowed_roles)
    if not set(claims.roles) & set(allowed):
        raise AssertionRefused(f"{claims.sub} (roles: {', '.join(claims.roles) or 'none'}) "
                               f"may not decide {kind} approvals (allowed: {', '.join(allowed)})")
    if not submitter_may_approve and submitted_by is not None and claims.sub == submitted_by:
        raise AssertionRefused(f"{claims.sub} submitted this job and may not decide its "
                               f"{kind} approval")
    if claims.sub in set(already_approved_by):
        raise AssertionRefused(f"{claims.sub} already approved this; a second, different "
                               "approver is needed")
