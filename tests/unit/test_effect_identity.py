"""Side effects keyed by what they change, not by the step that asked (issue 14).

A tool declares the business identity of its effect (``ToolSpec.effect_key``) and the
arguments that must name the job's own record (``ToolSpec.task_args``): an invoice is
paid once however many steps ask, another invoice than the task's is never paid, and
without Redis nothing is applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field
from temporalio.exceptions import ApplicationError

from tests.ledger_redis import LedgerRedis
from warmloop.activities.tools import EffectLedger, ToolActivities
from warmloop.activities.tools.invoice_reconciliation import InvoiceReconciliationTools
from warmloop.activities.tools.ticket_triage import TicketTriageTools
from warmloop.workflows.contracts import ToolRequest, ToolResult
from warmloop.workflows.profiles import REGISTRY, HttpRunner, Profile, ToolSpec
from warmloop.workflows.profiles.document import ProfileDocumentError, profile_from_document
from warmloop.workflows.profiles.function_tools import FunctionTool, ToolContext, tool

CALLS: list[tuple[str, str]] = []


def _order_note(order_id: Annotated[str, Field(pattern=r"^O[0-9]{4}$")],
                note: Literal["called", "apologised"], ctx: ToolContext) -> str:
    """Add a note to an order."""
    CALLS.append((order_id, ctx.idempotency_key))
    return f"noted on {order_id}: {note}"


class OrderTask(BaseModel):
    order_id: str


class OrderArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    order_id: str = Field(pattern=r"^O[0-9]{4}$")


def _function_tool() -> FunctionTool:
    # built here, not at import: before identities existed, the decorator refused the
    # keyword, and every test of the module would have failed to collect
    ft: FunctionTool = tool(side_effect=True, effect_key=("order_id",),
                            task_args=("order_id",))(_order_note)
    return ft


SEEN: list[httpx.Request] = []


def _service(request: httpx.Request) -> httpx.Response:
    SEEN.append(request)
    return httpx.Response(200, text=f"refunded {json.loads(request.content)['order_id']}")


@contextlib.contextmanager
def _order_profile(name: str, note: FunctionTool, **scope: Any) -> Iterator[None]:
    """An order profile registered for the test: the function tool ``note``, an HTTP
    refund once per order (``scope``: its ``effect_scope``), and a finish."""
    refund = ToolSpec("refund", "Refund an order.", OrderArgs, side_effect=True,
                      effect_key=("order_id",), task_args=("order_id",),
                      runner=HttpRunner(url="http://refunds.test/refund"), **scope)
    profile = Profile(name=name, system_prompt="s", task_model=OrderTask,
                      task_id_field="order_id",
                      tools=(note.spec, refund, ToolSpec("done", "d", OrderArgs,
                                                         finishes_job=True)))
    REGISTRY.add(profile, source="test")
    CALLS.clear()
    SEEN.clear()
    try:
        yield
    finally:
        REGISTRY.remove(profile.name)


@pytest.fixture
def function_profile() -> Iterator[FunctionTool]:
    ft = _function_tool()
    with _order_profile("effect-identity-test", ft):
        yield ft


@pytest.fixture
def fake_redis() -> LedgerRedis:
    return LedgerRedis()


@pytest.fixture
def acts(fake_redis: LedgerRedis) -> ToolActivities:
    def resolve(path: str) -> FunctionTool:
        return _function_tool()

    http = httpx.AsyncClient(transport=httpx.MockTransport(_service))
    return ToolActivities([TicketTriageTools.bundled(), InvoiceReconciliationTools.bundled()],
                          EffectLedger(fake_redis),  # type: ignore[arg-type]
                          s3=None, bucket="b", http=http, resolve_function=resolve)


def _pay(step: int, invoice_id: str = "INV1002", amount: float = 8574.0,
         task_id: str = "INV1002", job_id: str = "job-1") -> ToolRequest:
    return ToolRequest(job_id=job_id, step=step, profile="invoice-reconciliation",
                       task_id=task_id, name="approve_payment",
                       arguments={"invoice_id": invoice_id, "amount": amount})


def _flag(step: int, reason: str, invoice_id: str = "INV1018",
          task_id: str = "INV1018") -> ToolRequest:
    return ToolRequest(job_id="job-1", step=step, profile="invoice-reconciliation",
                       task_id=task_id, name="flag_discrepancy",
                       arguments={"invoice_id": invoice_id, "reason": reason})


def _ticket(step: int, name: str, **arguments: Any) -> ToolRequest:
    return ToolRequest(job_id="job-t", step=step, profile="ticket-triage", task_id="T1001",
                       name=name, arguments=arguments)


def _fn(step: int, order_id: str = "O1234", name: str = "_order_note",
        **more: Any) -> ToolRequest:
    return ToolRequest(job_id="job-f", step=step, profile="effect-identity-test",
                       task_id="O1234", name=name, arguments={"order_id": order_id, **more})


async def test_approve_payment_applies_once_per_invoice_whatever_the_step(
        acts: ToolActivities, fake_redis: LedgerRedis) -> None:
    first = await acts.run_tool(_pay(5))
    assert first.ok and first.output == "payment of 8574.00 EUR approved for invoice INV1002"
    again = await acts.run_tool(_pay(7))
    assert again.ok and "already applied at step 5" in again.output
    assert first.output in again.output and "\n" not in again.output
    ledger = EffectLedger(fake_redis)  # type: ignore[arg-type]
    effects = await ledger.effects("job-1")
    assert list(effects) == [5] and effects[5]["effect"] == {"invoice": "INV1002",
                                                             "paid": 8574.0}
    assert await ledger.counts("job-1") == {"applied": 1, "deduplicated": 1}


async def test_a_retried_step_returns_its_own_result_unchanged(
        acts: ToolActivities, fake_redis: LedgerRedis) -> None:
    results = [await acts.run_tool(_pay(5)) for _ in range(3)]  # the activity retried
    assert results[0] == results[1] == results[2]
    assert "already" not in results[0].output
    assert len(fake_redis.kv) == 1


async def test_paying_another_invoice_than_the_tasks_is_refused(
        acts: ToolActivities, fake_redis: LedgerRedis) -> None:
    res = await acts.run_tool(_pay(5, invoice_id="INV1002", task_id="INV1001"))
    assert not res.ok and "\n" not in res.output
    assert "INV1002" in res.output and "INV1001" in res.output
    assert fake_redis.kv == {} and fake_redis.hashes == {}  # nothing applied, nothing counted
    ok = await acts.run_tool(_pay(6, invoice_id="INV1001", amount=1109.0, task_id="INV1001"))
    assert ok.ok and "approved for invoice INV1001" in ok.output


async def test_flagging_another_invoice_is_refused(acts: ToolActivities,
                                                   fake_redis: LedgerRedis) -> None:
    res = await acts.run_tool(_flag(4, "price_mismatch", invoice_id="INV1011"))
    assert not res.ok and "INV1011" in res.output and "INV1018" in res.output
    assert fake_redis.kv == {}


async def test_each_discrepancy_kind_is_flagged_once(acts: ToolActivities,
                                                     fake_redis: LedgerRedis) -> None:
    price = await acts.run_tool(_flag(4, "price_mismatch"))
    qty = await acts.run_tool(_flag(5, "quantity_mismatch"))
    assert price.ok and qty.ok and "already" not in price.output + qty.output
    again = await acts.run_tool(_flag(6, "price_mismatch"))
    assert again.ok and "already applied at step 4" in again.output
    assert sorted(await EffectLedger(fake_redis).effects("job-1")) == [4, 5]  # type: ignore[arg-type]


async def test_a_ticket_gets_one_priority_and_one_reply(acts: ToolActivities,
                                                        fake_redis: LedgerRedis) -> None:
    high = await acts.run_tool(_ticket(2, "set_priority", priority="high"))
    assert high.ok and high.output == "priority set to high"
    low = await acts.run_tool(_ticket(4, "set_priority", priority="low"))
    assert "already applied at step 2" in low.output and "priority set to high" in low.output
    await acts.run_tool(_ticket(3, "draft_reply", kb_article="KB101", tone="formal"))
    reply = await acts.run_tool(_ticket(5, "draft_reply", kb_article="KB101", tone="friendly"))
    assert "already applied at step 3" in reply.output
    effects = await EffectLedger(fake_redis).effects("job-t")  # type: ignore[arg-type]
    assert sorted(effects) == [2, 3] and effects[2]["effect"]["priority"] == "high"


async def test_concurrent_first_applications_apply_once(acts: ToolActivities,
                                                        fake_redis: LedgerRedis) -> None:
    a, b = await asyncio.gather(acts.run_tool(_pay(5)), acts.run_tool(_pay(6)))
    assert sum("already applied" in r.output for r in (a, b)) == 1
    assert await EffectLedger(fake_redis).counts("job-1") == {  # type: ignore[arg-type]
        "applied": 1, "deduplicated": 1}


async def test_without_redis_a_side_effect_fails_retryably_and_applies_nothing(
        acts: ToolActivities, fake_redis: LedgerRedis) -> None:
    fake_redis.down = True
    with pytest.raises(ApplicationError) as e:
        await acts.run_tool(_pay(5))
    assert e.value.type == "EffectLedgerUnavailable" and not e.value.non_retryable
    # a tool without side effects needs no ledger
    read = await acts.run_tool(ToolRequest(job_id="job-1", step=4,
                                           profile="invoice-reconciliation", task_id="INV1002",
                                           name="fetch_invoice",
                                           arguments={"invoice_id": "INV1002"}))
    assert read.ok
    fake_redis.down = False  # Temporal's retry, once Redis is back: applies once
    res = await acts.run_tool(_pay(5))
    assert res.ok and "already" not in res.output
    assert await EffectLedger(fake_redis).counts("job-1") == {"applied": 1}  # type: ignore[arg-type]


async def test_without_redis_a_side_effect_function_is_not_called(
        acts: ToolActivities, fake_redis: LedgerRedis, function_profile: FunctionTool) -> None:
    fake_redis.down = True
    with pytest.raises(ApplicationError) as e:
        await acts.run_tool(_fn(3, note="called"))
    assert e.value.type == "EffectLedgerUnavailable" and not e.value.non_retryable
    assert CALLS == []


async def test_a_function_tool_opts_in_to_an_identity(
        acts: ToolActivities, function_profile: FunctionTool) -> None:
    assert function_profile.spec.effect_key == ("order_id",)
    first = await acts.run_tool(_fn(3, note="called"))
    again = await acts.run_tool(_fn(4, note="called"))
    assert first.ok and "already applied at step 3" in again.output
    assert len(CALLS) == 1
    key = CALLS[0][1]
    assert key.startswith("job-f:_order_note:") and ":3:" not in key  # the effect's, not the step's
    other = await acts.run_tool(_fn(5, order_id="O9999", note="called"))
    assert not other.ok and "O9999" in other.output and len(CALLS) == 1


async def test_an_http_tool_with_an_identity_sends_the_effects_idempotency_key(
        acts: ToolActivities, function_profile: FunctionTool) -> None:
    first = await acts.run_tool(_fn(3, name="refund"))
    again = await acts.run_tool(_fn(4, name="refund"))
    assert first == ToolResult(ok=True, output="refunded O1234")
    assert "already applied at step 3" in again.output and len(SEEN) == 1
    assert SEEN[0].headers["Idempotency-Key"].startswith("job-f:refund:")


def test_an_identity_names_arguments_of_a_side_effect_tool() -> None:
    with pytest.raises(ValueError, match="nope"):
        ToolSpec("pay", "Pay.", OrderArgs, side_effect=True, effect_key=("nope",))
    with pytest.raises(ValueError, match="side_effect"):
        ToolSpec("pay", "Pay.", OrderArgs, effect_key=("order_id",))
    with pytest.raises(ValueError, match="nope"):
        ToolSpec("pay", "Pay.", OrderArgs, side_effect=True, task_args=("nope",))
    spec = ToolSpec("pay", "Pay.", OrderArgs, side_effect=True, effect_key=())
    assert spec.effect_identity("O1", {"order_id": "O2"}) == \
        spec.effect_identity("O1", {"order_id": "O3"})  # once per task record
    assert ToolSpec("pay", "Pay.", OrderArgs, side_effect=True).effect_identity(
        "O1", {"order_id": "O2"}) is None  # the default: (job, step)


def _order_document(name: str, **refund: Any) -> dict[str, Any]:
    """A profile document of orders: an HTTP refund declared with ``refund``, a finish."""
    order_id = {"type": "string", "pattern": "^O[0-9]{4}$"}
    return {
        "name": name, "system_prompt": "s", "task_id_field": "order_id",
        "task_schema": {"type": "object", "properties": {"order_id": order_id},
                        "required": ["order_id"]},
        "tools": [
            {"name": "refund", "description": "Refund.", "side_effect": True, **refund,
             "http": {"url": "http://refunds.test/refund"},
             "arguments": {"type": "object", "properties": {"order_id": order_id},
                           "required": ["order_id"]}},
            {"name": "done", "description": "Done.", "finishes_job": True,
             "arguments": {"type": "object", "properties": {}}},
        ]}


def test_a_profile_document_declares_an_identity() -> None:
    doc = _order_document("doc-identity", effect_key=["order_id"], task_args=["order_id"])
    spec = profile_from_document(doc).tool("refund")
    assert spec.effect_key == ("order_id",) and spec.task_args == ("order_id",)
    doc["tools"][0]["effect_key"] = ["amount"]
    with pytest.raises(ProfileDocumentError, match="amount"):
        profile_from_document(doc)


# ---- once across the tenant's jobs (effect_scope="tenant"), over a real redis-server -----


def _tenant_note() -> FunctionTool:
    ft: FunctionTool = tool(side_effect=True, effect_key=("order_id",),
                            task_args=("order_id",), effect_scope="tenant",
                            name="tenant_note")(_order_note)
    return ft


@pytest.fixture
def tenant_profile() -> Iterator[None]:
    """An order profile whose function and HTTP tools change each order once, whichever
    of the tenant's jobs asks."""
    with _order_profile("effect-tenant-test", _tenant_note(), effect_scope="tenant"):
        yield


