"""The plugin seam: entry points, WARMLOOP_PLUGINS modules and YAML files load into
one registry the same way in every process; a broken plugin is one line, never skipped."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import Field
from typer.testing import CliRunner

from warmloop import ToolContext, tool
from warmloop.workers import plugins as plugins_module
from warmloop.workers.cli import app
from warmloop.workers.plugins import (
    PluginError,
    check_tools_implemented,
    load_plugins,
    load_profile_file,
)
from warmloop.workflows.profiles import REGISTRY, ActivityRunner, HttpRunner, PythonRunner
from warmloop.workflows.profiles.registry import ProfileRegistry

runner = CliRunner()

GOOD_YAML = """\
name: yaml-orders
system_prompt: |
  You answer questions about orders. One tool call per reply.
task_schema:
  type: object
  properties:
    order_id: {type: string, pattern: "^O[0-9]{4}$"}
    question: {type: string, maxLength: 500}
  required: [order_id, question]
task_id_field: order_id
tools:
  - name: lookup_order
    description: Look an order up by id.
    arguments:
      type: object
      properties:
        order_id: {type: string, pattern: "^O[0-9]{4}$"}
      required: [order_id]
    http: {url: "http://127.0.0.1:1/lookup", max_response_bytes: 4096}
    pause_median_s: 0.2
  - name: refund
    description: Refund an order.
    side_effect: true
    arguments:
      type: object
      properties:
        order_id: {type: string, pattern: "^O[0-9]{4}$"}
        amount: {type: number, minimum: 0, maximum: 1000}
      required: [order_id, amount]
    activity: {name: acme_refund, task_queue: acme-tools}
  - name: finish
    description: End the job with an answer.
    finishes_job: true
    arguments:
      type: object
      properties:
        answer: {type: string, enum: [shipped, refunded, unknown]}
      required: [answer]
approvals:
  - {kind: refund, tool: refund, approvers: [support-lead], deadline_s: 600, field: amount,
     op: gt, value: 100}
