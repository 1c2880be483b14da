"""Jobs for the simulator: what each step sends and how long each pause lasts.

A job is a prefix family (profile + tool set: the stable prefix every job of it shares),
its task, and a sequence of steps, each with its output tokens, the tokens its tool's
result adds to the transcript, and the pause before the next step (a tool, or a human
approval). Generators build them from profiles (the bundled ones, with their own tools'
and approvals' pause priors), from Poisson arrivals, bursts and schedules, and from
trace-replay files (``workflows/trace.py``'s format, ``bench/traces``).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from warmloop.workflows.contracts import Lane
from warmloop.workflows.profiles.base import Profile

CHARS_PER_TOKEN = 4.0
"""Token estimate of a text when no tokenizer is at hand (Llama-3-class BPE on English)."""


@dataclass
class StepSpec:
    output_tokens: int
    result_tokens: int
    """Tokens the step's call and its tool result add to the transcript."""
    pause_kind: str = ""
    """``tool:<name>`` or ``approval:<kind>``; empty for the last step."""
    pause_s: float = 0.0
    approval: bool = False
    viewed_after_s: float | None = None
    """An approval opened this long into its wait (the job prewarms then)."""
    call_tokens: int | None = None
    """Of ``result_tokens``, the call's own: what an approval's pre-warms add to the
    prompt (the workflow sends the transcript as it stands, the call in, its result not
    yet run, and an empty tail). None: not told apart (the pre-warm sends the whole
    transcript and the step's tail, as before 2026-12-05)."""


@dataclass
class JobSpec:
    job_id: str
    family: str
    prefix_tokens: int
    """The stable prefix shared by every job of ``family`` (system prompt, tool schemas)."""
    task_tokens: int
    steps: list[StepSpec]
    arrival_s: float = 0.0
    lane: Lane = Lane.INTERACTIVE
    tail_tokens: int = 32
    """The volatile tail (step number, budget left): never cached."""
    prior: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Pause priors by kind: (median s, p90 s), until observed pauses exist."""
    batch_id: str | None = None


class PauseModel(BaseModel):
    """A pause's distribution: lognormal body plus a share of long pauses."""

    model_config = ConfigDict(frozen=True)

    median_s: float = Field(gt=0)
    """Median of the lognormal body."""
    sigma: float = Field(default=0.6, ge=0)
    """Log-space spread of the body."""
    long_share: float = Field(default=0.0, ge=0, le=1)
    """Share of pauses drawn uniformly from [long_min_s, long_max_s] instead."""
    long_min_s: float = Field(default=20.0, ge=0)
    long_max_s: float = Field(default=60.0, ge=0)
    max_s: float = Field(default=86_400.0, gt=0)
    """Cap on any pause."""

    def draw(self, rng: random.Random) -> float:
        pause = self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        if rng.random() < self.long_share:
            pause = rng.uniform(self.long_min_s, self.long_max_s)
        return min(self.max_s, pause)

    @property
    def p90_s(self) -> float:
        return self.median_s * math.exp(1.2815515655446004 * self.sigma)


class JobProfile(BaseModel):
    """How a kind of job looks to the engines: sizes, steps and pauses."""

    model_config = ConfigDict(frozen=True)

    name: str
    prefix_tokens: int = Field(gt=0)
    """Stable prefix tokens (system prompt and tool schemas)."""
    task_tokens: int = Field(default=80, gt=0)
    min_steps: int = Field(default=3, ge=1)
    max_steps: int = Field(default=8, ge=1)
    output_tokens: int = Field(default=48, ge=1)
    """Tokens a step generates (its tool call)."""
    result_tokens: int = Field(default=120, ge=0)
    """Tokens a step's call and result add to the transcript."""
    tool_pause: PauseModel = PauseModel(median_s=1.0, sigma=1.2)
    approval_share: float = Field(default=0.0, ge=0, le=1)
    """Share of steps whose call waits for a human."""
    approval_pause: PauseModel = PauseModel(median_s=1200.0, sigma=0.85)
    approval_kind: str = "approval"
    lane: Lane = Lane.INTERACTIVE
    tail_tokens: int = Field(default=32, ge=0)

    def job(self, job_id: str, rng: random.Random, arrival_s: float,
            lane: Lane | None = None) -> JobSpec:
        n = rng.randint(self.min_steps, self.max_steps)
        steps = []
        for i in range(n):
            last = i == n - 1
            approval = (not last) and rng.random() < self.approval_share
            pause = self.approval_pause if approval else self.tool_pause
            s = 0.0 if last else pause.draw(rng)
            steps.append(StepSpec(
                output_tokens=max(1, int(self.output_tokens * rng.uniform(0.6, 1.4))),
                result_tokens=max(0, int(self.result_tokens * rng.uniform(0.5, 1.5))),
                pause_kind="" if last else (f"approval:{self.approval_kind}" if approval
                                           else "tool:call"),
                pause_s=s, approval=approval,
                viewed_after_s=(s * rng.uniform(0.3, 0.8)) if approval else None))
        return JobSpec(job_id=job_id, family=self.name, prefix_tokens=self.prefix_tokens,
                       task_tokens=max(1, int(self.task_tokens * rng.uniform(0.7, 1.3))),
                       steps=steps, arrival_s=arrival_s, lane=lane or self.lane,
                       tail_tokens=self.tail_tokens,
                       prior={"tool:call": (self.tool_pause.median_s, self.tool_pause.p90_s),
                              f"approval:{self.approval_kind}": (
                                  self.approval_pause.median_s, self.approval_pause.p90_s)})


