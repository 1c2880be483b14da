"""Training and held-out data: cases, their ground truth, and the transcripts of their
correct jobs rendered exactly as the engine sees them.

A *case* is a task plus the records it needs in the world (a new customer; a vendor,
invoices and a purchase order), its split and its ground truth (``world``). The bundled
tickets and invoices are cases of the ``bundled`` split and go into training (they are
what ``make demo`` runs); generated cases are ``train`` or ``heldout``. Held-out cases
use phrasings, names, customer ids, catalogue items and notes that training never sees
(``world.Phrases.heldout``, ``HELDOUT_CUSTOMER_IDS``), so the held-out figures measure
generalisation, not recall.

A transcript is made by running the case's correct calls through ``runtime.run_job``
with the oracle policy: every step's prompt is the inference worker's own request body
rendered with the model's chat template, and its target is the call the model must emit
(``runtime.call_text``). Stored per job as the profile's shared prefix (once per file),
the trunk (task and transcript) and, per step, where the step branches off the trunk,
its budget tail and its target; ``train.py`` packs each job into one sequence.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from warmloop.infra.demo_model import world as W
from warmloop.infra.demo_model.runtime import (
    INVOICE,
    TICKET,
    RequestBuilder,
    StepOutput,
    call_text,
    chat_inputs,
    load_profiles,
    run_job,
)

HELDOUT_CUSTOMER_IDS = frozenset(f"C{n:03d}" for n in random.Random(17).sample(
    [n for n in range(1000) if not 100 <= n <= 139], 150))
"""Customer ids only held-out cases use."""
HELDOUT_VENDOR_IDS = frozenset(f"V{n}" for n in range(900, 1000))
BUNDLED_INVOICE_NUMBERS = range(1001, 1021)
BUNDLED_PO_NUMBERS = range(4001, 4021)


@dataclass
class Case:
    """One task, what the world must hold for it, and its ground truth."""

    case_id: str
    profile: str
    split: str
    task: dict[str, Any]
    world: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Records added to the bundled world: ``customers``, ``vendors``, ``invoices``,
    ``purchase_orders``."""
    facts: dict[str, Any] | None = None
    """A ticket's ``world.TicketFacts``; an invoice's seeding plan (``plan``, and the
    discrepancy kinds it ``seeded``)."""
    max_steps: int | None = None

    def full_world(self, base: W.World) -> W.World:
        return W.World(customers={**base.customers, **self.world.get("customers", {})},
                       kb=base.kb,
                       vendors={**base.vendors, **self.world.get("vendors", {})},
                       invoices={**base.invoices, **self.world.get("invoices", {})},
                       purchase_orders={**base.purchase_orders,
                                        **self.world.get("purchase_orders", {})})

    def truth_calls(self, base: W.World) -> list[tuple[str, dict[str, Any]]]:
        """The correct calls, in order."""
        truth = truth_of(self, base)
        if isinstance(truth, W.TicketTruth):
            return truth.steps(self.task["customer_id"])
        return truth.steps(self.task)


def truth_of(case: Case, base: W.World) -> W.TicketTruth | W.InvoiceTruth:
    """The case's ground truth (the same function the demo's grader uses)."""
    wd = case.full_world(base)
    if case.profile == TICKET:
        assert case.facts is not None
        return W.ticket_truth(W.TicketFacts(**{**case.facts,
                                               "modifiers": tuple(case.facts["modifiers"])}),
                              wd.customers[case.task["customer_id"]])
    return W.invoice_truth(case.task, wd.invoices, wd.purchase_orders, wd.vendors)


# ---- tickets ----------------------------------------------------------------------------


def _customer(rng: random.Random, split: str) -> dict[str, Any]:
    first = rng.choice(W.FIRST_NAMES.pool(split))
    last = rng.choice(W.LAST_NAMES.pool(split))
    plan = rng.choices(["starter", "pro", "enterprise"], [3, 3, 3])[0]
    return {"name": f"{first} {last}", "open_tickets": rng.choices(range(8),
                                                                   [3, 4, 4, 3, 3, 2, 2, 1])[0],
            "plan": plan, "region": rng.choice(["eu", "us", "apac"]),
            "vip": rng.random() < 0.3}


