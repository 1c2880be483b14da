"""Tools loaded on demand (``Profile.tools_on_demand``): pure functions the workflow and
the inference worker share.

A profile with many tools ships every tool schema on every step, and that is most of
its prompt. On demand, the stable prefix holds a compact index instead (a name and one
line per tool) and the request's rendered ``tools`` are only the always-available ones:
``load_tools`` and the tools that finish the job. The same on every step, so the prefix
stays cached. A ``load_tools`` call is answered by the workflow itself with the loaded
schemas as canonical JSON, appended to the transcript like any tool answer (append-only:
the cached prefix survives), and from then on the engine's guided decoding accepts
calls to them: the constraint is a JSON schema sent apart from ``tools``
(``structured_outputs``), shaped as vLLM's own ``tool_choice: required`` constraint, and
the model's JSON is parsed back into a ``ToolCall``.

What is loaded is derived from the transcript alone (the answers of ``load_tools``
calls): nothing new is carried across continue-as-new, and the worker that assembles
the prompt derives the same set as the workflow that validates the call.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from warmloop.workflows.contracts import ChatMessage
from warmloop.workflows.profiles.base import Profile, ToolSpec

LOAD_TOOLS = "load_tools"
"""The name of the loader tool (a profile on demand may not have a tool of its own so
named)."""
MAX_NAMES_PER_LOAD = 8
"""Names one ``load_tools`` call may ask for: a bounded array, so guided decoding cannot
ramble through a long list; more are loaded by another call."""
INDEX_LINE_CHARS = 120
"""An index line's description is cut to this (its first sentence or line first)."""
INDEX_HEADER = (
    "## Tools on demand\n"
    "Only these tools are callable at first: {always}. The tools below are listed by "
    "name; call load_tools with the names you need, read their schemas in its answer, "
    "then call them.")


def _json(value: object) -> str:
    # the same canonical form as warmloop.workflows.prompt.canonical_json (which imports
    # this module, so it cannot be imported here)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def always_available(profile: Profile, only: list[str] | None = None) -> list[str]:
    """Tools callable without loading: ``load_tools`` and the finishing tools (of those
    the job offers, ``only``), in name order."""
    finishing = [t.name for t in profile.tools
                 if t.finishes_job and (only is None or t.name in only)]
    return sorted([LOAD_TOOLS, *finishing])


def loadable(profile: Profile, only: list[str] | None = None) -> list[str]:
    """Tools that must be loaded before they are called, in name order."""
    return sorted(t.name for t in profile.tools
                  if not t.finishes_job and (only is None or t.name in only))


def index_line(spec: ToolSpec) -> str:
    """One line for ``spec``: its name and the first sentence of its description."""
    text = " ".join(spec.description.split())
    first = text.split(". ", 1)[0].rstrip(".")
    if len(first) > INDEX_LINE_CHARS:
        first = first[:INDEX_LINE_CHARS - 3].rstrip() + "..."
    return f"- {spec.name}: {first}"


def index_text(profile: Profile, only: list[str] | None = None) -> str:
    """The compact index that stands in the stable prefix for the loadable tools."""
    lines = [INDEX_HEADER.format(always=", ".join(always_available(profile, only)))]
    lines += [index_line(profile.tool(n)) for n in loadable(profile, only)]
    return "\n".join(lines)


def system_content(profile: Profile, only: list[str] | None = None) -> str:
    """The system message of an on-demand profile: its prompt, then the index."""
    return profile.system_prompt.rstrip("\n") + "\n\n" + index_text(profile, only)


_SPECS: dict[tuple[int, tuple[str, ...] | None], tuple[Profile, ToolSpec, Profile]] = {}


def _cached(profile: Profile, only: list[str] | None) -> tuple[ToolSpec, Profile]:
    """The loader spec and the validating profile, built once per (profile, offer):
    every step of every job needs them, and building a pydantic model is not free."""
    key = (id(profile), None if only is None else tuple(sorted(set(only))))
    hit = _SPECS.get(key)
    if hit is None or hit[0] is not profile:  # an id reused by another profile
        spec = _build_spec(profile, only)
        hit = (profile, spec, replace(profile, tools=(*profile.tools, spec),
                                      tools_on_demand=False))
        if len(_SPECS) > 1024:
            _SPECS.clear()
        _SPECS[key] = hit
    return hit[1], hit[2]


def _build_spec(profile: Profile, only: list[str] | None) -> ToolSpec:
    names = loadable(profile, only)
    if not names:
        raise ValueError(f"profile {profile.name!r}: tools_on_demand with no tool to load")
    one_of: Any = Literal[tuple(names)]  # an enum of the names: no unbounded string
    args = create_model(
        "LoadToolsArgs", __config__=ConfigDict(extra="forbid"),
        names=(list[one_of], Field(min_length=1,
                                   max_length=min(MAX_NAMES_PER_LOAD, len(names)),
                                   description="Names of the tools to load, from the index")))
    # Each useful call loads at least one tool: more calls than tools is a loop.
    return ToolSpec(LOAD_TOOLS, "Load the schemas of tools from the index; they can be "
                    "called once loaded.", args, max_calls=len(names) + 2)


