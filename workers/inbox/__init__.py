"""The web approval inbox (``warmloop ui``) and the approvals API the CLI calls."""

from warmloop.workers.inbox.app import create_app, serve

__all__ = ["create_app", "serve"]