def _fill(text: str, slots: dict[str, str]) -> str:
    return text.format(**slots) if "{" in text else text


def ticket_case(rng: random.Random, split: str, n: int) -> Case:
    """A generated ticket: a scenario, a customer (new or bundled), phrasing, modifiers."""
    names = [s for s in W.SCENARIOS if s not in ("vague", "cancel_only")]
    weights = [1.0] * len(names)
    scenario = rng.choices(names + ["vague", "cancel_only"], weights + [0.9, 0.7])[0]
    sc = W.SCENARIOS[scenario]
    base = W.bundled_world()
    world: dict[str, dict[str, Any]] = {}
    if split == "train" and rng.random() < 0.3:
        cid = rng.choice(sorted(base.customers))
    else:
        pool = sorted(HELDOUT_CUSTOMER_IDS) if split == "heldout" else [
            f"C{k:03d}" for k in range(1000)
            if f"C{k:03d}" not in HELDOUT_CUSTOMER_IDS and not 100 <= k <= 139]
        cid = rng.choice(pool)
        world["customers"] = {cid: _customer(rng, split)}
    modifiers: list[str] = []
    days: int | None = None
    amount: float | None = None
    slots = {"order": str(rng.randint(1000, 99999)), "item": rng.choice(W.ITEMS.pool(split))}
    if scenario == "parcel_late":
        days = rng.choice(W.SHORT_DAYS if rng.random() < 0.5 else W.LONG_DAYS)
        word = W.NUMBER_WORDS.get(days) if rng.random() < 0.4 else None
        slots["days"] = f"{word or days} days"
    if scenario == "refund_status":
        days, slots["when"] = rng.choice(W.RECENT_RETURN if rng.random() < 0.5
                                         else W.OLD_RETURN)
    body = [rng.choice(W.OPENERS.pool(split)),
            _fill(rng.choice(sc.bodies.pool(split)), slots)]
    if sc.refund and rng.random() < 0.5:
        amount = float(rng.choice([rng.randint(40, 480), rng.randint(520, 2500)]))
        body.append(rng.choice(W.REFUND_AMOUNT.pool(split)).format(amount=int(amount)))
    if sc.login and rng.random() < 0.35:
        modifiers.append("several_users")
    if sc.topic is not None and scenario != "cancel_only" and rng.random() < 0.08:
        modifiers.append("cancel_threat")
    if sc.topic is not None and scenario != "cancel_only" and rng.random() < 0.08:
        modifiers.append("repeat")
    if rng.random() < 0.05:
        modifiers.append("injection")
    for m in modifiers:
        body.append(rng.choice(W.MODIFIERS[m].pool(split)))
    body.append(rng.choice(W.CLOSERS.pool(split)))
    ticket = {"ticket_id": f"T{rng.randint(1000, 99999)}", "customer_id": cid,
              "subject": rng.choice(sc.subjects.pool(split)),
              "body": " ".join(p for p in body if p)}
    facts = asdict(W.TicketFacts(scenario=scenario, modifiers=tuple(modifiers), days=days,
                                 refund_amount=amount))
    return Case(case_id=f"{split}-ticket-{n:05d}", profile=TICKET, split=split, task=ticket,
                world=world, facts=facts, max_steps=_max_steps(rng, 8))


def _max_steps(rng: random.Random, default: int) -> int | None:
    return None if rng.random() < 0.8 else rng.randint(default - 1, default + 4)


def bundled_ticket_cases() -> list[Case]:
    from warmloop.workers.demo import bundled_tasks

    return [Case(case_id=f"bundled-{t['ticket_id']}", profile=TICKET, split="bundled",
                 task=dict(t),
                 facts=asdict(W.BUNDLED_TICKET_FACTS[str(t["ticket_id"])]))
            for t in bundled_tasks(TICKET)]