@pytest.fixture
def shared_acts(client: Any) -> ToolActivities:
    """The tool activities over a real redis-server (conftest's ``client``)."""
    def resolve(path: str) -> FunctionTool:
        return _tenant_note()

    http = httpx.AsyncClient(transport=httpx.MockTransport(_service))
    return ToolActivities([], EffectLedger(client), s3=None, bucket="b", http=http,
                          resolve_function=resolve)


def _order(job_id: str, step: int, name: str, **more: Any) -> ToolRequest:
    return ToolRequest(job_id=job_id, step=step, profile="effect-tenant-test", task_id="O1234",
                       name=name, arguments={"order_id": "O1234", **more})


async def test_a_tenant_scoped_effect_applies_once_across_the_tenants_jobs(
        shared_acts: ToolActivities, tenant_profile: None, client: Any) -> None:
    """Two jobs of tenant acme refund order O1234: the service is called once, with one
    idempotency key; the second job reads the first's answer, by which job and step.
    Another tenant's job on the same order is its own; a retry of the applying call
    reads its own answer unchanged."""
    first = await shared_acts.run_tool(_order("acme/j1", 3, "refund"))
    retry = await shared_acts.run_tool(_order("acme/j1", 3, "refund"))
    second = await shared_acts.run_tool(_order("acme/j2", 3, "refund"))  # same step number
    assert first == retry == ToolResult(ok=True, output="refunded O1234")
    assert second.ok and "already applied by job acme/j1 at step 3" in second.output
    assert "across the tenant's jobs" in second.output and "refunded O1234" in second.output
    assert len(SEEN) == 1
    assert SEEN[0].headers["Idempotency-Key"].startswith("acme/*:refund:")
    other = await shared_acts.run_tool(_order("globex/j1", 2, "refund"))
    assert other == ToolResult(ok=True, output="refunded O1234") and len(SEEN) == 2
    assert SEEN[1].headers["Idempotency-Key"].startswith("globex/*:refund:")
    # the function tool: called once for the tenant, the same key in both jobs
    await shared_acts.run_tool(_order("acme/j1", 4, "tenant_note", note="called"))
    again = await shared_acts.run_tool(_order("acme/j2", 5, "tenant_note", note="called"))
    assert "already applied by job acme/j1 at step 4" in again.output and len(CALLS) == 1
    assert CALLS[0][1].startswith("acme/*:tenant_note:")
    # each job's ledger view: what it applied (the tenant's records included)
    ledger = EffectLedger(client)
    assert sorted(await ledger.effects("acme/j1")) == [3, 4]
    assert await ledger.effects("acme/j2") == {}
    assert await ledger.counts("acme/j2") == {"deduplicated": 2}


