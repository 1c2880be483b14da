"""The configurations of bench-routing, bench-pauses and bench-burst, as simulations on
the CPU engines' calibration (``CPU_TINY``), so the simulator can be checked against
the measured runs.

Sizes come from the benches' own arguments and, for token counts the benches do not
fix, from the inference workers' ``step_generated`` logs of recorded runs (median
prompt tokens by step: 1,549 at step 1 growing ~87 a step on the synthetic profiles).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from warmloop.sim.core import Clock
from warmloop.sim.engine import HostSharing
from warmloop.sim.fleet import Fleet, FleetConfig, Policy
from warmloop.sim.run import Summary, pct, simulate, summarize
from warmloop.sim.workload import JobSpec, PauseModel, StepSpec
from warmloop.workflows.calibration import (
    CPU_TINY,
    DecodePoint,
    EngineCalibration,
    PrefillPoint,
)
from warmloop.workflows.contracts import Lane
from warmloop.workflows.holding import HoldConfig
from warmloop.workflows.lanes import AdmissionConfig
from warmloop.workflows.routing import RoutingConfig

MIB = 1024 * 1024
CPU_HOST = HostSharing(engines_per_host=2, slowdown=1.44)
"""The CPU benches' two engines share the host's two cores with the workers and
Temporal: `make bench-contention` (raw vLLM, no warmloop in the path; two runs,
2026-12-05) put a probe's TTFT p50 on one engine at 32.7 / 34.2 ms while the other
served four batch streams, against 23.7 / 22.8 ms with it idle: 1.38x / 1.50x, the
mean 1.44x. It barely enters bench-routing, whose engines step ~12 % of the time (whose
logs ``CPU_TINY_LOADED`` was fitted to); it paces bench-burst, whose engines never rest."""
CPU_FLEET = FleetConfig(pre_step_s=0.021, post_step_s=0.013, between_steps_s=0.023,
                        routing=RoutingConfig(), hold=None, host_sharing=CPU_HOST)
"""warmloop's own stages per step under bench-routing's load (2026-12-04, the embedded
Temporal tuned for sub-second timers; `make bench-routing`'s step breakdown, means over
the warmloop runs' steps): routing 11.9 + schedule-to-start 4.0 + pickup 5.0 + prompt
0.3 ms before the engine, after-token 6.5 + return 6.4 ms after it, and 0.023 s a pause
beyond the pause itself (a job's wall time less its stages and scripted pauses, median
over 120 jobs; 0.60 s while every sub-second timer fired ~1 s late, 0.155 s while the
timer queue's reads were rate-limited). The routing and hold configs are the defaults
the benches ran with; the engines share the host as ``CPU_HOST`` says."""

CPU_TINY_LOADED = CPU_TINY.model_copy(update={
    "source": ("derived for the benches' load from the inference workers' step_generated "
               "logs of two bench-routing runs (2026-12-04, 2,840-2,919 steps each): TTFT "
               "~41 ms past the step's own decode at ~150 uncached tokens, +1 ms per "
               "24-28 uncached tokens beyond (95-108 ms at ~1,550); decode 4.4-5.8 ms a "
               "token at the bench's batch sizes (medians); larger batches from the "
               "engines' own logs under bench-burst (~300-400 tokens/s at 8-16 running)"),
    "step_overhead_s": 0.036,
    "decode": CPU_TINY.decode[:1] and (
        DecodePoint(batch_size=1, step_s=0.005), DecodePoint(batch_size=8, step_s=0.022),
        DecodePoint(batch_size=32, step_s=0.06), DecodePoint(batch_size=64, step_s=0.11)),
})
"""The embedded engines as the benchmarks load them: two engines, the workers, Temporal,
Redis and S3 on two cores, so every request waits behind the others' CPU work."""

SYNTHETIC_PREFIX = 1_472
SYNTHETIC_TASK = 77
SYNTHETIC_GROWTH = 87


@dataclass(frozen=True)
class PausesSizes:
    """bench-pauses' prompts in tokens, as the CPU engines' tiny model counts them. The
    bench's task (a case id and 40 words) and its calls are not bench-routing's, and
    which block a prompt ends in decides what a pre-warm or a resumed step recomputes:
    a pre-warm recomputes its prompt's partial last block."""

    task: int = 57
    tail: int = 21
    """The step's volatile tail (the budget line and the generation prompt)."""
    review_extra: int = 56
    """synthetic-review's prefix beyond synthetic-support's (its escalate tool)."""
    lookup: int = 85
    """A lookup's call and result (70-105 by key; the mean)."""
    escalation: int = 33
    """An escalation's call and the reviewer's answer (32-37)."""
    task_opening: int = 0
    """Of ``task``, the opening every job's task starts with (its JSON's first key and
    the case id's leading characters): the family's prefix as the engines' cache sees it
    ends there, so a review job's first step finds 1,536 tokens another review job left
    (12 blocks), where the prefix alone fills 11."""
    escalate_call: int | None = 22
    """Of ``escalation``, the call: what the approval's pre-warms send (None: not told
    apart, the pre-warm sends the next step's whole prompt)."""


PAUSES_SIZES = PausesSizes(task_opening=8)
"""Measured: bench-pauses' `--jobs-json` of 2026-12-05 (first steps 1,550 / 1,606 tokens,
support / review; growth after a lookup 84.8 on average over 204 steps, after an
escalation 33.3 over 36; an approval's pre-warm 7 tokens past the step before it: the
call and an empty tail turn for the step's tail). The task's opening: runs 10 and 11
(2026-12-06), where a review job's first step found 1,536 tokens cached or nothing (41
and 31 of 72; 12 blocks, the prefix's 11 and the 12th its last 120 tokens and the task's
first 8) and a support job's 1,408 or nothing (198 and 18 of 216)."""
PAUSES_SIZES_BEFORE = PausesSizes(task=SYNTHETIC_TASK, tail=24, review_extra=60,
                                  lookup=SYNTHETIC_GROWTH, escalation=SYNTHETIC_GROWTH - 40,
                                  escalate_call=None)
"""bench-routing's sizes, which the simulated bench-pauses used before 2026-12-05."""


def cpu_engines(kv_bytes: int, n: int = 2,
                calibration: EngineCalibration = CPU_TINY_LOADED) -> list[EngineCalibration]:
    return [calibration.with_kv_pool_bytes(kv_bytes)] * n


# --- bench-routing -----------------------------------------------------------------------

ROUTING_POLICIES = {
    "warmloop": Policy("warmloop", "cache_aware", "never", False, False),
    "round_robin": Policy("round_robin", "round_robin", "never", False, False),
    "least_loaded": Policy("least_loaded", "least_loaded", "never", False, False),
}


def routing_jobs(seed: int = 7, n_jobs: int = 40, mean_gap_s: float = 1.9) -> list[JobSpec]:
    """bench-routing's seeded workload (the same draws as ``bench.routing.workload``):
    a hot profile with half the jobs, 6-10 steps, scripted lookups with their seeded
    pauses (lognormal median 0.4 s, sigma 0.6, at most 3 s)."""
    try:  # the bench's own vocabulary, so the draws match its workload exactly
        from bench.synthetic_profiles import SYNTHETIC_DOMAINS, WORDS
    except ImportError:  # installed without the repository's bench/: same shape
        SYNTHETIC_DOMAINS, WORDS = ("support", "billing", "legal", "logistics"), tuple(
            f"w{i}" for i in range(125))
    rng = random.Random(seed)
    hot, *others = [f"synthetic-{d}" for d in SYNTHETIC_DOMAINS]
    pauses = PauseModel(median_s=0.4, sigma=0.6, max_s=3.0)
    out, t = [], 0.0
    for i in range(n_jobs):
        profile = hot if rng.random() < 0.5 else rng.choice(others)
        words = rng.randint(30, 50)
        _ = [rng.choice(WORDS) for _ in range(words)]
        steps = rng.randint(6, 10)
        # the lookup's pause as bench/synthetic_tools.py draws it: seeded by (profile,
        # case, step, tool), so each job pauses exactly as in the bench
        specs = [StepSpec(output_tokens=12, result_tokens=SYNTHETIC_GROWTH,
                          pause_kind="" if k == steps - 1 else "tool:lookup",
                          pause_s=0.0 if k == steps - 1 else pauses.draw(
                              random.Random(f"{profile}/S{i:04d}/{k + 1}/lookup")))
                 for k in range(steps)]
        out.append(JobSpec(job_id=f"r{i:03d}", family=profile, prefix_tokens=SYNTHETIC_PREFIX,
                           task_tokens=SYNTHETIC_TASK + (words - 40), steps=specs,
                           arrival_s=t, tail_tokens=24))
        t += rng.expovariate(1.0 / mean_gap_s)
    return out


def bench_routing(mean_gap_s: float = 1.9, *,
                  fleet: FleetConfig = CPU_FLEET) -> dict[str, Summary]:
    engines = cpu_engines(16 * MIB)
    return {name: simulate(routing_jobs(mean_gap_s=mean_gap_s), engines, pol, config=fleet)
            for name, pol in ROUTING_POLICIES.items()}


# --- bench-pauses ------------------------------------------------------------------------

PAUSES_POLICIES = {
    "release": Policy("release", "cache_aware", "never", False, True),
    "hold": Policy("hold", "cache_aware", "always_hold", False, True),
    "warmloop": Policy("warmloop", "cache_aware", "cost_model", False, True),
}


PAUSES_TOOL = PauseModel(median_s=3.0, sigma=0.5, long_share=0.1, long_min_s=20,
                         long_max_s=60, max_s=60)
"""bench-pauses' tool pauses: lognormal, median 3 s, a tenth of them 20-60 s."""


PAUSES_APPROVAL_NOTICE_S = (0.32, 2.34)
"""bench-pauses' reviewer notices an approval this long after its request (uniform; the
simulator's ``FleetConfig.approval_notice_s``): the bench's reviewer polls the jobs every
half second, a query each, and signals the view and the decision. Fitted to runs 10 and
11 (2026-12-06): their approvals' pre-warms, set against the plan's view and decision
times after each step, came 0.91 / 1.32 / 1.92 s late at the quartiles (425 pre-warms);
the simulator's own stages add 0.08 s, and a uniform range with those quartiles less
0.08 s is this one (``python -m bench.sim_fidelity --pauses-logs DIR`` fits it from a
run's logs). Without it every pre-warm came when the plan says, inside the
3.6-4.5 s in which the review family's prefix outlives the background's churn more often
than the bench's did (release pre-warms found nothing 3.0 times a run against 5.7)."""


def pauses_jobs(seed: int = 11, n_jobs: int = 16, steps: int = 6, review_every: int = 4,
                gap_s: float = 1.5, *, tool: PauseModel = PAUSES_TOOL,
                approval_s: tuple[float, float] = (10.0, 20.0),
                viewed_before_s: float = 5.0,
                sizes: PausesSizes = PAUSES_SIZES) -> list[JobSpec]:
    """bench-pauses' jobs: synthetic-support (lookups) and every 4th synthetic-review (an
    escalation on about half its steps, waiting ``approval_s`` for a reviewer who opens
    it ``viewed_before_s`` before deciding). The bench replays these very plans (its
    scripted workload, ``bench/pauses.py``), so the simulator and the engines see the same
    calls, pauses and approvals; ``sizes``, their prompts' tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n_jobs):
        review = i % review_every == 0
        specs = []
        for k in range(steps):
            last = k == steps - 1
            approval = review and not last and rng.random() < 0.5
            if approval:
                due = rng.uniform(*approval_s)
                specs.append(StepSpec(output_tokens=12, result_tokens=sizes.escalation,
                                      pause_kind="approval:escalation", pause_s=due,
                                      approval=True, call_tokens=sizes.escalate_call,
                                      viewed_after_s=max(0.0, due - viewed_before_s)))
            else:
                specs.append(StepSpec(output_tokens=12, result_tokens=sizes.lookup,
                                      pause_kind="" if last else "tool:lookup",
                                      pause_s=0.0 if last else tool.draw(rng)))
        family = "synthetic-review" if review else "synthetic-support"
        out.append(JobSpec(job_id=f"p{i:03d}", family=family, prefix_tokens=SYNTHETIC_PREFIX
                           + (sizes.review_extra if review else 0) + sizes.task_opening,
                           task_tokens=sizes.task - sizes.task_opening,
                           steps=specs, arrival_s=i * gap_s, tail_tokens=sizes.tail,
                           prior={"tool:lookup": (1.0, 5.0),
                                  "approval:escalation": (120.0, 600.0)}))
    return out


def sized_by_prompts(jobs: list[JobSpec], prompts: Mapping[str, Sequence[int]]
                     ) -> list[JobSpec]:
    """``jobs`` with each call's own size, where ``prompts`` has its job: every step's
    prompt tokens as the engines counted them (bench-pauses' ``--jobs-json``, the same in
    every repeat of a scripted run). A job's task is its first prompt less its prefix and
    tail; a step's result, what the next prompt grew by; the last step's keeps its
    planned size (no prompt follows it). The plans' mean sizes put a prompt's last
    partial block, which a pre-warm or a resumed step recomputes, where the mean puts it
    and not where the call's own text does."""
    out = []
    for job in jobs:
        sizes = prompts.get(job.job_id)
        if sizes is None:
            out.append(job)
            continue
        if len(sizes) != len(job.steps):
            raise ValueError(f"job {job.job_id}: {len(sizes)} prompt sizes for "
                             f"{len(job.steps)} steps; give one per step")
        task = sizes[0] - job.prefix_tokens - job.tail_tokens
        if task < 0:
            raise ValueError(f"job {job.job_id}: a first prompt of {sizes[0]} tokens is "
                             f"shorter than its prefix and tail "
                             f"({job.prefix_tokens + job.tail_tokens})")
        steps = []
        for k, st in enumerate(job.steps):
            grew = sizes[k + 1] - sizes[k] if k + 1 < len(sizes) else st.result_tokens
            if grew < (st.call_tokens or 0):
                raise ValueError(f"job {job.job_id} step {k + 1}: the prompt grew by "
                                 f"{grew} tokens, less than the step's call "
                                 f"({st.call_tokens}); the sizes are not this plan's")
            steps.append(replace(st, result_tokens=grew))
        out.append(replace(job, task_tokens=task, steps=steps))
    return out


def bench_pauses(*, hold: HoldConfig | None = HoldConfig(),
                 calibration: EngineCalibration = CPU_TINY_LOADED,
                 bg_rate: float = 3.49, bg_tokens: int = 532,
                 learned: bool = True,
                 sizes: PausesSizes = PAUSES_SIZES,
                 hold_pricing: Sequence[EngineCalibration] | None = None,
                 bg_phase: float = 0.0,
                 prompts: Mapping[str, Sequence[int]] | None = None,
                 approval_notice_s: tuple[float, float] = PAUSES_APPROVAL_NOTICE_S,
                 on_fleet: Callable[[str, Fleet], None] | None = None,
                 fleet: FleetConfig = CPU_FLEET) -> dict[str, Summary]:
    """The three hold policies; ``hold`` HoldConfig() (default): the hard-coded rates the
    bench ran with; None: the hold model priced by ``calibration`` (issue 19's change).
    ``learned``: every policy starts from the plans' own pauses already observed, as the
    bench seeds its stack's statistics (False: from the profiles' priors, the bench
    before 2026-12-05 on a fresh stack). ``bg_rate`` / ``bg_tokens``: the background
    traffic per engine as the bench sizes it (its JSON's ``bg_rate_per_engine`` and
    ``bg_prompt_tokens``; 3.5 / 640 before 2026-12-05: 20 % more fresh blocks a second
    than the bench wrote). ``sizes``: the prompts' tokens (``PAUSES_SIZES_BEFORE``: as
    simulated before 2026-12-05). ``hold_pricing``: per engine, what the bench's
    ``warmloop calibrate`` measured (``measured_pricing``), which the workers' hold model
    prices by (None: the engines' loaded curves). ``bg_phase``: where in its interval the
    background's first request falls (0-1; the bench's repeats start at other phases).
    ``prompts``: each job's prompt tokens step by step as a run measured them
    (``sized_by_prompts``; None: ``sizes`` alone). ``approval_notice_s``: how late the
    bench's reviewer notices an approval (``PAUSES_APPROVAL_NOTICE_S``). ``on_fleet``:
    told each policy's fleet before it runs (its steps, step by step, for
    ``bench.sim_fidelity --pauses-jobs``). ``fleet``: the stages and host (``CPU_FLEET``)."""
    engines = cpu_engines(16 * MIB, calibration=calibration)
    # every phase its own reviewer's lateness, as each of the bench's repeats had
    cfg = replace(fleet, hold=hold, hold_pricing=hold_pricing,
                  approval_notice_s=approval_notice_s,
                  approval_notice_seed=round(bg_phase * 1_000_000))
    out = {}
    for name, pol in PAUSES_POLICIES.items():
        jobs = pauses_jobs(sizes=sizes)
        if prompts is not None:
            jobs = sized_by_prompts(jobs, prompts)
        horizon = max(j.arrival_s for j in jobs) + 400.0

        def setup(fleet: Fleet, horizon: float = horizon,
                  jobs: list[JobSpec] = jobs, name: str = name) -> None:
            if learned:
                fleet.learn_pauses((kind, sec) for _, kind, sec in plan_pauses(jobs))
            fleet.background(rate_per_engine_s=bg_rate, prompt_tokens=bg_tokens,
                             output_tokens=4, until_s=horizon, phase=bg_phase)
            fleet.on_job_end.append(lambda _s: _stop_when_done(fleet))
            if on_fleet is not None:
                on_fleet(name, fleet)

        out[name] = simulate(jobs, engines, pol, config=cfg, setup=setup)
    return out


def measured_pricing(calibration: dict[str, Any], kv_bytes: int = 16 * MIB
                     ) -> list[EngineCalibration]:
    """The engines' calibrations as a bench measured them (its JSON's ``calibration``:
    per engine, ``prefill_tokens_per_s`` by prompt length), in engine order, on the
    embedded engines' preset for the rest (price, pool, block)."""
    base = CPU_TINY.with_kv_pool_bytes(kv_bytes)
    out = []
    for engine in sorted(calibration):
        rates = calibration[engine]["prefill_tokens_per_s"]
        out.append(base.model_copy(update={
            "source": f"{engine} as measured: {calibration[engine].get('source', '')}",
            "prefill": tuple(PrefillPoint(prompt_tokens=int(n), tokens_per_s=float(r))
                             for n, r in sorted(rates.items(), key=lambda kv: int(kv[0])))}))
    return out


def plan_pauses(jobs: list[JobSpec], min_each: int = 20) -> list[tuple[str, str, float]]:
    """Every pause the plans wait, ``(family, kind, seconds)``, as many whole times over
    as it takes each family's kind to reach ``min_each`` samples: what a stack that ran
    them until its hold model stopped deciding on the profiles' priors
    (``PauseDistribution.min_samples``, 20) has learned. Once is not enough for
    bench-pauses' ~10 escalations a run, and the prior (a median of 2 minutes, for a
    human) releases them."""
    once = [(j.family, st.pause_kind, st.pause_s)
            for j in jobs for st in j.steps if st.pause_kind]
    if not once:
        return []
    fewest = min(Counter((family, kind) for family, kind, _ in once).values())
    return once * max(1, -(-min_each // fewest))


def _stop_when_done(fleet: Fleet) -> None:
    if all(not math.isnan(j.end_s) for j in fleet.jobs) and len(fleet.jobs) >= 16:
        fleet.background_stopped = True


# --- bench-burst -------------------------------------------------------------------------

BURST_POLICIES = {
    "naive": Policy("naive", "round_robin", "never", False, False),
    "lanes": Policy("lanes", "cache_aware", "never", True, False),
}


@dataclass(frozen=True)
class BurstProfile:
    """One bundled profile's jobs in bench-burst, as the CPU engines' tiny model counts
    them. The engines' blocks are 128 tokens, so where a profile's shared prompt ends
    decides what a job recomputes: the mix's mean prompt alone (1,632 tokens) put both
    profiles' first steps ~100 tokens past their cached prefix, where each is ~95."""

    shared_prefix: int
    """The profile's prompt every job shares, in the full blocks the engines cached for
    it (what a first step on a warm engine found cached)."""
    first_prompt: int
    """A job's first prompt (mean)."""
    output_tokens: tuple[int, int]
    """A step's decoded tokens (uniform range around the measured mean)."""
    result_tokens: tuple[int, int]
    """What a step adds to the transcript: its call and the tool's answer."""


BURST_TAIL = 24
BURST_PROFILES = {
    "ticket-triage": BurstProfile(shared_prefix=1_280, first_prompt=1_377,
                                  output_tokens=(44, 76), result_tokens=(46, 78)),
    "invoice-reconciliation": BurstProfile(shared_prefix=1_792, first_prompt=1_888,
                                           output_tokens=(60, 92), result_tokens=(35, 67)),
}
"""bench-burst's jobs, from the steps of `make bench-burst ARGS="--steps-json F"`
(2026-12-05, 498 naive and 496 lanes steps): tickets' first prompts 1,377 tokens of
which 1,280 cached on a warm engine, each step adding ~62 and decoding ~60; invoices'
1,888 with 1,792 cached, adding ~51 and decoding ~76 (means over both phases, which
agree within 3 tokens)."""

BURST_PROFILES_BEFORE = {
    "ticket-triage": BurstProfile(shared_prefix=1_450, first_prompt=1_574,
                                  output_tokens=(48, 112), result_tokens=(60, 260)),
    "invoice-reconciliation": BurstProfile(shared_prefix=1_650, first_prompt=1_774,
                                           output_tokens=(48, 112), result_tokens=(60, 260)),
}
"""The sizes the pinned simulator baselines were recorded with (round guesses, the two
profiles alike but for the prefix)."""


def _bundled_job(job_id: str, profile: str, steps: int, rng: random.Random, lane: Lane,
                 arrival_s: float = 0.0,
                 profiles: Mapping[str, BurstProfile] = BURST_PROFILES) -> JobSpec:
    sizes = profiles[profile]
    specs = [StepSpec(output_tokens=int(rng.uniform(*sizes.output_tokens)),
                      result_tokens=int(rng.uniform(*sizes.result_tokens)),
                      pause_kind="" if k == steps - 1 else "tool:call",
                      pause_s=0.0 if k == steps - 1 else rng.uniform(0.01, 0.1))
             for k in range(steps)]
    return JobSpec(job_id=job_id, family=profile, prefix_tokens=sizes.shared_prefix,
                   task_tokens=sizes.first_prompt - sizes.shared_prefix - BURST_TAIL,
                   steps=specs, arrival_s=arrival_s, lane=lane, tail_tokens=BURST_TAIL,
                   prior={"tool:call": (0.05, 0.2)})


def bench_burst(n_jobs: int = 100, steps: int = 5, window: int = 16, trickle_gap_s: float = 2.0,
                ttft_target_ms: float = 300.0, *,
                profiles: Mapping[str, BurstProfile] = BURST_PROFILES,
                fleet: FleetConfig = CPU_FLEET,
                on_fleet: Callable[[str, Fleet], None] | None = None) -> dict[str, Summary]:
    """100 ticket+invoice jobs of 5 steps on 24 MiB pools: naive (all at once,
    round-robin, no lanes) vs two BatchRuns of window 16 in the batch lane; a trickle of
    interactive 3-step ticket jobs every 2 s alongside. Figures are the burst's; the
    jobs' sizes are ``profiles``; ``fleet``: the stages and host (``CPU_FLEET``);
    ``on_fleet``: told each policy's fleet before it runs, as ``bench_pauses``'s."""
    engines = cpu_engines(24 * MIB)
    cfg = replace(fleet, admission=AdmissionConfig(
        interactive_ttft_target_ms=ttft_target_ms, k_min=1, k_start=4, k_max=16))
    return {name: _burst_run(name, pol, engines, cfg, n_jobs, steps, window, trickle_gap_s,
                             profiles, on_fleet)
            for name, pol in BURST_POLICIES.items()}


def _burst_run(name: str, pol: Policy, engines: list[EngineCalibration], cfg: FleetConfig,
               n_jobs: int, steps: int, window: int, trickle_gap_s: float,
               profiles: Mapping[str, BurstProfile],
               on_fleet: Callable[[str, Fleet], None] | None) -> Summary:
    rng = random.Random(5)
    half = n_jobs // 2
    burst = [_bundled_job(f"b{i:03d}", "ticket-triage" if i < half else
                          "invoice-reconciliation", steps, rng,
                          Lane.BATCH if name == "lanes" else Lane.INTERACTIVE,
                          profiles=profiles)
             for i in range(n_jobs)]
    clock = Clock()
    fleet = Fleet(clock, engines, pol, cfg)
    if on_fleet is not None:
        on_fleet(name, fleet)
    if name == "lanes":
        fleet.add_batch(burst[:half], window=window)
        fleet.add_batch(burst[half:], window=window)
    else:
        fleet.add_jobs(burst)
    ids = {b.job_id for b in burst}
    state = {"open": True}

    def trickle(k: int = 0) -> None:
        if not state["open"]:
            return
        fleet.add_jobs([_bundled_job(f"i{k:04d}", "ticket-triage", 3, rng,
                                     Lane.INTERACTIVE, clock.now, profiles)])
        clock.after(trickle_gap_s, trickle, k + 1)

    def ended(_stat: object) -> None:
        mine = [j for j in fleet.jobs if j.job_id in ids]
        if len(mine) == len(ids) and all(not math.isnan(j.end_s) for j in mine):
            state["open"] = False

    fleet.on_job_end.append(ended)
    clock.at(0.0, trickle)
    clock.run()
    s = summarize(fleet, clock)
    burst_steps = [st for st in fleet.steps if st.job_id in ids]
    done = [j for j in fleet.jobs if j.job_id in ids]
    s.prefill_tokens = sum(st.prompt_tokens - st.cached_tokens for st in burst_steps)
    s.prompt_tokens = sum(st.prompt_tokens for st in burst_steps)
    s.cached_tokens = sum(st.cached_tokens for st in burst_steps)
    s.hit_rate = s.cached_tokens / max(1, s.prompt_tokens)
    s.makespan_s = max(j.end_s for j in done) - min(j.arrival_s for j in done)
    s.job_p95_s = pct([j.end_s - j.arrival_s for j in done], 0.95)
    s.ttft_p95_ms = pct([st.ttft_s * 1000 for st in fleet.steps if st.job_id not in ids], 0.95)
    return s