# ---- invoices ---------------------------------------------------------------------------


def _money(x: float) -> float:
    return round(x + 1e-9, 2)


def _lines(rng: random.Random, kind: str, split: str) -> list[dict[str, Any]]:
    items = list(W.CATALOG[kind])
    if split == "heldout":
        items += list(W.HELDOUT_CATALOG.get(kind, ()))
    chosen = rng.sample(items, rng.randint(1, min(4, len(items))))
    if split == "heldout" and kind in W.HELDOUT_CATALOG and rng.random() < 0.6:
        extra = rng.choice(W.HELDOUT_CATALOG[kind])
        if extra not in chosen:
            chosen[-1] = extra
    lines = []
    for i, (sku, desc, price) in enumerate(chosen, start=1):
        unit = _money(price * rng.uniform(0.85, 1.2)) if rng.random() < 0.6 else price
        qty = rng.choice([1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 24, 30, 40, 50, 60, 100])
        if unit > 1000:
            qty = rng.randint(1, 12)
        lines.append({"amount": _money(qty * unit), "description": desc, "line": i,
                      "qty": qty, "sku": sku, "unit_price": unit})
    return lines


def _total(lines: list[dict[str, Any]]) -> float:
    return _money(sum(ln["amount"] for ln in lines))


def _renumber(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**ln, "line": i} for i, ln in enumerate(lines, start=1)]


