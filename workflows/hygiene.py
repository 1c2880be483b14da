"""Cache-aware context hygiene: archive large or stale tool outputs out of the
transcript, but only where it pays after the cached prefix it throws away.

Pure policy (stdlib and pydantic), so the workflow, the bench and the tests run the
same code.

What compaction trades. Every later step reads the transcript again: with a warm
prefix cache most of it is *cached* (it still costs the engine's cached-token price:
KV rent and attention over it), the rest is computed (a full prefill token). Replacing
an old tool output by a short summary makes every later prompt shorter by the tokens
removed, but it rewrites the transcript from the first compacted message on: the kept
tail after that point, cached until now, is computed once more on the next step. So
compaction pays when::

    remaining_steps x saved_tokens x read_price  >=  margin x suffix_tokens x hit x (1 - cf)

in uncached-prefill-token units: ``cf`` is the engine's cached-token price as a share
of an uncached one (``EnginePrice.cached_fraction`` / ``EngineCalibration
.cached_fraction``; 0.1 by default), ``hit`` the job's own cache hit share so far (how
much of a re-read is cached; a small, contended KV pool lowers it), ``read_price =
hit x cf + (1 - hit)`` what one transcript token costs a later step, ``suffix_tokens``
the compacted transcript from its first changed message on. The objective is therefore
the *price of the prompt tokens the engine reads* (``usage.prompt_tokens``, each priced
as cached or computed), which is what ``make bench-hygiene``'s ``prefill_*`` figures
count in tokens (it reports the computed tokens and the priced total beside them).

Compaction happens at a continue-as-new point (``AgentJob._carry``), so the new run
starts from the compacted transcript and its prefix is append-only, hence cacheable,
again. ``every_step`` (compact whatever is eligible before every step, no cost model)
is the baseline that keeps the context smallest and pays the re-prefill every step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from warmloop.workflows.budgets import JobLimits, Usage
from warmloop.workflows.contracts import ChatMessage
from warmloop.workflows.tenants import s3_prefix, split_job_id

HygieneMode = Literal["off", "cost_model", "every_step"]

PATCH_CONTEXT_HYGIENE = "context-hygiene"
PATCH_SHORT_ARCHIVE_REFS = "short-archive-refs"
"""Summaries name their archive by message index, not by whole S3 key. Their length
enters the cost model, so a job started before this keeps the old summaries."""
"""``workflow.patched`` id of the compaction path (taken only by jobs that opt in)."""

ARCHIVE_MARKER = '{"archived_tool_output": '
"""How every summary starts: a summary is never compacted again."""

DEFAULT_CACHED_FRACTION = 0.1
"""The engines' default cached-token price share (``EnginePrice``, ``EngineCalibration``)."""

FAILURE_PREFIXES = ("error:", "refused:", "tool ", "HTTP 4", '{"approval"')
"""How the workflow words a tool output the model should correct (a failed or refused
call, a human's rejection): such an item is summarised with ``ok: false``."""


