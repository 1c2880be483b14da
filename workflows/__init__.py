"""Workflows, data contracts and the pure, deterministic policies they run.

Only stdlib, pydantic and temporalio may be imported here: this package is loaded
inside Temporal's workflow sandbox.
"""
