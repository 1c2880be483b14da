"""Shared by the dashboard and alert-rule tests: the series names a PromQL expression
reads, and promtool (Debian's prometheus package; `make promtool` puts it in the venv)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset",
            "bool", "and", "or", "unless", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*(?![\w:])")


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects: identifiers that are not functions, keywords,
    grouping labels, label matchers, strings, durations or Grafana variables."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)       # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)      # ranges and subqueries
    text = _GROUPING.sub(" ", text)             # grouping clauses and their labels
    names = set()
    for m in _IDENT.finditer(text):
        name = m.group(0)
        rest = text[m.end():].lstrip()
        if name.lower() in KEYWORDS or rest.startswith("("):
            continue
        names.add(name)
    return names


def promtool() -> str:
    found = (shutil.which("promtool", path=str(Path(sys.executable).parent))
             or shutil.which("promtool"))
    if found is None:
        pytest.fail("promtool is not installed: `make promtool` (Debian's prometheus "
                    "package, promtool only, into the venv)")
    return found
