"""The bundled agents' toolsets (the ``warmloop.toolsets`` entry point ``bundled``)."""

from warmloop.activities.tools.base import Toolset
from warmloop.activities.tools.invoice_reconciliation import InvoiceReconciliationTools
from warmloop.activities.tools.ticket_triage import TicketTriageTools


def toolsets() -> list[Toolset]:
    return [TicketTriageTools.bundled(), InvoiceReconciliationTools.bundled()]
