"""Agent profiles: a stable system prompt, a task schema and a set of strict tools."""

from warmloop.workflows.profiles.base import Profile, ToolSpec, UnknownProfileError
from warmloop.workflows.profiles.invoice_reconciliation import INVOICE_RECONCILIATION
from warmloop.workflows.profiles.synthetic import SYNTHETIC_PROFILES
from warmloop.workflows.profiles.ticket_triage import TICKET_TRIAGE

PROFILES: dict[str, Profile] = {
    p.name: p for p in (TICKET_TRIAGE, INVOICE_RECONCILIATION, *SYNTHETIC_PROFILES)
}


def get_profile(name: str) -> Profile:
    """The registered profile called ``name``; raises ``UnknownProfileError`` otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise UnknownProfileError(f"unknown profile {name!r} (known: {known})") from None


__all__ = ["PROFILES", "Profile", "ToolSpec", "UnknownProfileError", "get_profile"]