limits: {max_steps: 6}
model: tiny
"""


@pytest.fixture
def registry() -> ProfileRegistry:
    return ProfileRegistry()


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path for throwaway plugin modules."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("wl_test_")]:
        del sys.modules[name]


def _module(folder: Path, name: str, body: str) -> str:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))
    return name


def test_a_yaml_profile_loads_with_its_three_runners(tmp_path: Path) -> None:
    f = tmp_path / "acme.yaml"
    f.write_text(GOOD_YAML)
    p = load_profile_file(f)
    assert p.name == "yaml-orders" and p.model == "tiny" and p.limits.max_steps == 6
    runners = {t.name: t.runner for t in p.tools}
    assert runners["lookup_order"] == HttpRunner(url="http://127.0.0.1:1/lookup",
                                                 max_response_bytes=4096)
    assert runners["refund"] == ActivityRunner(activity="acme_refund", task_queue="acme-tools")
    assert runners["finish"] is None
    p.validate_task({"order_id": "O1234", "question": "where is it?"})
    with pytest.raises(ValueError, match="order_id"):
        p.validate_task({"order_id": "nope", "question": "?"})
    spec, args = p.validate_call("refund", '{"order_id": "O1234", "amount": 250}')
    assert spec.side_effect and args == {"order_id": "O1234", "amount": 250}
    assert p.approval_for("refund", args) is not None
    assert p.approval_for("refund", {**args, "amount": 5}) is None
    # strict, bounded, canonical: what guided decoding needs
    for s in p.tool_schemas():
        params = s["function"]["parameters"]
        assert params["additionalProperties"] is False
        assert set(params["required"]) == set(params["properties"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("pattern: \"^O[0-9]{4}$\"}\n      required: [order_id]\n    http",
          "maxLength: 9}\n      required: [order_id]\n    http"),
         "tools.0.arguments.properties.order_id: unbounded string"),
        (("name: yaml-orders", "name: Acme Orders!"), "name: String should match pattern"),
        (("    http: {url: \"http://127.0.0.1:1/lookup\", max_response_bytes: 4096}\n", ""),
         "tools.0: Value error, say where the tool runs"),
        (("op: gt", "op: bigger"), "approvals.0.op"),
        (("task_id_field: order_id", "task_id_field: ticket"), "task_id_field: 'ticket'"),
        (("limits: {max_steps: 6}", "limits: {max_steps: 0}"), "limits.max_steps"),
        (("minimum: 0, maximum: 1000}", "minimum: 0, maximum: 1000, frobnicate: 1}"),
         "tools.1.arguments.properties.amount.frobnicate: not supported"),
        (("tool: refund,", "tool: refnud,"), "approval rule 'refund' names unknown tool"),
        # a misspelt field would let every refund through without a human
        (("field: amount,", "field: amonut,"), "tool 'refund' has no argument 'amonut'"),
        (("value: 100}", "value: lots}"), "op 'gt' needs a number value"),
        (("  - name: refund\n", "  - name: lookup_order\n"), "two tools named lookup_order"),
        (('pattern: "^O[0-9]{4}$"}\n    question', "pattern: 5}\n    question"),
         "task_schema.properties.order_id.pattern: expected a string, got 5"),
        (("minimum: 0, maximum: 1000}", "minimum: abc, maximum: 1000}"),
         "amount.minimum: expected a number"),
        (("question: {type: string, maxLength: 500}", "question: {type: string, format: email}"),
         "task_schema.properties.question.format: not supported"),
    ],
)
def test_an_invalid_yaml_profile_names_the_file_and_the_field(
        tmp_path: Path, change: tuple[str, str], message: str) -> None:
    assert change[0] in GOOD_YAML
    f = tmp_path / "bad.yaml"
    f.write_text(GOOD_YAML.replace(change[0], change[1], 1))
    with pytest.raises(PluginError) as e:
        load_profile_file(f)
    assert str(e.value).startswith(f"{f}: ")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_yaml_that_does_not_parse_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "broken.yaml"
    f.write_text("name: [unclosed\n")
    with pytest.raises(PluginError, match=rf"^{f}: not readable YAML"):
        load_profile_file(f)


def test_one_file_reached_by_two_routes_is_one_profile(
        plugin_dir: Path, registry: ProfileRegistry) -> None:
    (plugin_dir / "acme.yaml").write_text(GOOD_YAML)
    name = _module(plugin_dir, "wl_test_twice", """
        PROFILES = ["acme.yaml"]
    """)
    load_plugins(plugins=f"{name},{name}", profile_paths=str(plugin_dir / "acme.yaml"),
                 registry=registry)
    assert "yaml-orders" in registry


def test_header_secrets_come_from_the_environment(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "acme.yaml"
    f.write_text(GOOD_YAML.replace("max_response_bytes: 4096}",
                                   "max_response_bytes: 4096, headers: {X-Key: \"${ACME_KEY}\"}}"))
    with pytest.raises(PluginError, match=r"\$\{ACME_KEY\} is not set"):
        load_profile_file(f)
    monkeypatch.setenv("ACME_KEY", "s3cret")
    runner_ = load_profile_file(f).tool("lookup_order").runner
    assert isinstance(runner_, HttpRunner) and runner_.headers == (("X-Key", "s3cret"),)
    assert "s3cret" not in repr(runner_)  # nor in logs that print the profile
    # nothing from the environment reaches the prompt
    f.write_text(GOOD_YAML.replace("One tool call per reply.", "Say ${ACME_KEY} never."))
    assert "${ACME_KEY}" in load_profile_file(f).system_prompt
    monkeypatch.setenv("ACME_KEY", "bad\r\nX-Injected: 1")
    f.write_text(GOOD_YAML.replace("max_response_bytes: 4096}",
                                   "max_response_bytes: 4096, headers: {X-Key: \"${ACME_KEY}\"}}"))
    with pytest.raises(PluginError, match="holds a line break"):
        load_profile_file(f)


def test_a_plugin_module_registers_profiles_yaml_and_toolsets(
        plugin_dir: Path, registry: ProfileRegistry) -> None:
    (plugin_dir / "acme.yaml").write_text(GOOD_YAML)
    name = _module(plugin_dir, "wl_test_good", """
        PROFILES = ["acme.yaml"]   # relative to the module
    """)
    loaded = load_plugins(plugins=name, profile_paths="", registry=registry)
    assert registry.names() == ["invoice-reconciliation", "ticket-triage", "yaml-orders"]
    sources = {r.profile.name: r.source for r in registry.registered()}
    assert "plugin module wl_test_good" in sources["yaml-orders"]
    assert "entry point warmloop.profiles:bundled" in sources["ticket-triage"]
    assert "wl_test_good" in loaded.modules and "warmloop" in loaded.modules
    assert set(loaded.toolsets) == {"ticket-triage", "invoice-reconciliation"}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("import nonexistent_dependency_xyz\nPROFILES = []\n",
         "plugin module {m} (WARMLOOP_PLUGINS) failed to import: ModuleNotFoundError"),
        ("X = 1\n", "plugin module {m} (WARMLOOP_PLUGINS) defines neither PROFILES nor TOOLSETS"),
        ("PROFILES = [42]\n", "plugin module {m} (WARMLOOP_PLUGINS): 42 is not a Profile"),
        ("def PROFILES():\n    raise RuntimeError('db down')\n",
         "plugin module {m} (WARMLOOP_PLUGINS) failed: RuntimeError: db down"),
        ("PROFILES = ['missing.yaml']\n", "no such profile file or folder"),
        ("TOOLSETS = [object()]\n", "is not a warmloop Toolset"),
    ],
)
def test_a_bad_plugin_stops_with_one_line_naming_it(
        plugin_dir: Path, registry: ProfileRegistry, body: str, message: str) -> None:
    name = _module(plugin_dir, f"wl_test_bad{abs(hash(body)) % 10_000}", body)
    with pytest.raises(PluginError) as e:
        load_plugins(plugins=name, profile_paths="", registry=registry)
    assert message.format(m=name) in str(e.value)
    assert "\n" not in str(e.value)


def test_two_profiles_with_one_name_stop_the_process(
        plugin_dir: Path, registry: ProfileRegistry) -> None:
    (plugin_dir / "a.yaml").write_text(GOOD_YAML)
    (plugin_dir / "b.yaml").write_text(GOOD_YAML.replace("You answer", "You reply to"))
    with pytest.raises(PluginError, match=r"profile 'yaml-orders' is registered twice: by "
                       r"file .*a\.yaml.* and by file .*b\.yaml"):
        load_plugins(plugins="", profile_paths=f"{plugin_dir / 'a.yaml'},{plugin_dir / 'b.yaml'}",
                     registry=registry)
    twin = _module(plugin_dir, "wl_test_twin", """
        import dataclasses
        from warmloop import get_profile
        PROFILES = [dataclasses.replace(get_profile("ticket-triage"))]
    """)
    with pytest.raises(PluginError, match="'ticket-triage' is registered twice"):
        load_plugins(plugins=twin, profile_paths="", registry=ProfileRegistry())


def test_a_tool_no_runner_can_serve_stops_the_agent_worker(
        plugin_dir: Path, registry: ProfileRegistry) -> None:
    name = _module(plugin_dir, "wl_test_orphan", """
        from pydantic import BaseModel, ConfigDict
        from typing import Literal
        from warmloop import Profile, ToolSpec

        class Task(BaseModel):
            id: str

        class Args(BaseModel):
            model_config = ConfigDict(extra="forbid")
            x: Literal["a", "b"]

        PROFILES = [Profile(name="orphan", system_prompt="s", task_model=Task, tools=(
            ToolSpec("look", "look", Args), ToolSpec("done", "done", Args, finishes_job=True)))]
    """)
    loaded = load_plugins(plugins=name, profile_paths="", registry=registry)
    with pytest.raises(PluginError, match="profile 'orphan' .* tool 'look' with no runner"):
        check_tools_implemented(loaded, registry)


# ---- @warmloop.tool ------------------------------------------------------------------


OrderId = Annotated[str, Field(pattern=r"^O[0-9]{4}$")]


@tool(side_effect=True, timeout_s=5, pause_median_s=0.3)
def refund_order(order_id: OrderId, amount: float, reason: Literal["damaged", "late"],
                 ctx: ToolContext) -> dict[str, object]:
    """Refund an order."""
    return {"refunded": order_id, "key": ctx.idempotency_key}


def test_the_tool_decorator_takes_arguments_from_type_hints() -> None:
    spec = refund_order.spec
    assert spec.name == "refund_order" and spec.side_effect and spec.timeout_s == 5
    assert spec.runner == PythonRunner(f"{__name__}:refund_order")
    props = spec.openai_schema()["function"]["parameters"]["properties"]
    assert set(props) == {"order_id", "amount", "reason"}  # the context is not an argument
    assert props["reason"]["enum"] == ["damaged", "late"]
    assert props["order_id"]["pattern"] == r"^O[0-9]{4}$"
    # still the function
    ctx = ToolContext(job_id="j", step=1, task_id="t", idempotency_key="j:1:refund_order")
    assert refund_order("O1234", 1.0, "late", ctx)["key"] == "j:1:refund_order"


def test_the_tool_decorator_refuses_what_a_weak_model_cannot_fill() -> None:
    with pytest.raises(ValueError, match="note are unbounded strings"):
        @tool
        def bad(note: str) -> str:
            """Say something."""
            return note
    with pytest.raises(TypeError, match="needs a type hint"):
        @tool
        def untyped(x) -> str:  # type: ignore[no-untyped-def]
            """x"""
            return str(x)
    with pytest.raises(TypeError, match="docstring"):
        @tool
        def silent(x: Literal["a"]) -> str:
            return x
    with pytest.raises(ValueError, match="have defaults"):
        @tool
        def optional(x: Literal["a", "b"] = "a") -> str:
            """x"""
            return x


# ---- `warmloop profiles` and plugin errors at the CLI -----------------------------------


@pytest.fixture(autouse=True)
def process_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CLI loads into the process's registry: give it back as it was. Plugins set for
    the integration tests' stack are not this module's business."""
    monkeypatch.delenv("WARMLOOP_PLUGINS", raising=False)
    monkeypatch.delenv("WARMLOOP_PROFILE_PATHS", raising=False)
    profiles = dict(REGISTRY._by_name)
    loaded = dict(plugins_module._loaded)
    yield
    REGISTRY._by_name.clear()
    REGISTRY._by_name.update(profiles)
    plugins_module._loaded.clear()
    plugins_module._loaded.update(loaded)