def load_tools_spec(profile: Profile, only: list[str] | None = None) -> ToolSpec:
    """``load_tools``: a list of 1 to ``MAX_NAMES_PER_LOAD`` names, each one of the
    loadable tools (an enum, so the schema has no unbounded string). Past
    ``len(loadable) + 2`` calls the job ends as LOOP_CAP."""
    return _cached(profile, only)[0]


def with_loader(profile: Profile, only: list[str] | None = None) -> Profile:
    """``profile`` with ``load_tools`` among its tools: what the workflow validates an
    on-demand job's calls against (``Profile.validate_call`` then covers the loader)."""
    return _cached(profile, only)[1]


def rendered_schemas(profile: Profile, only: list[str] | None = None) -> list[dict[str, Any]]:
    """The request's ``tools`` on every step of an on-demand job (the chat template
    renders them into the stable prefix): the always-available tools' schemas."""
    finishing = [n for n in always_available(profile, only) if n != LOAD_TOOLS]
    return sorted([load_tools_spec(profile, only).openai_schema(),
                   *profile.tool_schemas(finishing)],
                  key=lambda s: s["function"]["name"])


def check_on_demand(profile: Profile) -> None:
    """Refuse an on-demand profile that could not work: a tool of its own named
    ``load_tools``, nothing to load, or a tool whose schema alone is longer than a tool
    answer may be (``max_tool_output_chars``): it could never be loaded."""
    if any(t.name == LOAD_TOOLS for t in profile.tools):
        raise ValueError(f"profile {profile.name!r}: tools_on_demand adds a tool named "
                         f"{LOAD_TOOLS!r}; rename the profile's own")
    load_tools_spec(profile)
    for name in loadable(profile):
        n = len(_json(profile.tool(name).openai_schema()))
        if n > profile.max_tool_output_chars:
            raise ValueError(
                f"profile {profile.name!r}: tool {name!r} has a schema of {n} characters, "
                f"more than max_tool_output_chars ({profile.max_tool_output_chars}); it "
                "could never be loaded on demand")


# ---- what is loaded ------------------------------------------------------------------------


class LoadAnswer(BaseModel):
    """The answer to a ``load_tools`` call, as the model reads it (canonical JSON)."""

    model_config = ConfigDict(extra="forbid")

    loaded: list[dict[str, Any]] = Field(default_factory=list)
    """The schemas loaded by this call (``openai_schema()`` of each), in name order."""
    already_loaded: list[str] = Field(default_factory=list)
    """Asked for but loaded by an earlier call: callable already, not repeated."""
    later: list[str] = Field(default_factory=list)
    """Asked for but not loaded: their schemas together would pass the answer's size
    bound (``max_tool_output_chars``); load them in another call."""
    note: str = ""


def load_answer(profile: Profile, names: list[str], loaded: set[str],
                only: list[str] | None = None) -> str:
    """What the model reads after ``load_tools(names)`` when ``loaded`` are loaded
    already: the new schemas (as many as fit the profile's tool answer bound, in the
    order asked), the names already loaded, and those left for a later call."""
    can = set(loadable(profile, only))
    out = LoadAnswer()
    used = 0
    for name in dict.fromkeys(names):
        if name not in can:
            continue  # validation refuses these before an answer is built
        if name in loaded:
            out.already_loaded.append(name)
            continue
        schema = profile.tool(name).openai_schema()
        size = len(_json(schema)) + 1
        if out.loaded and used + size > profile.max_tool_output_chars:
            out.later.append(name)
            continue
        out.loaded.append(schema)
        used += size
    out.loaded.sort(key=lambda s: s["function"]["name"])
    if not out.loaded and out.already_loaded:
        out.note = "nothing new: these are loaded already; call them"
    elif out.later:
        out.note = "call load_tools again for the tools in later"
    return _json(out.model_dump(exclude_defaults=True))


def loaded_from_transcript(profile: Profile, transcript: list[ChatMessage],
                           only: list[str] | None = None) -> set[str]:
    """The tools loaded so far: every schema a ``load_tools`` answer in ``transcript``
    gave. An answer that is not a load (an error the model read) loads nothing."""
    calls = {c.id for m in transcript if m.role == "assistant"
             for c in m.tool_calls or [] if c.function.name == LOAD_TOOLS}
    can = set(loadable(profile, only))
    out: set[str] = set()
    for m in transcript:
        if m.role != "tool" or m.tool_call_id not in calls or not m.content.startswith("{"):
            continue
        try:
            answer = json.loads(m.content)
        except ValueError:
            continue
        for schema in answer.get("loaded", []) if isinstance(answer, dict) else []:
            name = schema.get("function", {}).get("name") if isinstance(schema, dict) else None
            if name in can:
                out.add(name)
    return out


