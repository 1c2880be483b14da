import json

import pytest

from warmloop.workflows.profiles import REGISTRY, UnknownProfileError, get_profile
from warmloop.workflows.profiles.base import ToolCallError

TRIAGE = get_profile("ticket-triage")


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(UnknownProfileError, match="ticket-triage"):
        get_profile("nope")


@pytest.mark.parametrize("profile", [REGISTRY.get(n) for n in REGISTRY.names()],
                         ids=REGISTRY.names())
def test_tool_schemas_are_strict_bounded_and_canonical(profile) -> None:  # type: ignore[no-untyped-def]
    schemas = profile.tool_schemas()
    names = [s["function"]["name"] for s in schemas]
    assert names == sorted(names)
    for s in schemas:
        fn = s["function"]
        assert fn["strict"] is True
        params = fn["parameters"]
        assert params["additionalProperties"] is False
        assert set(params["required"]) == set(params["properties"])
        for prop in params["properties"].values():
            if prop["type"] == "string":
                # unbounded strings make a weak model ramble to max_tokens
                assert "enum" in prop or "pattern" in prop, (fn["name"], prop)
    # byte-identical across calls: the stable prefix must not drift
    assert json.dumps(schemas) == json.dumps(profile.tool_schemas())


def test_validate_call_accepts_a_good_call() -> None:
    spec, args = TRIAGE.validate_call("search_kb", '{"topic": "login"}')
    assert spec.name == "search_kb" and args == {"topic": "login"}


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("delete_everything", "{}", "unknown tool 'delete_everything'"),
        ("search_kb", '{"topic": "log', "not valid JSON"),
        ("search_kb", '{"topic": "weather"}', "invalid arguments for search_kb: topic"),
        ("lookup_customer", '{"customer_id": "C1"}', "customer_id"),
        ("set_priority", '{"priority": "low", "extra": 1}', "extra"),
    ],
)
def test_validate_call_rejects_with_a_clear_reason(name: str, raw: str, message: str) -> None:
    with pytest.raises(ToolCallError, match=message):
        TRIAGE.validate_call(name, raw)


def test_task_is_validated() -> None:
    TRIAGE.validate_task({"ticket_id": "T1001", "customer_id": "C100", "subject": "s",
                          "body": "b"})
    with pytest.raises(ValueError):
        TRIAGE.validate_task({"ticket_id": "oops", "customer_id": "C100", "subject": "s",
                              "body": "b"})
