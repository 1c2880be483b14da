"""Acme's support agents, built on warmloop's public API only."""
