"""Tenants: whose job it is, and what keeps tenants apart.

Pure policy (the workflow sandbox imports it): names, the namespacing of job ids,
Redis and S3 keys, the engines' ``cache_salt``, and the per-tenant quota checks.

- **Job ids.** A job of tenant ``acme`` is the workflow ``acme/<job id>``; a job of
  the default tenant keeps its bare id, as every job had before tenants. ``/`` is
  refused in a bare id (``contracts.id_problem``), so the two never collide, and
  everything keyed by the job id (the prefix directory's job chain, holds, in-flight
  steps, effect records) is per tenant by construction.
- **Engine caches.** Each non-default tenant's requests carry vLLM's ``cache_salt``
  (``cache_salt``), which vLLM mixes into the hash of a prompt's first block: one
  tenant's cached prefix never serves another's, and a tenant's ``cached_tokens``
  says nothing about another tenant's prompts. The default tenant sends no salt.
- **Keys.** Per-prefix Redis names (a profile's stable prefix, the profile of a step
  in flight) are ``scoped``; S3 objects of a tenant's jobs live under
  ``tenants/<tenant>/``.
- **Quota** (``TenantQuota``): jobs in flight, checked at submit and before each job of
  a tenant's batch starts; tokens per hour (prompt plus completion, as
  ``max_total_tokens`` counts them) in fixed clock-hour windows, checked at submit,
  before each batch job starts and before each step goes to an engine.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from warmloop.workflows.contracts import id_problem

DEFAULT_TENANT = "default"
"""The tenant of every job submitted without one: no salt, no key prefixes."""
MAX_TENANT_LEN = 63
TENANT_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
_TENANT = re.compile(TENANT_PATTERN)
TenantName = Annotated[str, StringConstraints(pattern=TENANT_PATTERN)]
TENANT_SEPARATOR = "/"
"""Between a tenant and its job id in a workflow id (never in a bare id)."""

TENANT_QUOTA_EXCEEDED = "TenantQuotaExceeded"
"""ApplicationError type of route_step (non-retryable): the tenant has spent its tokens
for this hour. Its first detail is ``{"retry_after_s": <seconds to the window's end>}``:
the workflow waits that long on a timer, or ends QUOTA_EXHAUSTED past its wall cap."""

TENANT_SLOT_WAIT = "TenantSlotWait"
"""ApplicationError type of claim_job_slot (retryable, with ``next_retry_delay``): the
tenant's jobs in flight are at its ``max_jobs_in_flight``, or its hour's tokens are
spent; the batch's next job waits (detail ``{"retry_after_s": ...}``)."""

HOUR_S = 3600
"""Length of a token-quota window: fixed clock hours (UTC)."""
WINDOW_MARGIN_S = 1.0
"""A job waiting out a spent window wakes this long after it ends (clocks differ a
little between the host that answered and the next one asked)."""

_SALT_CONTEXT = b"warmloop cache_salt v1\0"


def tenant_problem(value: str) -> str | None:
    """Why ``value`` cannot name a tenant, in one line; None when it can.

    A tenant becomes a prefix of workflow ids, Redis keys and S3 keys, a search
    attribute value and a metric label: lowercase letters, digits, ``_`` and ``-``,
    starting with a letter or digit, up to MAX_TENANT_LEN characters."""
    if not value:
        return "tenant is empty"
    if len(value) > MAX_TENANT_LEN:
        return f"tenant is {len(value)} characters long; at most {MAX_TENANT_LEN}"
    if not _TENANT.match(value):
        return (f"tenant {value[:60]!r} may hold only lowercase letters, digits, _ and - "
                "(starting with a letter or digit)")
    return None


def job_workflow_id(tenant: str, job_id: str) -> str:
    """The workflow id of job ``job_id`` of ``tenant``: the bare id for the default
    tenant (as before tenants), ``<tenant>/<job id>`` for any other."""
    return job_id if tenant == DEFAULT_TENANT else f"{tenant}{TENANT_SEPARATOR}{job_id}"


def split_job_id(workflow_id: str) -> tuple[str, str]:
    """(tenant, bare job id) of a job's workflow id."""
    tenant, sep, job_id = workflow_id.partition(TENANT_SEPARATOR)
    return (tenant, job_id) if sep else (DEFAULT_TENANT, workflow_id)


def tenant_of(workflow_id: str) -> str:
    return split_job_id(workflow_id)[0]


def namespaced_id_problem(workflow_id: str) -> str | None:
    """Why ``workflow_id`` (``<tenant>/<job id>``) cannot name a tenant's job; None
    when it can. A bare id is checked by ``contracts.id_problem``."""
    tenant, job_id = split_job_id(workflow_id)
    if tenant == DEFAULT_TENANT:
        return (f"job id {workflow_id[:60]!r}: the default tenant's job ids carry no "
                "tenant prefix")
    return tenant_problem(tenant) or id_problem("job", job_id)


def scoped(tenant: str, name: str) -> str:
    """A per-prefix name (a profile, a prefix family) as the tenant's own: Redis keys
    and in-flight markers built from it never match another tenant's."""
    return name if tenant == DEFAULT_TENANT else f"{tenant}{TENANT_SEPARATOR}{name}"


def s3_prefix(tenant: str) -> str:
    """Where the tenant's objects live in the bucket ("" for the default tenant)."""
    return "" if tenant == DEFAULT_TENANT else f"tenants/{tenant}/"


def cache_salt(tenant: str) -> str | None:
    """The ``cache_salt`` every engine request of the tenant's jobs carries (None for
    the default tenant: its requests stay as they were).

    A digest of the tenant's name, not the name: it is fixed length, within vLLM's
    limits (at most 128 characters, none of ``@ / \\``), and names no tenant in the
    engines' logs and KV events. It is not secret, and need not be: the salt never
    leaves warmloop's side (the inference worker computes it from the request's tenant;
    it is in no history, result or log), only warmloop's workers send the engines
    requests, and a job's tenant is fixed by its id. A keyed digest (HMAC with a
    server secret) would add something only against a party that can send the engines
    requests of its own, which no tenant can: the engines are warmloop's, not theirs."""
    if tenant == DEFAULT_TENANT:
        return None
    return hashlib.sha256(_SALT_CONTEXT + tenant.encode()).hexdigest()


class JobSlotRequest(BaseModel):
    """Input of ``claim_job_slot``: a batch's job asks its tenant's quota to start."""

    tenant: TenantName
    workflow_id: str = Field(min_length=1)
    """The job's workflow id: the slot is recorded as its until visibility shows it."""


class JobSlotGranted(BaseModel):
    """``claim_job_slot``'s answer: the job may start now."""

    in_flight: int | None = None
    """The tenant's jobs counted in flight before this one; None: the tenant has no
    ``max_jobs_in_flight`` here (or Redis and visibility were not both asked)."""


class TenantQuota(BaseModel):
    """One tenant's limits (``WARMLOOP_TENANTS``); None: no limit of that kind."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_jobs_in_flight: int | None = Field(default=None, ge=1)
    """Running jobs at once; a submit past it is refused, and a tenant's batch waits to
    start its next job (counted by the WarmloopTenant search attribute: visibility lags
    a little, so two submits racing for the last slot may both pass unless the submit
    has Redis: ``TenantUsage.claim_start``)."""
    tokens_per_hour: int | None = Field(default=None, ge=1)
    """Prompt plus completion tokens of the tenant's steps per clock hour. A submit in a
    spent hour is refused, a tenant's batch starts no job until the next hour, and a
    running job's next step waits for it (a durable timer), or the job ends
    QUOTA_EXHAUSTED when that is past its wall cap."""

    @property
    def counts_in_redis(self) -> bool:
        """Whether a submit checks it against Redis (tokens this hour, recent starts)."""
        return self.tokens_per_hour is not None or self.max_jobs_in_flight is not None


def hour_window(now: float) -> int:
    """The quota window (hours since the epoch) that ``now`` (epoch seconds) falls in."""
    return int(now // HOUR_S)


def window_resets_in(now: float) -> float:
    """Seconds from ``now`` to the end of its window."""
    return (hour_window(now) + 1) * HOUR_S - now


def over_tokens(tenant: str, quota: TenantQuota | None, used: int, now: float
                ) -> tuple[str, float] | None:
    """When the tenant's tokens this hour are spent: why, and the seconds until its
    window resets (rounded up, with a margin); None while it may go on."""
    if quota is None or quota.tokens_per_hour is None or used < quota.tokens_per_hour:
        return None
    wait = math.ceil(window_resets_in(now) + WINDOW_MARGIN_S)
    return (f"tenant {tenant} has used {used:,} of its {quota.tokens_per_hour:,} tokens "
            f"per hour (tokens_per_hour quota); the window resets in {wait} s", float(wait))


def over_jobs(tenant: str, quota: TenantQuota | None, running: int) -> str | None:
    """Why a new job of the tenant is refused for its jobs in flight; None if it is not."""
    if quota is None or quota.max_jobs_in_flight is None or running < quota.max_jobs_in_flight:
        return None
    return (f"tenant {tenant} has {running} jobs running, its max_jobs_in_flight quota is "
            f"{quota.max_jobs_in_flight}; submit when one has ended")


def tenant_id_problem(tenant: str, workflow_id: str, *, what: str = "job") -> str | None:
    """Why a job (or ``what``: a batch) of ``tenant`` cannot run as workflow
    ``workflow_id`` (not a tenant, or not its namespace: ``<tenant>/<id>``, a bare id
    for the default tenant); None when it can. The id itself is checked first
    (``id_problem``, ``namespaced_id_problem``)."""
    problem = tenant_problem(tenant)
    if problem is not None:
        return problem
    if tenant_of(workflow_id) != tenant:
        return (f"{what} {workflow_id[:80]!r} is not in tenant {tenant}'s namespace: its id "
                f"must be {job_workflow_id(tenant, f'<{what} id>')}")
    return None


def retry_after_s(details: object, default: float = 60.0) -> float:
    """The wait a ``TENANT_QUOTA_EXCEEDED`` refusal asks for (its first detail)."""
    first = details[0] if isinstance(details, (list, tuple)) and details else None
    wait = first.get("retry_after_s") if isinstance(first, dict) else None
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 < wait <= 2 * HOUR_S:
        return float(wait)
    return default