class ContextHygiene(BaseModel):
    """A profile's context hygiene: which tool outputs may be archived and when.

    Off unless a profile sets it (``Profile.hygiene``) or a job asks for it
    (``JobInput.context_hygiene``). Hazard: the workflow decides from these figures, so
    changing a default (or a profile's setting) while jobs run changes what they compact
    on replay: version such a change like any workflow change."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: HygieneMode = "cost_model"
    """cost_model: compact at a continue-as-new point when the cost model says it pays;
    every_step: compact before every step (a baseline: it re-prefills the tail every
    step); off: never."""
    min_item_chars: int = Field(default=1_000, ge=1)
    """A tool output this long or longer (~250 tokens) is *large*: archived once it is
    older than ``keep_recent_steps``. Too low and small answers the model still uses get
    cut for a few saved tokens; too high and nothing is ever large."""
    keep_recent_steps: int = Field(default=3, ge=0)
    """The outputs of the last N steps are never archived: the model is likely still
    reading them. 0 lets the latest output go, which a model may then ask for again."""
    expire_after_steps: int | None = Field(default=None, ge=1)
    """Any tool output older than N steps is *stale* and archived whatever its size (when
    its summary is shorter). None: outputs never expire, only large ones go."""
    tool_expire_after_steps: dict[str, int] = Field(default_factory=dict)
    """Per-tool lifetimes (steps), overriding ``expire_after_steps`` for that tool's
    outputs: a status poll may expire after 2 steps, a contract it read never."""
    keep_tools: tuple[str, ...] = ("load_tools",)
    """Tools whose outputs are never archived: the workflow reads them back from the
    transcript (``load_tools``' loaded schemas are what guided decoding accepts)."""
    head_chars: int = Field(default=80, ge=0, le=4_000)
    """How much of the output's start the summary quotes."""
    check_every_steps: int = Field(default=8, ge=1)
    """cost_model: consider a compaction point every N steps (a continue-as-new when it
    pays), besides the continue-as-new points Temporal asks for. Small: compactions come
    sooner but each re-prefill buys fewer steps; the cost model weighs that each time."""
    margin: float = Field(default=1.5, ge=1.0, le=100.0)
    """The expected saving must exceed the one-time re-prefill this many times: the
    remaining-steps estimate is uncertain, and a wrong compaction costs at once."""
    min_saved_tokens: int = Field(default=512, ge=0)
    """Compactions saving fewer tokens a step are not worth a continue-as-new."""
    remaining_share: float = Field(default=0.5, gt=0, le=1)
    """Without step statistics, a job is expected to use this share of the steps its
    budget leaves (it may finish early; an optimistic estimate compacts too eagerly)."""
    expected_job_steps: int | None = Field(default=None, ge=1)
    """The profile's prior for how many steps its jobs take (its step statistics): the
    remaining steps are then this minus the steps done, while the job is younger."""
    cached_fraction: float | None = Field(default=None, ge=0, le=1)
    """A cached prompt token's price as a share of a computed one's on the job's engines;
    None: the engines' default (0.1)."""
    chars_per_token: float = Field(default=4.0, gt=0)
    """Fallback for turning characters into tokens before the job's first step has
    measured its own ratio (its prompt tokens over its prompt's characters)."""


def resolve_hygiene(job_mode: HygieneMode | None,
                    profile_setting: ContextHygiene | None) -> ContextHygiene | None:
    """The job's hygiene, or None when off: the job's mode wins over the profile's,
    keeping the profile's other settings (a job that opts in on a profile without one
    gets the defaults)."""
    if job_mode is None:
        return profile_setting if profile_setting and profile_setting.mode != "off" else None
    if job_mode == "off":
        return None
    return (profile_setting or ContextHygiene()).model_copy(update={"mode": job_mode})


# ---- items ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompactItem:
    """One tool output to archive: message ``index`` of the transcript."""

    index: int
    tool: str
    ok: bool
    chars: int
    age_steps: int
    why: Literal["large", "stale"]
    key: str
    """S3 key where the whole output is archived."""
    summary: str
    """What replaces it in the transcript."""


def archive_key(job_id: str, index: int) -> str:
    """Where message ``index``'s whole text is archived (the tenant's prefix for a
    tenant's job). One per message: a retried archive overwrites, never duplicates."""
    tenant, bare = split_job_id(job_id)
    return f"{s3_prefix(tenant)}tool-archive/{bare}/{index:06d}.txt"


def summary_text(*, tool: str, ok: bool, chars: int, head: str, step: int,
                 ref: int | None = None, key: str | None = None) -> str:
    """The structured stand-in of an archived output: deterministic (same item, same
    bytes, so the compacted prefix caches like any other) and clearly data.

    ``ref``: the message's index, which names its archive (``archive_key(job, ref)``):
    every token of a summary is read again on every later step, and a whole S3 key
    (``key``, what jobs started before ``PATCH_SHORT_ARCHIVE_REFS`` write) costs some
    40 tokens more a summary than the index does."""
    body: dict[str, object] = {"tool": tool, "ok": ok, "chars": chars, "step": step,
                               "head": head}
    if ref is not None:
        body["ref"] = ref
    else:
        body["s3_key"] = key
    return ARCHIVE_MARKER + json.dumps(body, ensure_ascii=False) + "}"


def is_summary(content: str) -> bool:
    return content.startswith(ARCHIVE_MARKER)


def _tool_names(messages: Sequence[ChatMessage]) -> dict[int, str]:
    """Tool message index -> the tool its call named (the nearest call with its id)."""
    names: dict[str, str] = {}
    out: dict[int, str] = {}
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            for c in m.tool_calls:
                names[c.id] = c.function.name
        elif m.role == "tool":
            out[i] = names.get(m.tool_call_id or "", "unknown")
    return out


def _ages(messages: Sequence[ChatMessage]) -> list[int]:
    """Per message, the steps taken after it: each step appends one assistant message."""
    ages, later = [0] * len(messages), 0
    for i in range(len(messages) - 1, -1, -1):
        ages[i] = later
        if messages[i].role == "assistant":
            later += 1
    return ages


def select_items(messages: Sequence[ChatMessage], cfg: ContextHygiene, *,
                 job_id: str, short_refs: bool = True) -> list[CompactItem]:
    """The tool outputs to archive now: large ones past ``keep_recent_steps``, stale
    ones past their lifetime; never a summary, never one whose summary would be as
    long as itself. ``short_refs``: summaries name their archive by message index
    (False: by whole S3 key, as jobs started before ``PATCH_SHORT_ARCHIVE_REFS`` do)."""
    names, ages = _tool_names(messages), _ages(messages)
    out: list[CompactItem] = []
    for i, m in enumerate(messages):
        if m.role != "tool" or is_summary(m.content):
            continue
        tool, age = names[i], ages[i]
        if age < cfg.keep_recent_steps or tool in cfg.keep_tools:
            continue
        lifetime = cfg.tool_expire_after_steps.get(tool, cfg.expire_after_steps)
        why: Literal["large", "stale"]
        if len(m.content) >= cfg.min_item_chars:
            why = "large"
        elif lifetime is not None and age >= lifetime:
            why = "stale"
        else:
            continue
        key = archive_key(job_id, i)
        ok = not m.content.startswith(FAILURE_PREFIXES)
        head = " ".join(m.content[:cfg.head_chars].split())
        summary = summary_text(tool=tool, ok=ok, chars=len(m.content), head=head,
                               step=_step_of(messages, i),
                               **({"ref": i} if short_refs else {"key": key}))
        if len(summary) >= len(m.content):
            continue  # a summary longer than the item: keep the item
        out.append(CompactItem(index=i, tool=tool, ok=ok, chars=len(m.content),
                               age_steps=age, why=why, key=key, summary=summary))
    return out


def _step_of(messages: Sequence[ChatMessage], index: int) -> int:
    """The step whose call this output answers (1-based): assistant messages up to it."""
    return sum(1 for m in messages[:index] if m.role == "assistant")


def apply_items(messages: Sequence[ChatMessage], items: Iterable[CompactItem]
                ) -> list[ChatMessage]:
    """The transcript with each item's content replaced by its summary (a new list; the
    messages' roles, ids and order are kept, so the tool-call pairing stays valid)."""
    out = list(messages)
    for it in items:
        out[it.index] = out[it.index].model_copy(update={"content": it.summary})
    return out


def message_chars(messages: Iterable[ChatMessage]) -> int:
    """Characters a prompt spends on these messages (content and call arguments)."""
    n = 0
    for m in messages:
        n += len(m.content)
        for c in m.tool_calls or ():
            n += len(c.function.name) + len(c.function.arguments)
    return n


# ---- the cost model ------------------------------------------------------------------


def expected_remaining_steps(*, limits: JobLimits, usage: Usage, remaining_share: float,
                             expected_job_steps: int | None = None) -> float:
    """Steps the job is expected to take still, from what its caps leave and the
    profile's prior: the step cap, and the token and cost caps at the job's own rate so
    far, whichever is tightest; then the prior (``expected_job_steps``) while the job is
    younger than it, else ``remaining_share`` of that budget (a job may finish early)."""
    done = usage.steps
    budget = float(max(0, limits.max_steps - done))
    if done > 0 and limits.max_total_tokens is not None and usage.total_tokens > 0:
        per_step = usage.total_tokens / done
        budget = min(budget, max(0, limits.max_total_tokens - usage.total_tokens) / per_step)
    if done > 0 and limits.max_cost_usd is not None and usage.cost_usd > 0:
        per_step_usd = usage.cost_usd / done
        budget = min(budget, max(0.0, limits.max_cost_usd - usage.cost_usd) / per_step_usd)
    if expected_job_steps is not None and done < expected_job_steps:
        return min(budget, float(expected_job_steps - done))
    return budget * remaining_share


@dataclass(frozen=True)
class HygienePlan:
    """Whether to compact now, why, and what (figures in tokens and in uncached-prefill
    token prices, for logs and the bench)."""

    fire: bool
    reason: Literal["pays", "does_not_pay", "nothing_to_compact", "too_little",
                    "pending_approval", "resend_too_big", "every_step"]
    items: tuple[CompactItem, ...] = ()
    first_index: int | None = None
    """The first message compaction changes: the prefix before it stays cached."""
    saved_tokens: float = 0.0
    """Tokens every later prompt is shorter by."""
    suffix_tokens: float = 0.0
    """The compacted transcript from ``first_index`` on: recomputed once."""
    remaining_steps: float = 0.0
    saving: float = 0.0
    """remaining_steps x saved_tokens x read price."""
    cost: float = 0.0
    """suffix_tokens x hit x (1 - cached_fraction): the cache thrown away."""

    def describe(self) -> str:
        return (f"{self.reason}: {len(self.items)} item(s), {self.saved_tokens:.0f} tokens a "
                f"step over {self.remaining_steps:.1f} steps = {self.saving:.0f} vs re-prefill "
                f"{self.suffix_tokens:.0f} tokens = {self.cost:.0f}")


def tokens_per_char(*, last_prompt_tokens: int | None, prompt_chars: int,
                    chars_per_token: float) -> float:
    """The job's own tokens-per-character (its last prompt's tokens over that prompt's
    characters); the configured fallback before it has one."""
    if last_prompt_tokens and prompt_chars > 0:
        return last_prompt_tokens / prompt_chars
    return 1.0 / chars_per_token


def plan_compaction(messages: Sequence[ChatMessage], cfg: ContextHygiene, *, job_id: str,
                    limits: JobLimits, usage: Usage, fixed_chars: int,
                    last_prompt_tokens: int | None, pending_approvals: int = 0,
                    max_resend_bytes: int | None = None,
                    short_refs: bool = True) -> HygienePlan:
    """Whether compacting ``messages`` now pays, with the items to archive.

    ``fixed_chars``: the prompt's characters besides the transcript (system prompt,
    tool schemas, task), to measure the job's tokens per character from its last
    prompt (``last_prompt_tokens``). ``pending_approvals``: a human may be reading the
    transcript, so nothing changes under them. ``max_resend_bytes``: the compacted tail
    travels inline in the next step's request; a bigger one is not compacted."""
    if pending_approvals:
        return HygienePlan(fire=False, reason="pending_approval")
    items = select_items(messages, cfg, job_id=job_id, short_refs=short_refs)
    if not items:
        return HygienePlan(fire=False, reason="nothing_to_compact")
    # The prompt of the last step ended before its own call and answer.
    last_call = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=0)
    tpc = tokens_per_char(last_prompt_tokens=last_prompt_tokens,
                          prompt_chars=fixed_chars + message_chars(messages[:last_call]),
                          chars_per_token=cfg.chars_per_token)
    after = apply_items(messages, items)
    first = min(it.index for it in items)
    saved = sum(it.chars - len(it.summary) for it in items) * tpc
    suffix = message_chars(after[first:]) * tpc
    remaining = expected_remaining_steps(limits=limits, usage=usage,
                                         remaining_share=cfg.remaining_share,
                                         expected_job_steps=cfg.expected_job_steps)
    cf = DEFAULT_CACHED_FRACTION if cfg.cached_fraction is None else cfg.cached_fraction
    # No steps yet: assume a warm cache, which values the saving least and the cache
    # thrown away most (the conservative side).
    hit = usage.cached_tokens / usage.prompt_tokens if usage.prompt_tokens else 1.0
    saving = remaining * saved * (hit * cf + (1 - hit))
    cost = suffix * hit * (1 - cf)
    plan = HygienePlan(fire=False, reason="does_not_pay", items=tuple(items),
                       first_index=first, saved_tokens=saved, suffix_tokens=suffix,
                       remaining_steps=remaining, saving=saving, cost=cost)
    if max_resend_bytes is not None and sum(
            len(m.model_dump_json()) for m in after[first:]) > max_resend_bytes:
        return replace(plan, reason="resend_too_big")
    if saved < cfg.min_saved_tokens:
        return replace(plan, reason="too_little")
    if saving >= cfg.margin * cost:
        return replace(plan, fire=True, reason="pays")
    return plan


