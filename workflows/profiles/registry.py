"""The profile registry: every profile a process knows, and where it came from.

Filled once per process at start by the plugin loader (``warmloop.workers.plugins``),
then read by the workflow, the inference workers and the CLI. Workflow code sees this
very module through the sandbox (it is passed through, not re-imported), so a profile a
plugin registered in the worker is the profile the workflow runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from warmloop.workflows.profiles.base import Profile


class UnknownProfileError(ValueError):
    """A job named a profile that is not registered."""


class DuplicateProfileError(ValueError):
    """Two plugins registered profiles of the same name: which one a job gets would
    depend on load order, so the process refuses to start."""


@dataclass(frozen=True)
class RegisteredProfile:
    """A profile and the plugin that registered it (shown by ``warmloop profiles``)."""

    profile: Profile
    source: str
    """``entry point warmloop.profiles:<name>``, ``module <m>`` or ``file <path>``."""


class ProfileRegistry:
    """Profiles by name. Registering a name twice is an error naming both sources."""

    def __init__(self) -> None:
        self._by_name: dict[str, RegisteredProfile] = {}

    def add(self, profile: Profile, *, source: str) -> None:
        seen = self._by_name.get(profile.name)
        if seen is not None:
            if seen.profile is profile:
                return  # the same object loaded again through a second route
            raise DuplicateProfileError(
                f"profile {profile.name!r} is registered twice: by {seen.source} and by "
                f"{source}; rename one of them")
        self._by_name[profile.name] = RegisteredProfile(profile, source)

    def get(self, name: str) -> Profile:
        try:
            return self._by_name[name].profile
        except KeyError:
            known = ", ".join(sorted(self._by_name)) or "none loaded"
            raise UnknownProfileError(f"unknown profile {name!r} (known: {known})") from None

    def registered(self) -> list[RegisteredProfile]:
        return [self._by_name[n] for n in sorted(self._by_name)]

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def remove(self, name: str) -> None:
        """Forget one profile (tests and tools that register throwaway variants)."""
        self._by_name.pop(name, None)

    def clear(self) -> None:
        """Forget every profile (tests that load plugin sets of their own)."""
        self._by_name.clear()


REGISTRY = ProfileRegistry()
"""The process's registry."""


def get_profile(name: str) -> Profile:
    """The registered profile called ``name``; raises ``UnknownProfileError`` otherwise."""
    return REGISTRY.get(name)
