"""The plugin seam: every process finds its profiles and toolsets the same way.

Three sources, loaded in this order, each once per process:

1. entry points in the groups ``warmloop.profiles`` and ``warmloop.toolsets`` of any
   installed distribution (warmloop's own bundled agents come in this way);
2. modules named in ``WARMLOOP_PLUGINS`` (``module[,module]``), for code that is not
   packaged: each may define ``PROFILES`` and ``TOOLSETS``;
3. YAML profile files or folders named in ``WARMLOOP_PROFILE_PATHS`` (``path[,path]``).

A profile source is a ``Profile``, a path to a YAML file or folder of ``*.yaml``, an
iterable of those, or a callable returning any of them; a toolset source is a
``Toolset``, an iterable of them, or a callable returning either. A plugin that fails
to load and a profile name registered twice stop the process with one line naming
the plugin (``PluginError``); nothing is skipped silently.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import yaml

from warmloop.activities.tools.base import Toolset
from warmloop.activities.tools.functions import resolve_function_tool
from warmloop.workflows.profiles.base import Profile, PythonRunner, ToolSpec
from warmloop.workflows.profiles.document import ProfileDocumentError, profile_from_document
from warmloop.workflows.profiles.registry import REGISTRY, DuplicateProfileError, ProfileRegistry

PROFILE_GROUP = "warmloop.profiles"
TOOLSET_GROUP = "warmloop.toolsets"


class PluginError(RuntimeError):
    """A plugin could not be loaded; the message is one line naming it."""


@dataclass
class LoadedPlugins:
    """What a process loaded: its toolsets by profile, and the modules the workflow
    sandbox must pass through (where the registered profiles' classes live)."""

    toolsets: dict[str, Toolset] = field(default_factory=dict)
    toolset_sources: dict[str, str] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)
    """Top-level packages of every plugin, for the sandbox's passthrough list."""


_loaded: dict[tuple[str, str, bool], LoadedPlugins] = {}


def split_list(value: str | None) -> list[str]:
    return [p.strip() for p in (value or "").split(",") if p.strip()]


def load_plugins(*, plugins: str | None = None, profile_paths: str | None = None,
                 toolsets: bool = True, registry: ProfileRegistry = REGISTRY) -> LoadedPlugins:
    """Load every plugin into ``registry`` (once per process for the same arguments).

    ``plugins`` and ``profile_paths`` default to ``WARMLOOP_PLUGINS`` and
    ``WARMLOOP_PROFILE_PATHS``. ``toolsets=False``: profiles only (the CLI, inference
    workers and clients never run tools, and a toolset factory may need credentials
    only the agent worker has). A plugin reached twice (an entry point and
    ``WARMLOOP_PLUGINS``, say) loads once. Raises ``PluginError``."""
    plugins = os.environ.get("WARMLOOP_PLUGINS", "") if plugins is None else plugins
    if profile_paths is None:
        profile_paths = os.environ.get("WARMLOOP_PROFILE_PATHS", "")
    key = (plugins, profile_paths, toolsets)
    if registry is REGISTRY and key in _loaded:
        return _loaded[key]
    out = LoadedPlugins(modules=["warmloop"])
    seen: set[str] = set()
    for ep in _entry_points(PROFILE_GROUP):
        source = f"entry point {PROFILE_GROUP}:{ep.name} ({ep.value})"
        _add_profiles(registry, _load_entry_point(ep, source), source, out,
                      base=_module_folder(ep.value.split(":")[0]))
        _note_module(out, ep.value)
        seen.add(ep.value.split(":")[0])
    for ep in _entry_points(TOOLSET_GROUP) if toolsets else []:
        source = f"entry point {TOOLSET_GROUP}:{ep.name} ({ep.value})"
        _add_toolsets(_load_entry_point(ep, source), source, out)
        _note_module(out, ep.value)
        seen.add(ep.value.split(":")[0])
    for name in dict.fromkeys(split_list(plugins)):
        if name in seen:
            continue  # its entry points loaded it already
        source = f"plugin module {name} (WARMLOOP_PLUGINS)"
        try:
            module = importlib.import_module(name)
        except Exception as e:
            raise PluginError(f"{source} failed to import: {type(e).__name__}: {e}") from None
        _note_module(out, name)
        if not hasattr(module, "PROFILES") and not hasattr(module, "TOOLSETS"):
            raise PluginError(f"{source} defines neither PROFILES nor TOOLSETS")
        if hasattr(module, "PROFILES"):
            _add_profiles(registry, module.PROFILES, source, out,
                          base=Path(module.__file__ or ".").parent)
        if hasattr(module, "TOOLSETS") and toolsets:
            _add_toolsets(module.TOOLSETS, source, out)
    for path in split_list(profile_paths):
        _add_profiles(registry, Path(path), f"file {path} (WARMLOOP_PROFILE_PATHS)", out)
    if registry is REGISTRY:
        _loaded[key] = out
    return out


def _entry_points(group: str) -> list[Any]:
    """The group's entry points by name; one distribution found twice on sys.path (an
    editable install beside a built one) counts once."""
    unique = {(ep.name, ep.value): ep for ep in entry_points(group=group)}
    return [unique[k] for k in sorted(unique)]


def _module_folder(module: str) -> Path | None:
    """Where a module lives: an entry point's relative YAML paths resolve from there."""
    spec = importlib.util.find_spec(module)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def _note_module(out: LoadedPlugins, dotted: str) -> None:
    top = dotted.split(":")[0].split(".")[0]
    if top not in out.modules:
        out.modules.append(top)


