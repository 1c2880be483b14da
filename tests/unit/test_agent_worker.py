"""The agent worker refuses to start on a namespace without warmloop's search
attributes (every job would hang at its first upsert), naming the command that
registers them."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    ListSearchAttributesRequest,
    ListSearchAttributesResponse,
)
from temporalio.service import RPCError, RPCStatusCode

from warmloop.workers import agent_worker
from warmloop.workflows.agent_job import SEARCH_ATTRIBUTES

KEYWORD = IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
KEYWORD_LIST = IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD_LIST
ALL = {"WarmloopProfile": KEYWORD, "WarmloopState": KEYWORD,
       "WarmloopPendingApprovals": KEYWORD_LIST, "WarmloopTenant": KEYWORD}


class FakeOperator:
    def __init__(self, have: dict[str, Any] | None, error: RPCError | None = None) -> None:
        self.have, self.error = have, error
        self.asked: list[str] = []

    async def list_search_attributes(self, req: ListSearchAttributesRequest
                                     ) -> ListSearchAttributesResponse:
        self.asked.append(req.namespace)
        if self.error is not None:
            raise self.error
        return ListSearchAttributesResponse(custom_attributes=self.have or {})


class FakeClient:
    namespace = "agents"

    def __init__(self, operator: FakeOperator) -> None:
        self.operator_service = operator


def test_the_fakes_cover_every_attribute_the_workflow_uses() -> None:
    assert set(ALL) == set(SEARCH_ATTRIBUTES)


def test_the_agent_worker_refuses_to_start_without_its_search_attributes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    operator = FakeOperator({"WarmloopProfile": KEYWORD})

    async def connect(*args: Any, **kwargs: Any) -> FakeClient:
        return FakeClient(operator)

    def no_worker(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the worker was started")

    monkeypatch.setattr(agent_worker, "connect", connect)
    monkeypatch.setattr(agent_worker, "Worker", no_worker)
    monkeypatch.setattr(agent_worker, "configure_logging", lambda *a, **k: None)
    with pytest.raises(SystemExit) as exit_:
        agent_worker.main()
    message = str(exit_.value.code)
    assert "\n" not in message  # one line
    assert operator.asked == ["agents"]
    assert "WarmloopState" in message and "WarmloopPendingApprovals" in message
    assert "WarmloopProfile" not in message.split("create")[0]  # present: not named missing
    assert "warmloop dev up" in message
    assert ("temporal operator search-attribute create --namespace agents "
            "--name WarmloopState --type Keyword "
            "--name WarmloopPendingApprovals --type KeywordList") in message


async def test_a_namespace_with_every_attribute_passes() -> None:
    await agent_worker.check_search_attributes(FakeClient(FakeOperator(dict(ALL))))


async def test_an_attribute_of_the_wrong_type_is_refused_too() -> None:
    have = {**ALL, "WarmloopPendingApprovals": KEYWORD}
    with pytest.raises(agent_worker.MissingSearchAttributesError) as err:
        await agent_worker.check_search_attributes(FakeClient(FakeOperator(have)))
    assert "WarmloopPendingApprovals" in str(err.value) and "KeywordList" in str(err.value)


async def test_a_server_that_cannot_list_them_is_not_refused() -> None:
    # Temporal's time-skipping test server does not implement the operator service
    unimplemented = RPCError("not implemented", RPCStatusCode.UNIMPLEMENTED, b"")
    await agent_worker.check_search_attributes(FakeClient(FakeOperator(None, unimplemented)))
