"""``python -m warmloop.infra.demo_model {data,train,model,evaluate}``.

- ``data``: write the transcripts and held-out cases (seeded) under ``--data-dir``.
- ``train``: train on them and export the artifact (with PROVENANCE.json).
- ``model``: both (``make model``).
- ``evaluate``: the held-out table through a real engine (``make eval-model``); its last
  line is one JSON object with ``ticket_whole_task``, ``invoice_whole_task`` and
  ``tool_call_validity``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import fields
from pathlib import Path

from warmloop.infra.demo_model import ARTIFACT_DIR

DEFAULT_DATA_DIR = Path(".warmloop/demo-model-data")
DATA_DEFAULTS = {"seed": 0, "n_tickets": 1600, "n_invoices": 900, "n_heldout_tickets": 120,
                 "n_heldout_invoices": 60}


def _data(args: argparse.Namespace) -> dict[str, object]:
    from warmloop.infra.demo_model.data import write_dataset

    print(f"writing transcripts to {args.data_dir} ...", flush=True)
    info = write_dataset(args.data_dir, seed=args.seed, n_tickets=args.n_tickets,
                         n_invoices=args.n_invoices, n_heldout_tickets=args.n_heldout_tickets,
                         n_heldout_invoices=args.n_heldout_invoices,
                         log=lambda m: print(m, flush=True))
    print(json.dumps(info), flush=True)
    return info


def _train(args: argparse.Namespace, data_info: dict[str, object] | None) -> None:
    from warmloop.infra.demo_model.train import TrainConfig, train

    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig)
                 if getattr(args, f.name, None) is not None}
    cfg = TrainConfig(**overrides)
    previous = (json.loads((Path(cfg.init_from) / "PROVENANCE.json").read_text())
                if cfg.init_from else None)
    prov = train(args.data_dir, args.out, cfg, log=lambda m: print(m, flush=True))
    if previous is not None:
        prov["previous_stage"] = previous
        prov["total_wall_time_s"] = round(prov["wall_time_s"] + previous.get(
            "total_wall_time_s", previous["wall_time_s"]), 1)
        prov["total_steps"] = cfg.steps + previous.get("total_steps", previous["steps"])
    prov["data"] = {k: getattr(args, k) for k in DATA_DEFAULTS}
    if data_info is not None:
        prov["data"].update(data_info)
    else:  # trained on data written earlier: its held-out cases as they are on disk
        import hashlib

        prov["data"]["heldout_sha256"] = hashlib.sha256(
            (args.data_dir / "heldout.jsonl").read_bytes()).hexdigest()
    prov["command"] = "python -m warmloop.infra.demo_model " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    prov["rebuild"] = "make model-large" if cfg.widen_by > 1 or cfg.deepen_to else "make model"
    (args.out / "PROVENANCE.json").write_text(json.dumps(prov, indent=1, sort_keys=True) + "\n")
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"artifact: {args.out} ({size / 1e6:.1f} MB), trained in {prov['wall_time_s']}s",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m warmloop.infra.demo_model")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("data", "train", "model", "evaluate"):
        p = sub.add_parser(name)
        p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
        if name in ("data", "model"):
            for k, v in DATA_DEFAULTS.items():
                p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
        if name in ("train", "model"):
            p.add_argument("--out", type=Path, default=ARTIFACT_DIR)
            for k in ("steps", "batch_tokens", "hidden_size", "layers", "threads",
                      "checkpoint_every", "deepen_to", "widen_by"):
                p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
            p.add_argument("--lr", type=float, default=None)
            p.add_argument("--full-prefix-share", type=float, default=None)
            p.add_argument("--syntax-weight", type=float, default=None)
            p.add_argument("--context-weight", type=float, default=None)
            p.add_argument("--widen-noise", type=float, default=None)
            p.add_argument("--warmup", type=int, default=None)
            p.add_argument("--init-from", type=str, default=None)
        if name == "train":
            for k, v in DATA_DEFAULTS.items():
                p.add_argument("--" + k.replace("_", "-"), type=int, default=v,
                               help="recorded in PROVENANCE.json (what `data` was run with)")
        if name == "evaluate":
            p.add_argument("--model", type=Path, default=ARTIFACT_DIR)
            p.add_argument("--port", type=int, default=8790)
            p.add_argument("--tickets", type=int, default=None)
            p.add_argument("--invoices", type=int, default=None)
            p.add_argument("--concurrency", type=int, default=4)
            p.add_argument("--json-out", type=Path, default=None)
            p.add_argument("--temperature", type=float, default=None,
                           help="sample every step at this temperature instead of the "
                                "profile's (0: greedy; a diagnostic)")
            p.add_argument("--ungrounded", action="store_true",
                           help="let the model write id arguments freely (no grounding)")
            p.add_argument("--split", choices=("heldout", "bundled", "fresh"),
                           default="heldout",
                           help="heldout: unseen phrasings, names and ids (the targets); "
                                "bundled: the tasks `make demo` runs (in training); fresh: "
                                "new cases from training's phrasings (a diagnostic)")
    args = parser.parse_args(argv)
    if args.cmd == "data":
        _data(args)
    elif args.cmd == "train":
        _train(args, None)
    elif args.cmd == "model":
        _train(args, _data(args))
    else:
        from warmloop.infra.demo_model.evaluate import evaluate, summary_line, table

        heldout = args.data_dir / "heldout.jsonl"
        if not heldout.exists():
            from warmloop.infra.demo_model.data import write_dataset

            print(f"no held-out cases at {heldout}: writing the data set first", flush=True)
            write_dataset(args.data_dir, **{k: v for k, v in DATA_DEFAULTS.items()})
        if args.split != "heldout":
            from warmloop.infra.demo_model.data import split_cases_file

            heldout = split_cases_file(args.split, args.data_dir)
        result = evaluate(args.model, heldout, port=args.port, n_tickets=args.tickets,
                          n_invoices=args.invoices, concurrency=args.concurrency,
                          grounded=not args.ungrounded, temperature=args.temperature,
                          log=lambda m: print(m, flush=True))
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=1))
        for f in result["failures"][:8]:
            print("failed:", json.dumps(f), flush=True)
        print(f"prompt token ids checked against the engine: {result['prompt_checks']} steps, "
              f"{result['prompt_mismatches']} differ; raw call arguments not in canonical "
              f"form: {result['raw_args_not_canonical']}", flush=True)
        print(table(result), flush=True)
        print(summary_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