def invoice_case(rng: random.Random, split: str, n: int) -> Case:
    """A generated invoice with the discrepancies it was seeded with (or none)."""
    base = W.bundled_world()
    kind = rng.choice(sorted(W.CATALOG))
    vendors: dict[str, Any] = {}
    if split == "train" and rng.random() < 0.4:
        vendor_id = next(v for v, k in W.BUNDLED_VENDOR_KINDS.items() if k == kind)
    else:
        pool = (sorted(HELDOUT_VENDOR_IDS) if split == "heldout"
                else [f"V{k}" for k in range(300, 900)])
        vendor_id = rng.choice(pool)
        vendors[vendor_id] = {
            "currency": rng.choices(["EUR", "USD", "GBP"], [8, 1, 1])[0],
            "name": f"{rng.choice(W.VENDOR_NAMES.pool(split))} {W.VENDOR_SUFFIX[kind]}",
            "payment_terms": rng.choice(["net15", "net30", "net45", "net60"]),
            "status": "active"}
    currency = vendors.get(vendor_id, base.vendors.get(vendor_id, {})).get("currency", "EUR")
    inv_no = rng.randrange(1200, 10000)
    po_no = rng.choice([k for k in range(4100, 10000)])
    inv_id, po_id = f"INV{inv_no:04d}", f"PO{po_no:04d}"
    po_lines = _lines(rng, kind, split)
    while len(po_lines) < 2 and rng.random() < 0.5:
        po_lines = _lines(rng, kind, split)
    inv_lines = [dict(ln) for ln in po_lines]
    po = {"currency": currency, "lines": po_lines, "po_number": po_id, "status": "open",
          "total": _total(po_lines), "vendor_id": vendor_id}
    plan = rng.choices(
        ["match", "rounding", "price", "quantity", "missing", "extra", "duplicate",
         "vendor", "closed", "other_po", "combo", "no_invoice", "no_po"],
        [22, 8, 11, 10, 7, 7, 7, 3, 3, 3, 11, 3, 3])[0]
    invoices: dict[str, Any] = {}
    inv_po = po_id
    inv_vendor = vendor_id

    def price(ln: dict[str, Any]) -> None:
        pct = rng.choice([rng.uniform(0.01, 0.2), -rng.uniform(0.01, 0.15)])
        ln["unit_price"] = _money(ln["unit_price"] * (1 + pct))
        if ln["unit_price"] == po_lines[ln["line"] - 1]["unit_price"]:
            ln["unit_price"] = _money(ln["unit_price"] + 0.5)

    def quantity(ln: dict[str, Any]) -> None:
        ln["qty"] = max(1, ln["qty"] + rng.choice([-5, -2, -1, 1, 2, 3, 5, 10]))
        if ln["qty"] == po_lines[ln["line"] - 1]["qty"]:
            ln["qty"] += 1

    kinds = [plan]
    if plan == "combo":
        kinds = rng.sample(["price", "quantity", "missing", "extra"], 2)
    if "missing" in kinds and len(inv_lines) < 2:
        kinds = [k for k in kinds if k != "missing"] or ["extra"]
        plan = plan if plan == "combo" else "extra"
    if "price" in kinds:
        price(rng.choice(inv_lines))
    if "quantity" in kinds:
        quantity(rng.choice(inv_lines))
    if plan == "rounding":
        ln = rng.choice(inv_lines)
        bumped = _money(ln["unit_price"] * (1 + rng.choice([0.001, 0.002, 0.004, -0.003])))
        if abs(bumped - ln["unit_price"]) <= 0.005 * ln["unit_price"]:
            ln["unit_price"] = bumped
    for ln in inv_lines:
        ln["amount"] = _money(ln["qty"] * ln["unit_price"])
    if "missing" in kinds and len(inv_lines) >= 2:
        inv_lines.pop(rng.randrange(len(inv_lines)))
    if "extra" in kinds:
        desc = rng.choice(W.EXTRA_CHARGES.pool(split))
        unit = float(rng.choice([25, 40, 60, 85, 120, 150, 180, 240]))
        inv_lines.append({"amount": unit, "description": desc, "line": 0, "qty": 1,
                          "sku": f"SKU-9{rng.randint(0, 999):03d}", "unit_price": unit})
    if plan == "vendor":
        inv_vendor = rng.choice([v for v in W.BUNDLED_VENDOR_KINDS if v != vendor_id])
    if plan == "closed":
        po["status"] = rng.choice(["closed", "cancelled"])
    if plan == "other_po":
        inv_po = f"PO{rng.choice([k for k in range(4100, 10000) if k != po_no]):04d}"
    inv_lines = _renumber(inv_lines)
    invoice = {"currency": currency, "invoice_date": f"2025-{rng.randint(1, 12):02d}-"
               f"{rng.randint(1, 28):02d}", "invoice_id": inv_id, "lines": inv_lines,
               "po_number": inv_po, "total": _total(inv_lines), "vendor_id": inv_vendor}
    invoices[inv_id] = invoice
    if plan == "duplicate":
        earlier = f"INV{rng.randint(1100, inv_no - 1):04d}"
        invoices[earlier] = {**invoice, "invoice_id": earlier,
                             "invoice_date": "2025-01-02"}
    pos = {po_id: po}
    if plan == "no_invoice":
        invoices = {}
    if plan == "no_po":
        pos = {}
    task = {"invoice_id": inv_id, "vendor_id": inv_vendor, "po_number": po_id,
            "note": rng.choice(W.NOTES.pool(split))}
    seeded = sorted({SEEDED.get(k, "") for k in kinds} - {""})
    return Case(case_id=f"{split}-invoice-{n:05d}", profile=INVOICE, split=split, task=task,
                world={"vendors": vendors, "invoices": invoices, "purchase_orders": pos},
                facts={"plan": plan, "seeded": seeded}, max_steps=_max_steps(rng, 10))


SEEDED = {"price": "price_mismatch", "quantity": "quantity_mismatch", "missing": "missing_line",
          "extra": "extra_line", "duplicate": "duplicate_invoice", "vendor": "other",
          "closed": "other", "other_po": "other"}
"""The discrepancy kind each seeding plan must make ``compare_lines`` report."""


def bundled_invoice_cases() -> list[Case]:
    from warmloop.workers.demo import bundled_tasks

    return [Case(case_id=f"bundled-{t['invoice_id']}", profile=INVOICE, split="bundled",
                 task=dict(t)) for t in bundled_tasks(INVOICE)]


