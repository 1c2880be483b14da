"""The suite's own ordering: a test that leaves a part of the stack dead runs after
every test that might need that part (tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import LEAVES_STACK_BROKEN, pytest_collection_modifyitems


class _Item:
    def __init__(self, name: str, broken: bool) -> None:
        self.name, self._broken = name, broken

    def get_closest_marker(self, name: str) -> Any:
        return object() if name == LEAVES_STACK_BROKEN and self._broken else None


def test_tests_that_leave_the_stack_broken_run_last_in_their_own_order() -> None:
    items: list[Any] = [_Item("a", False), _Item("kill1", True), _Item("b", False),
                        _Item("kill2", True), _Item("c", False)]
    pytest_collection_modifyitems(pytest.Config.__new__(pytest.Config), items)
    assert [i.name for i in items] == ["a", "b", "c", "kill1", "kill2"]


def test_the_gateway_kill_test_carries_the_marker() -> None:
    from tests.integration import test_gateway

    test = test_gateway.test_an_engine_killed_mid_stream_gives_a_clean_error_and_the_session_moves
    assert any(m.name == LEAVES_STACK_BROKEN for m in getattr(test, "pytestmark", []))