async def test_jobs_racing_for_a_tenant_scoped_effect_apply_it_once(
        shared_acts: ToolActivities, tenant_profile: None) -> None:
    """Eight jobs ask at once: the ledger's SET NX lets one apply; the service may be
    called by several (each before the others wrote), all with the one key it dedupes
    by, and every job but one reads the winner's answer."""
    results = await asyncio.gather(*(shared_acts.run_tool(_order(f"acme/r{i}", 2, "refund"))
                                     for i in range(8)))
    assert all(r.ok and "refunded O1234" in r.output for r in results)
    assert sum("already applied" not in r.output for r in results) == 1
    assert {req.headers["Idempotency-Key"] for req in SEEN} == {
        SEEN[0].headers["Idempotency-Key"]}


def test_a_tenant_scope_needs_an_identity() -> None:
    with pytest.raises(ValueError, match="effect_key"):
        ToolSpec("pay", "Pay.", OrderArgs, side_effect=True, effect_scope="tenant")
    spec = ToolSpec("pay", "Pay.", OrderArgs, side_effect=True, effect_key=(),
                    effect_scope="tenant")
    assert spec.effect_owner("acme/j1") == "acme/*"
    assert spec.effect_owner("j1") == "default/*"
    assert ToolSpec("pay", "Pay.", OrderArgs, side_effect=True,
                    effect_key=()).effect_owner("acme/j1") == "acme/j1"
    doc = _order_document("doc-tenant", effect_key=["order_id"], effect_scope="tenant")
    assert profile_from_document(doc).tool("refund").effect_scope == "tenant"
    doc["tools"][0]["effect_scope"] = "world"
    with pytest.raises(ProfileDocumentError, match="effect_scope"):
        profile_from_document(doc)
