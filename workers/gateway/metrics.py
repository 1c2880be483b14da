"""The gateway's Prometheus metrics, written in the text exposition format by hand.

(``prometheus_client`` is not one of warmloop's dependencies; a few counters, gauges
and one histogram do not need it.) Label values are escaped; label sets are bounded by
what the gateway knows (engines, route reasons, statuses, hold actions), never by
session ids or models chosen by clients.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable

Labels = tuple[tuple[str, str], ...]

COUNTERS = {
    "warmloop_gateway_requests_total": "Calls answered, by endpoint and HTTP status.",
    "warmloop_gateway_routed_total": "Engine choices, by engine and route reason.",
    "warmloop_gateway_failovers_total": "Calls moved off an engine that refused or died "
                                        "before answering, by that engine.",
    "warmloop_gateway_stream_errors_total": "Responses cut by their engine after it began "
                                            "answering, by engine.",
    "warmloop_gateway_prompt_tokens_total": "Prompt tokens the engines reported, by engine.",
    "warmloop_gateway_cached_tokens_total": "Prompt tokens the engines served from cache, "
                                            "by engine.",
    "warmloop_gateway_hold_decisions_total": "Hold decisions at the end of a session's call, "
                                             "by action.",
    "warmloop_gateway_pauses_total": "Session pauses measured (between two calls).",
    "warmloop_gateway_sessions_moved_total": "Sessions another gateway replica took (their "
                                             "holds here ended).",
    "warmloop_gateway_session_moves_stale_total": "Announcements of a move read after this "
                                                  "replica served the session again (sent "
                                                  "late, while Redis was away): ignored.",
    "warmloop_gateway_learn_skipped_total": "Prompt chains not learned (too many waiting, "
                                            "or the engine could not tokenize).",
}
GAUGES = {
    "warmloop_gateway_holds": "Sessions' prefixes held warm now, by engine.",
    "warmloop_gateway_held_tokens": "Tokens held warm for sessions now, by engine.",
    "warmloop_gateway_sessions": "Sessions the gateway remembers.",
    "warmloop_gateway_live_engines": "Engines the gateway routes to.",
    "warmloop_gateway_in_flight": "Calls in flight through the gateway, by engine.",
    "warmloop_gateway_batch_active": "Batch-lane calls this gateway has admitted and not "
                                     "finished, by engine (including those waiting for one of "
                                     "the engine's shared slots).",
    "warmloop_gateway_batch_waiting": "Batch-lane calls waiting for a batch slot, by engine.",
}
HISTOGRAM = "warmloop_gateway_added_latency_seconds"
HISTOGRAM_HELP = ("Time a call spends in the gateway before its engine request is sent "
                  "(parsing, routing; batch admission excluded).")
BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    def __init__(self) -> None:
        self._counters: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self._buckets = [0] * (len(BUCKETS) + 1)
        self._sum = 0.0
        self._count = 0

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown counter {name}")
        self._counters[name][tuple(sorted(labels.items()))] += value

    def counter(self, name: str, **labels: str) -> float:
        return self._counters[name].get(tuple(sorted(labels.items())), 0.0)

    def observe_added(self, seconds: float) -> None:
        self._buckets[bisect.bisect_left(BUCKETS, seconds)] += 1
        self._sum += seconds
        self._count += 1

    def render(self, gauges: Iterable[tuple[str, dict[str, str], float]]) -> str:
        """The exposition text; ``gauges``: (name, labels, value) read now."""
        out: list[str] = []
        for name, help_text in COUNTERS.items():
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            for labels, v in sorted(self._counters.get(name, {}).items()):
                out.append(f"{name}{_labels(labels)} {_num(v)}")
        by_name: dict[str, list[str]] = defaultdict(list)
        for name, given, v in gauges:
            by_name[name].append(f"{name}{_labels(tuple(sorted(given.items())))} {_num(v)}")
        for name, help_text in GAUGES.items():
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *by_name[name]]
        out += [f"# HELP {HISTOGRAM} {HISTOGRAM_HELP}", f"# TYPE {HISTOGRAM} histogram"]
        running = 0
        for bound, n in zip([*map(str, BUCKETS), "+Inf"], self._buckets, strict=True):
            running += n
            out.append(f'{HISTOGRAM}_bucket{{le="{bound}"}} {running}')
        out += [f"{HISTOGRAM}_sum {_num(self._sum)}", f"{HISTOGRAM}_count {self._count}"]
        return "\n".join(out) + "\n"


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