def _load_entry_point(ep: Any, source: str) -> Any:
    try:
        return ep.load()
    except Exception as e:
        raise PluginError(f"{source} failed to load: {type(e).__name__}: {e}") from None


def _call(obj: Any, source: str) -> Any:
    if callable(obj) and not isinstance(obj, type):
        try:
            return obj()
        except Exception as e:
            raise PluginError(f"{source} failed: {type(e).__name__}: {e}") from None
    return obj


def _as_list(obj: Any, single: Any, source: str, *, expected: str) -> list[Any]:
    """A plugin attribute as a list: called if callable, one ``single`` wrapped, any
    other iterable listed; anything else is a ``PluginError`` saying what was expected."""
    obj = _call(obj, source)
    if isinstance(obj, single):
        return [obj]
    try:
        return list(obj)
    except TypeError:
        raise PluginError(f"{source}: expected {expected}, got {type(obj).__name__}") from None


def _add_profiles(registry: ProfileRegistry, obj: Any, source: str, out: LoadedPlugins, *,
                  base: Path | None = None) -> None:
    items = _as_list(obj, Profile | str | Path, source,
                     expected="profiles, YAML paths or a callable returning them")
    for item in items:
        if isinstance(item, Profile):
            _register(registry, item, source)
        elif isinstance(item, str | Path):
            path = Path(item)
            if base is not None and not path.is_absolute():
                path = base / path
            for file in _yaml_files(path, source):
                _register(registry, _cached_profile_file(file), f"file {file} ({source})")
        else:
            raise PluginError(f"{source}: {item!r} is not a Profile or a YAML path")


def _register(registry: ProfileRegistry, profile: Profile, source: str) -> None:
    try:
        registry.add(profile, source=source)
    except DuplicateProfileError as e:
        raise PluginError(str(e)) from None


def _yaml_files(path: Path, source: str) -> list[Path]:
    if path.is_dir():
        files = sorted([*path.glob("*.yaml"), *path.glob("*.yml")])
        if not files:
            raise PluginError(f"{source}: folder {path} holds no *.yaml profile")
        return files
    if not path.is_file():
        raise PluginError(f"{source}: no such profile file or folder: {path}")
    return [path]


_files: dict[Path, Profile] = {}


def _cached_profile_file(file: Path) -> Profile:
    """One Profile per file per process: a file reached by two routes is one profile,
    not two with one name."""
    key = file.resolve()
    if key not in _files:
        _files[key] = load_profile_file(file)
    return _files[key]


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand_env(value: Any, file: Path) -> Any:
    """``${VAR}`` in a string becomes the variable (secrets stay out of the file)."""
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            if m.group(1) not in os.environ:
                raise PluginError(f"{file}: ${{{m.group(1)}}} is not set in the environment")
            got = os.environ[m.group(1)]
            if "\r" in got or "\n" in got:
                raise PluginError(f"{file}: ${{{m.group(1)}}} holds a line break")
            return got
        return _ENV_REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: _expand_env(v, file) for k, v in value.items()}
    return value


def _expand_http_env(data: Any, file: Path) -> Any:
    """``${VAR}`` is read from the environment in an HTTP tool's ``url`` and ``headers``
    only: secrets stay out of the file, and nothing from the environment reaches a
    prompt (a system prompt may say ``${...}`` literally)."""
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        return data
    tools = []
    for t in data["tools"]:
        if isinstance(t, dict) and isinstance(t.get("http"), dict):
            http = dict(t["http"])
            for k in ("url", "headers"):
                if k in http:
                    http[k] = _expand_env(http[k], file)
            t = {**t, "http": http}
        tools.append(t)
    return {**data, "tools": tools}


def _python_tool_spec(path: str) -> ToolSpec:
    return resolve_function_tool(path).spec


def load_profile_file(file: Path) -> Profile:
    """A YAML profile file as a ``Profile``; ``PluginError`` names the file and field."""
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PluginError(f"{file}: not readable YAML: {' '.join(str(e).split())}") from None
    try:
        return profile_from_document(_expand_http_env(data, file),
                                     python_tool=_python_tool_spec)
    except ProfileDocumentError as e:
        raise PluginError(f"{file}: {e}") from None


def _add_toolsets(obj: Any, source: str, out: LoadedPlugins) -> None:
    for ts in _as_list(obj, Toolset, source,
                       expected="toolsets or a callable returning them"):
        if not isinstance(ts, Toolset):
            raise PluginError(f"{source}: {ts!r} is not a warmloop Toolset")
        if ts.profile in out.toolsets:
            raise PluginError(f"toolset of profile {ts.profile!r} is registered twice: by "
                              f"{out.toolset_sources[ts.profile]} and by {source}")
        out.toolsets[ts.profile] = ts
        out.toolset_sources[ts.profile] = source


def check_tools_implemented(loaded: LoadedPlugins, registry: ProfileRegistry = REGISTRY
                            ) -> None:
    """Every tool of every profile can run in this (agent worker) process, or the worker
    refuses to start: a job must not find out at its fifth step."""
    for reg in registry.registered():
        p = reg.profile
        for t in p.tools:
            if t.finishes_job:
                continue
            if t.runner is None and p.name not in loaded.toolsets:
                raise PluginError(f"profile {p.name!r} (from {reg.source}) has tool "
                                  f"{t.name!r} with no runner and no toolset for the profile")
            if isinstance(t.runner, PythonRunner):
                try:
                    resolve_function_tool(t.runner.function)
                except (ImportError, AttributeError, TypeError) as e:
                    raise PluginError(f"profile {p.name!r} (from {reg.source}) tool "
                                      f"{t.name!r}: cannot resolve {t.runner.function}: "
                                      f"{e}") from None
