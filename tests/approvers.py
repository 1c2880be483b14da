"""Signed decisions for tests: a key pair made per test, its public half installed as
the worker's verify key (the same module global the agent worker sets at start)."""

from __future__ import annotations

from datetime import datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from warmloop.workers.identity import AssertionSigner, Identity, install_verify_keys
from warmloop.workflows.contracts import Decision


class Approvers:
    """People by role, and decisions signed for them."""

    def __init__(self, *, ttl_s: float = 120.0) -> None:
        self.key = Ed25519PrivateKey.generate()
        self.signer = AssertionSigner(self.key, ttl_s=ttl_s)
        install_verify_keys([self.key.public_key()])
        self.now: datetime | None = None
        """Sign as of this time (a time-skipping server's clock runs ahead of the wall
        clock); None: the wall clock."""

    def decision(self, subject: str, roles: tuple[str, ...], *, job_id: str, approval_id: str,
                 approve: bool = True, comment: str = "", now: datetime | None = None
                 ) -> Decision:
        who = Identity(subject=subject, roles=frozenset(roles))
        assertion = self.signer.sign_decision(who, job_id=job_id, approval_id=approval_id,
                                              approve=approve, comment=comment,
                                              now=now or self.now)
        return Decision(approval_id=approval_id, approve=approve, assertion=assertion,
                        comment=comment)
