"""`make replay-demo`: `warmloop replay` on the 40-job trace, twice, on a stack of its own.

Each run replays every job of bench/traces/tickets-40.jsonl with warmloop's routing and
with round-robin, side by side, from cold caches (the real CLI, as a user runs it).
The two runs must print the same prompt digest: the replay sends the same prompts
whatever the engines generate and wherever the steps are routed. The stack uses ports
and state apart from `warmloop dev up`'s and is taken down afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.common import bench_settings, bench_stack, run_main
from bench.make_trace import DEFAULT_OUT
from warmloop.infra.stack import settings_env


def replay_once(trace: Path, env: dict[str, str], window: int, routings: list[str]
                ) -> dict[str, Any]:
    """One `warmloop replay` run; its table goes to the terminal, its JSON line back."""
    argv = [sys.executable, "-m", "warmloop.workers.cli", "replay", str(trace),
            "--window", str(window)]
    for r in routings:
        argv += ["--routing", r]
    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=False)
    out = proc.stdout.rstrip("\n").splitlines()
    print("\n".join(out[:-1]), flush=True)
    if proc.returncode != 0 or not out:
        raise SystemExit(f"warmloop replay failed (exit {proc.returncode})")
    return dict(json.loads(out[-1]))


async def main_async(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    settings = bench_settings("replay", engines=args.engines,
                              kv_cache_bytes=args.kv_cache_bytes)
    env = {**os.environ, **settings_env(settings), "COLUMNS": "160"}
    runs = []
    async with bench_stack(settings, console, keep=args.keep_stack):
        for i in range(args.runs):
            console.print(f"[bold]run {i + 1} of {args.runs}[/]: warmloop replay {args.trace}")
            runs.append(await asyncio.to_thread(replay_once, args.trace, env, args.window,
                                                args.routing))
    return runs


def _default_routing(args: argparse.Namespace, console: Console) -> None:
    args.routing = args.routing or ["cache_aware", "round_robin"]


def _report(runs: list[dict[str, Any]], console: Console) -> dict[str, Any]:
    """The runs and whether every run and policy sent the same prompts."""
    digests = [[c["prompt_digest"] for c in r["configs"]] for r in runs]
    same = len({d for ds in digests for d in ds}) == 1
    console.print(f"prompt digests per run and policy: {digests} -> "
                  + ("[green]identical[/]" if same else "[red]DIFFERENT[/]"))
    return {"runs": runs, "same_prompts": same}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_OUT)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--routing", action="append", default=None,
                   help="routing policies to compare (default: cache_aware round_robin)")
    p.add_argument("--engines", type=int, default=2, choices=(1, 2))
    p.add_argument("--kv-cache-bytes", type=int, default=32 * 1024 * 1024,
                   help="KV pool per engine (2,048 bytes per token on the tiny model)")
    p.add_argument("--keep-stack", action="store_true", help="leave the stack running")
    out = run_main(p, main_async, argv, prepare=_default_routing, report=_report)
    if not out["same_prompts"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