def cases(split: str, n_tickets: int, n_invoices: int, seed: int) -> list[Case]:
    """``n_tickets`` + ``n_invoices`` generated cases of ``split``, reproducibly."""
    rng = random.Random(f"{seed}-{split}")
    out = [ticket_case(rng, split, i) for i in range(n_tickets)]
    out += [invoice_case(rng, split, i) for i in range(n_invoices)]
    return out


# ---- transcripts ------------------------------------------------------------------------


def renderer() -> Any:
    """A tokenizer object that carries only the model's chat template: rendering is
    text, so transcripts can be written before the real tokenizer is trained on them."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from warmloop.infra.demo_model.tokenizer import CHAT_TEMPLATE

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"<s>": 0, "<unk>": 1}, unk_token="<unk>")), bos_token="<s>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def render(tok: Any, body: dict[str, Any], upto: int | None = None,
           generation: bool = True) -> str:
    messages, tools = chat_inputs(body)
    text = tok.apply_chat_template(messages[:upto], tools=tools,
                                   add_generation_prompt=generation, tokenize=False)
    assert isinstance(text, str)
    return text


@dataclass
class Transcript:
    """One correct job, split for packing (see the module docstring)."""

    case_id: str
    profile: str
    split: str
    trunk: str
    steps: list[dict[str, Any]]
    """``{"at": chars of trunk before the step's tail, "tail": str, "target": str}``"""


def _elapsed_fn(rng: random.Random) -> Any:
    times = [0.0]
    for _ in range(16):
        dt = rng.choice([rng.uniform(0.2, 3), rng.uniform(1, 15), rng.uniform(10, 120)])
        times.append(times[-1] + dt)
    start = rng.uniform(0, 1.5)
    return lambda steps: start + times[min(steps, 16)]


async def transcript(case: Case, base: W.World, builder: RequestBuilder, tok: Any,
                     rng: random.Random) -> tuple[Transcript, str]:
    """The case's correct job, rendered; and the profile's shared prefix text."""
    from warmloop.workflows.contracts import FunctionCall, ToolCall

    calls = case.truth_calls(base)
    prompts: list[str] = []

    async def oracle(step: int, body: dict[str, Any]) -> StepOutput:
        name, args = calls[step - 1]
        prompt = render(tok, body)
        prompts.append(prompt)
        call = ToolCall(id=f"chatcmpl-tool-{rng.getrandbits(64):016x}",
                        function=FunctionCall(name=name, arguments=json.dumps(args)))
        # Token counts only feed the budget line; about what the engine would report.
        return StepOutput(tool_calls=[call], prompt_tokens=int(len(prompt) / 3.6),
                          completion_tokens=len(call_text(name, args)) // 3)

    run = await run_job(profile_name=case.profile, task=case.task,
                        world=case.full_world(base), policy=oracle, builder=builder,
                        job_id=f"job-{case.case_id}", max_steps=case.max_steps,
                        elapsed=_elapsed_fn(rng))
    if run.state != "FINISHED" or len(run.bodies) != len(calls):
        raise AssertionError(f"{case.case_id}: the correct calls ended {run.state}: "
                             f"{run.reason}")
    prefix = render(tok, run.bodies[0], upto=1, generation=False)
    last = run.bodies[-1]
    trunk_full = render(tok, last, upto=len(last["messages"]) - 1, generation=False)
    steps: list[dict[str, Any]] = []
    for body, prompt, (name, args) in zip(run.bodies, prompts, calls, strict=True):
        pre = render(tok, body, upto=len(body["messages"]) - 1, generation=False)
        assert prompt.startswith(pre) and trunk_full.startswith(pre)
        assert pre.startswith(prefix)
        steps.append({"at": len(pre) - len(prefix), "tail": prompt[len(pre):],
                      "target": call_text(name, args)})
    for a, b in zip(steps, steps[1:], strict=False):
        between = trunk_full[len(prefix) + a["at"]:len(prefix) + b["at"]]
        assert between.startswith("<|assistant|>\n" + a["target"] + "\n"), between[:200]
    return Transcript(case.case_id, case.profile, case.split, trunk_full[len(prefix):],
                      steps), prefix


def write_dataset(out_dir: Path, *, seed: int, n_tickets: int, n_invoices: int,
                  n_heldout_tickets: int, n_heldout_invoices: int,
                  log: Any = print) -> dict[str, Any]:
    """Write ``train.jsonl`` (transcripts), ``prefixes.json`` and ``heldout.jsonl``
    (cases) under ``out_dir``; returns their SHA-256 and counts."""
    load_profiles()
    out_dir.mkdir(parents=True, exist_ok=True)
    base = W.bundled_world()
    train_cases = (bundled_ticket_cases() + bundled_invoice_cases()
                   + cases("train", n_tickets, n_invoices, seed))
    heldout = cases("heldout", n_heldout_tickets, n_heldout_invoices, seed)
    builder, tok = RequestBuilder(), renderer()
    rng = random.Random(f"{seed}-transcripts")
    prefixes: dict[str, str] = {}

    async def go() -> list[Transcript]:
        out = []
        for i, case in enumerate(train_cases):
            t, prefix = await transcript(case, base, builder, tok, rng)
            if prefixes.setdefault(case.profile, prefix) != prefix:
                raise AssertionError(f"{case.case_id}: the stable prefix differs")
            out.append(t)
            if (i + 1) % 2000 == 0:
                log(f"  {i + 1}/{len(train_cases)} transcripts")
        return out

    transcripts = asyncio.run(go())
    train_path = out_dir / "train.jsonl"
    with train_path.open("w") as f:
        for t in transcripts:
            f.write(json.dumps(asdict(t), sort_keys=True) + "\n")
    (out_dir / "prefixes.json").write_text(json.dumps(prefixes, sort_keys=True, indent=1))
    (out_dir / "heldout.jsonl").write_text(cases_jsonl(heldout))
    return {"sha256": dataset_sha256(out_dir),
            "heldout_sha256": hashlib.sha256((out_dir / "heldout.jsonl").read_bytes()
                                             ).hexdigest(),
            "train_jobs": len(transcripts),
            "train_steps": sum(len(t.steps) for t in transcripts),
            "heldout_cases": len(heldout)}


def cases_jsonl(items: list[Case]) -> str:
    return "".join(json.dumps(asdict(c), sort_keys=True) + "\n" for c in items)


def dataset_sha256(out_dir: Path) -> str:
    """One hash over the three files the training and the evaluation read."""
    h = hashlib.sha256()
    for name in ("prefixes.json", "train.jsonl", "heldout.jsonl"):
        h.update(name.encode() + b"\0" + (out_dir / name).read_bytes())
    return h.hexdigest()


def read_transcripts(path: Path) -> Iterator[Transcript]:
    with path.open() as f:
        for line in f:
            yield Transcript(**json.loads(line))


FRESH_SEED = 7919
"""Seed of the ``fresh`` split: cases drawn like training's (its phrasings, names and
customers) but not its draws. Some may coincide with a training case."""


def split_cases_file(split: str, data_dir: Path) -> Path:
    """Write the cases of an evaluation split other than ``heldout`` beside the data
    set and return the file: ``bundled`` (the tasks ``make demo`` runs; training holds
    them) or ``fresh`` (120 tickets and 60 invoices of training's distribution)."""
    if split == "bundled":
        items = bundled_ticket_cases() + bundled_invoice_cases()
    elif split == "fresh":
        items = cases("train", 120, 60, seed=FRESH_SEED)
    else:
        raise ValueError(f"unknown split {split!r}: use heldout, bundled or fresh")
    path = data_dir / f"{split}.jsonl"
    path.write_text(cases_jsonl(items))
    return path


def read_cases(path: Path) -> list[Case]:
    with path.open() as f:
        return [Case(**json.loads(line)) for line in f if line.strip()]
