"""The agents warmloop ships, registered through the same plugin seam as a user's
(the ``warmloop.profiles`` entry point ``bundled`` in pyproject.toml)."""

from warmloop.workflows.profiles.invoice_reconciliation import INVOICE_RECONCILIATION
from warmloop.workflows.profiles.ticket_triage import TICKET_TRIAGE

PROFILES = (TICKET_TRIAGE, INVOICE_RECONCILIATION)