def plan_every_step(messages: Sequence[ChatMessage], cfg: ContextHygiene, *, job_id: str,
                    pending_approvals: int = 0,
                    max_resend_bytes: int | None = None,
                    short_refs: bool = True) -> HygienePlan:
    """The every-step baseline: archive whatever is eligible, no cost model."""
    if pending_approvals:
        return HygienePlan(fire=False, reason="pending_approval")
    items = select_items(messages, cfg, job_id=job_id, short_refs=short_refs)
    if not items:
        return HygienePlan(fire=False, reason="nothing_to_compact")
    first = min(it.index for it in items)
    after = apply_items(messages, items)
    if max_resend_bytes is not None and sum(
            len(m.model_dump_json()) for m in after[first:]) > max_resend_bytes:
        return HygienePlan(fire=False, reason="resend_too_big", items=tuple(items),
                           first_index=first)
    return HygienePlan(fire=True, reason="every_step", items=tuple(items), first_index=first)


def due_for_check(cfg: ContextHygiene, steps_done: int) -> bool:
    """cost_model: is this step count a compaction check point?"""
    return steps_done > 0 and steps_done % cfg.check_every_steps == 0


# ---- the archive activity's contract --------------------------------------------------


class ArchivedOutput(BaseModel):
    key: str
    text: str


class ArchiveRequest(BaseModel):
    """Input of ``archive_tool_outputs``: write each text at its key (overwriting: a
    retried call writes the same bytes)."""

    job_id: str
    outputs: list[ArchivedOutput]


def archive_batches(messages: Sequence[ChatMessage], items: Sequence[CompactItem], *,
                    job_id: str, max_bytes: int) -> list[ArchiveRequest]:
    """The archive writes, in requests of at most ``max_bytes`` of text (one output at
    least each), so no activity payload nears Temporal's limit."""
    out: list[ArchiveRequest] = []
    batch: list[ArchivedOutput] = []
    size = 0
    for it in items:
        text = messages[it.index].content
        if batch and size + len(text) > max_bytes:
            out.append(ArchiveRequest(job_id=job_id, outputs=batch))
            batch, size = [], 0
        batch.append(ArchivedOutput(key=it.key, text=text))
        size += len(text)
    if batch:
        out.append(ArchiveRequest(job_id=job_id, outputs=batch))
    return out