def test_warmloop_profiles_lists_every_profile_with_its_source(
        plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (plugin_dir / "acme.yaml").write_text(GOOD_YAML)
    monkeypatch.setenv("WARMLOOP_PROFILE_PATHS", str(plugin_dir / "acme.yaml"))
    monkeypatch.setenv("COLUMNS", "300")
    out = runner.invoke(app, ["profiles"])
    assert out.exit_code == 0, out.output
    assert "yaml-orders" in out.output and "ticket-triage" in out.output
    assert "lookup_order (http)" in out.output and "refund (activity@acme-tools)" in out.output
    assert "entry point warmloop.profiles:bundled" in out.output


@pytest.mark.parametrize("kind", ["module", "duplicate", "yaml"])
def test_a_bad_plugin_is_one_line_and_a_nonzero_exit_at_the_cli(
        plugin_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    if kind == "module":
        monkeypatch.setenv("WARMLOOP_PLUGINS", "wl_test_does_not_exist")
        expect = "plugin module wl_test_does_not_exist (WARMLOOP_PLUGINS) failed to import"
    elif kind == "duplicate":
        (plugin_dir / "a.yaml").write_text(GOOD_YAML.replace("yaml-orders", "ticket-triage"))
        monkeypatch.setenv("WARMLOOP_PROFILE_PATHS", str(plugin_dir / "a.yaml"))
        expect = "profile 'ticket-triage' is registered twice"
    else:
        (plugin_dir / "a.yaml").write_text(GOOD_YAML.replace("deadline_s: 600", "deadline_s: -1"))
        monkeypatch.setenv("WARMLOOP_PROFILE_PATHS", str(plugin_dir / "a.yaml"))
        expect = "approvals.0.deadline_s"
    out = runner.invoke(app, ["profiles"])
    assert out.exit_code != 0
    lines = [ln for ln in out.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], lines