def _tokens(text: str) -> int:
    return max(1, int(len(text) / CHARS_PER_TOKEN))


def profile_from(profile: Profile, *, lane: Lane = Lane.INTERACTIVE) -> JobProfile:
    """A ``JobProfile`` from a registered warmloop ``Profile``: its prefix from its
    system prompt and tool schemas (estimated at ``CHARS_PER_TOKEN``), its steps from its
    step cap, tool pauses from its tools' priors and approvals from its rules' priors."""
    schemas = json.dumps(profile.tool_schemas(), sort_keys=True)
    tools = [t for t in profile.tools if not t.finishes_job]
    median = sorted(t.pause_median_s for t in tools)[len(tools) // 2] if tools else 1.0
    p90 = max((t.pause_p90_s for t in tools), default=5.0)
    sigma = max(0.1, math.log(max(p90, median * 1.01) / median) / 1.2815515655446004)
    rule = profile.approvals[0] if profile.approvals else None
    a_sigma = 0.85 if rule is None else max(0.1, math.log(
        max(rule.pause_p90_s, rule.pause_median_s * 1.01) / rule.pause_median_s)
        / 1.2815515655446004)
    max_steps = profile.limits.max_steps or 8
    return JobProfile(
        name=profile.name, prefix_tokens=_tokens(profile.system_prompt + schemas),
        min_steps=max(2, max_steps // 3), max_steps=max_steps,
        output_tokens=48, result_tokens=140,
        tool_pause=PauseModel(median_s=median, sigma=sigma, max_s=max(60.0, p90 * 4)),
        approval_share=0.1 if rule is not None else 0.0,
        approval_pause=PauseModel(median_s=rule.pause_median_s if rule else 1200.0,
                                  sigma=a_sigma, max_s=4 * 3600.0),
        approval_kind=rule.kind if rule else "approval", lane=lane)


def bundled_mix() -> list[tuple[JobProfile, float]]:
    """The bundled profiles, equal shares: ticket-triage and invoice-reconciliation."""
    from warmloop.workflows.profiles.bundled import PROFILES
    return [(profile_from(p), 1.0) for p in PROFILES]


def agentic_mix() -> list[tuple[JobProfile, float]]:
    """A second workload, NOT the bundled profiles: long agent loops with big prompts and
    tool pauses of seconds to minutes, as coding and ticket agents have in production
    (an assumption of this project, not a measured trace).

    - ``coding-agent``: a 6k-token system prompt and tool schemas, a 0.8k task, 12-40
      steps of ~150 output tokens, each adding ~1.2k tokens (file reads, diffs, test
      output); tools pause ~6 s (median), one in five runs a build or test suite of
      30 s-5 min; 2 % of calls wait for a human (median 5 min).
    - ``ticket-agent``: a 4k-token prefix, 6-20 steps adding ~600 tokens (account and
      order lookups, knowledge-base pages), tools ~3 s, one in ten 20 s-2 min (a
      third-party API, a refund); 5 % of calls wait for a human (median 10 min).
    """
    families = (
        # name, prefix and task tokens, steps, output and result tokens per step,
        # tool pause, then share, median and kind of the approvals
        ("coding-agent", 6_000, 800, (12, 40), 150, 1_200,
         PauseModel(median_s=6.0, sigma=0.8, long_share=0.2, long_min_s=30.0,
                    long_max_s=300.0, max_s=600.0),
         0.02, 300.0, "review"),
        ("ticket-agent", 4_000, 600, (6, 20), 100, 600,
         PauseModel(median_s=3.0, sigma=0.7, long_share=0.1, long_min_s=20.0,
                    long_max_s=120.0, max_s=300.0),
         0.05, 600.0, "refund"),
    )
    return [(JobProfile(
        name=name, prefix_tokens=prefix, task_tokens=task, min_steps=min_steps,
        max_steps=max_steps, output_tokens=output, result_tokens=result,
        tool_pause=tool_pause, approval_share=approval_share,
        approval_pause=PauseModel(median_s=approval_median_s, sigma=0.8, max_s=3_600.0),
        approval_kind=approval_kind), 1.0)
        for (name, prefix, task, (min_steps, max_steps), output, result, tool_pause,
             approval_share, approval_median_s, approval_kind) in families]


WORKLOADS = {"bundled": bundled_mix, "agentic": agentic_mix}
"""Named job mixes: ``bundled`` (the bundled profiles) and ``agentic`` (labelled
second workload: long loops, big prompts, long tool pauses)."""


def poisson_jobs(mix: list[tuple[JobProfile, float]], *, rate_per_s: float, duration_s: float,
                 rng: random.Random, start_s: float = 0.0, lane: Lane | None = None,
                 prefix: str = "j") -> list[JobSpec]:
    """Poisson arrivals at ``rate_per_s`` over ``duration_s``, profiles drawn by weight."""
    profiles = [p for p, _ in mix]
    weights = [w for _, w in mix]
    out: list[JobSpec] = []
    t, i = start_s, 0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= start_s + duration_s:
            return out
        p = rng.choices(profiles, weights)[0]
        out.append(p.job(f"{prefix}{i:07d}", rng, t, lane))
        i += 1


def burst_jobs(mix: list[tuple[JobProfile, float]], *, n: int, at_s: float, over_s: float,
               rng: random.Random, prefix: str = "b") -> list[JobSpec]:
    """``n`` batch jobs submitted over ``over_s`` from ``at_s`` (a nightly batch)."""
    profiles = [p for p, _ in mix]
    weights = [w for _, w in mix]
    return [rng.choices(profiles, weights)[0].job(
        f"{prefix}{i:06d}", rng, at_s + over_s * i / max(1, n), Lane.BATCH) for i in range(n)]


def scheduled_jobs(mix: list[tuple[JobProfile, float]], *, every_s: float, n_per_run: int,
                   duration_s: float, rng: random.Random) -> list[JobSpec]:
    """A schedule: ``n_per_run`` batch jobs every ``every_s`` (cron-like)."""
    out: list[JobSpec] = []
    t = 0.0
    k = 0
    while t < duration_s:
        out += burst_jobs(mix, n=n_per_run, at_s=t, over_s=1.0, rng=rng, prefix=f"s{k}-")
        t += every_s
        k += 1
    return out


def trace_jobs(path: Path, *, mean_gap_s: float, rng: random.Random,
               prefix_tokens: dict[str, int] | None = None) -> list[JobSpec]:
    """Jobs from a trace-replay file (``warmloop replay``'s JSONL): the recorded output
    tokens, results and pauses; token counts of text estimated at ``CHARS_PER_TOKEN``."""
    out: list[JobSpec] = []
    t = 0.0
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        family = rec.get("profile") or "inline-" + hashlib.blake2b(
            rec.get("system_prompt", "").encode(), digest_size=2).hexdigest()
        prefix = (prefix_tokens or {}).get(family) or _tokens(
            rec.get("system_prompt", "") + json.dumps(rec.get("tools", []))) or 1
        steps = []
        recs = rec.get("steps", [])
        for j, s in enumerate(recs):
            last = j == len(recs) - 1
            call = json.dumps(s.get("call", {}))
            steps.append(StepSpec(
                output_tokens=int(s.get("output_tokens", 16)),
                result_tokens=_tokens(call + str(s.get("result", ""))),
                pause_kind="" if last else f"tool:{s.get('call', {}).get('name', 'call')}",
                pause_s=0.0 if last else float(s.get("pause_s", 0.0))))
        out.append(JobSpec(job_id=f"t{i:05d}", family=family, prefix_tokens=max(1, prefix),
                           task_tokens=_tokens(json.dumps(rec.get("task", ""))), steps=steps,
                           arrival_s=t))
        t += rng.expovariate(1.0 / mean_gap_s)
    return out
