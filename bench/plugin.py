"""The benchmarks' synthetic agents, loaded as a warmloop plugin
(``WARMLOOP_PLUGINS=bench.plugin``), through the same seam as a user's: they are not
product defaults.

The synthetic tools' pauses come from ``WARMLOOP_SYNTHETIC_PAUSES`` (JSON of
``SyntheticPauses``), read once when the plugin loads in the agent worker.
"""

from __future__ import annotations

import os

from bench.synthetic_pauses import SyntheticPauses
from bench.synthetic_profiles import SYNTHETIC_PROFILES
from bench.synthetic_tools import SyntheticTools
from bench.tool_catalog import CATALOG_PROFILES, CatalogTools
from warmloop import Toolset

PAUSES_ENV = "WARMLOOP_SYNTHETIC_PAUSES"

PROFILES = (*SYNTHETIC_PROFILES, *CATALOG_PROFILES)


def TOOLSETS() -> list[Toolset]:  # noqa: N802 (a plugin attribute, called at load)
    raw = os.environ.get(PAUSES_ENV)
    pauses = SyntheticPauses.model_validate_json(raw) if raw else SyntheticPauses()
    return [*(SyntheticTools(p.name, pauses) for p in SYNTHETIC_PROFILES),
            *(CatalogTools(p.name) for p in CATALOG_PROFILES)]