def offered(profile: Profile, transcript: list[ChatMessage],
            only: list[str] | None = None) -> list[str]:
    """What an on-demand job may call at its next step: the always-available tools and
    those loaded so far, in name order."""
    return sorted({*always_available(profile, only),
                   *loaded_from_transcript(profile, transcript, only)})


def call_problem(profile: Profile, name: str, arguments: str, loaded: set[str],
                 only: list[str] | None = None) -> str | None:
    """A one-line answer the model reads for a call the workflow refused, clearer than
    the validator's: a tool of the index not loaded yet, or unknown names asked of
    ``load_tools``. None: the validator's own message says it best."""
    can = loadable(profile, only)
    if name in can and name not in loaded:
        return f"tool {name} is not loaded; load it first with load_tools"
    if name != LOAD_TOOLS:
        return None
    try:
        asked = json.loads(arguments or "{}").get("names")
    except (ValueError, AttributeError):
        return None
    if not isinstance(asked, list):
        return None
    unknown = [str(n)[:40] for n in asked if n not in can]
    if not unknown:
        return None
    return (f"load_tools: no tool named {', '.join(unknown[:5])} in the index; "
            f"load only names the index lists")


# ---- the engine's constraint and its answer ------------------------------------------------


def constraint_schema(profile: Profile, offered_names: list[str], loaded: set[str],
                      only: list[str] | None = None) -> dict[str, Any]:
    """The JSON schema guided decoding enforces on an on-demand step: exactly one call
    ``[{"name": ..., "parameters": ...}]`` (vLLM's own shape for ``tool_choice:
    required``) to one of ``offered_names``. ``load_tools`` accepts only names not loaded
    yet, and is left out once everything is loaded."""
    alternatives: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for name in sorted(offered_names):
        if name == LOAD_TOOLS:
            rest = [n for n in loadable(profile, only) if n not in loaded]
            if not rest:
                continue
            params: dict[str, Any] = {
                "type": "object", "additionalProperties": False, "required": ["names"],
                "properties": {"names": {"type": "array", "minItems": 1,
                                         "maxItems": min(MAX_NAMES_PER_LOAD, len(rest)),
                                         "items": {"type": "string", "enum": rest}}}}
        else:
            params = dict(profile.tool(name).openai_schema()["function"]["parameters"])
            # refs point at the root ("#/$defs/..."): lift the definitions there
            defs.update(params.pop("$defs", {}))
        alternatives.append({"type": "object", "additionalProperties": False,
                             "required": ["name", "parameters"],
                             "properties": {"name": {"type": "string", "enum": [name]},
                                            "parameters": params}})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": 1,
                              "items": {"anyOf": alternatives}}
    if defs:
        schema["$defs"] = defs
    return schema


def parse_call(text: str) -> tuple[str, str] | None:
    """The (name, arguments JSON) of the one call in the model's constrained output;
    None when it is not one (cut by max_tokens, say): the workflow then reads the text
    as an invalid step, as it reads a missing tool call."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict):
        return None
    name, params = value.get("name"), value.get("parameters", value.get("arguments"))
    if not isinstance(name, str) or not isinstance(params, dict):
        return None
    return name, _json(params)


# ---- the workflow's side ---------------------------------------------------------------------


def job_offer(profile: Profile, transcript: list[ChatMessage],
              only: list[str] | None) -> tuple[Profile, list[str] | None]:
    """What the workflow validates a step's call against: the profile (with the loader,
    on demand) and the offered names (``only`` as ever; on demand, those callable now)."""
    if not profile.tools_on_demand:
        return profile, only
    return with_loader(profile, only), offered(profile, transcript, only)


def refusal(profile: Profile, transcript: list[ChatMessage], only: list[str] | None,
            name: str, arguments: str) -> str | None:
    """The one line an on-demand job's model reads for a refused call, when clearer
    than the validator's (``call_problem``); None otherwise or off demand."""
    if not profile.tools_on_demand:
        return None
    return call_problem(profile, name, arguments,
                        loaded_from_transcript(profile, transcript, only), only)


def answer_load(profile: Profile, transcript: list[ChatMessage], only: list[str] | None,
                args: dict[str, Any]) -> str:
    """The workflow's answer to a validated ``load_tools`` call (no activity runs)."""
    return load_answer(profile, list(args.get("names", [])),
                       loaded_from_transcript(profile, transcript, only), only)
