"""What the gateway remembers between calls: sessions and learned prompt chains.

Both live in this process, bounded (least recently used go first): the gateway is one
process in front of the fleet, and each call's routing reads them without a round trip.
What other processes need is written to Redis as the inference workers write it (the
prefix directory's engine sets and the session's job chain, the hold tables, the
pause statistics).

Hazards:

- A gateway restart forgets sessions: a session's next call finds its chain again in
  the prefix directory (``PrefixDirectory.job_chain``, one round trip), but the pause
  it was in is not measured and its hold, which lived in the old process, is gone.
- Several gateway replicas do not share sessions; put a session-affine load balancer
  in front of them (the same header), or run one.
- Chains are learned after a call's response, by tokenizing its prompt off the
  response's path: a call that comes before the previous one's chain is learned is
  routed by stickiness and load alone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from warmloop.workflows.contracts import Lane

HASH_CHARS = 16
"""Hex characters of one block hash (``warmloop.workflows.routing.block_hashes``)."""


@dataclass(frozen=True)
class Chain:
    """A prompt's reusable block hashes, packed in one string (a long prompt's hash
    list costs some 60 bytes a block as Python strings; packed, 16)."""

    packed: str
    block_size: int

    @classmethod
    def of(cls, hashes: list[str], block_size: int) -> Chain:
        return cls("".join(hashes), block_size)

    @property
    def blocks(self) -> int:
        return len(self.packed) // HASH_CHARS

    def hashes(self) -> list[str]:
        p = self.packed
        return [p[i:i + HASH_CHARS] for i in range(0, len(p), HASH_CHARS)]

    def first(self, blocks: int) -> Chain:
        return Chain(self.packed[:max(0, blocks) * HASH_CHARS], self.block_size)


@dataclass
class Session:
    """One session as the gateway sees it."""

    key: str
    kind: str
    lane: Lane = Lane.INTERACTIVE
    engine: str | None = None
    """The engine that served its last call (where its prefix is)."""
    chain: Chain | None = None
    """Its last prompt's reusable blocks (learned after that call)."""
    chain_generation: int = 0
    """The ``generation`` of the call ``chain`` was learned from."""
    recorded: tuple[str, str] | None = None
    """(engine, packed chain) last recorded in the prefix directory for it."""
    avoid: str | None = None
    """An engine its last call failed on: its next call goes elsewhere (once)."""
    active: int = 0
    """Calls of the session in flight now."""
    ended_at: float | None = None
    """When its last call's response ended: the pause runs from here."""
    pause_kind: str | None = None
    """What it waits on since (``warmloop.workers.gateway.holds.pause_kind_of``)."""
    generation: int = 0
    """Bumped by each call: a learning task from an older call holds nothing."""
    served_tokens: int = 0
    """Prompt tokens of its last call, as its engine reported them."""
    seen: float = field(default_factory=time.monotonic)
    after_send: list[Callable[[], Coroutine[Any, Any, Any]]] = field(default_factory=list)
    """Bookkeeping its call started (its announcement to the other replicas, its pause's
    record), started once the call is routed (``Gateway.send``): they run at its next
    wait, for an interactive call once its engine request is written, so their Redis
    round trips overlap the engine's work, not the call's routing."""


class SessionTable:
    """Sessions by key, the least recently seen dropped past ``max_sessions`` or after
    ``idle_s`` without a call (their holds end by their own TTL)."""

    def __init__(self, *, max_sessions: int, idle_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max, self._idle_s, self._clock = max_sessions, idle_s, clock
        self._by_key: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str) -> Session | None:
        s = self._by_key.get(key)
        if s is not None and self._clock() - s.seen > self._idle_s and not s.active:
            del self._by_key[key]
            return None
        return s

    def open(self, key: str, kind: str, lane: Lane) -> Session:
        """The session (new or known), marked seen now."""
        s = self.get(key)
        if s is None:
            s = Session(key=key, kind=kind, lane=lane)
            self._by_key[key] = s
        s.kind, s.lane, s.seen = kind, lane, self._clock()
        self._by_key.move_to_end(key)
        self._trim()
        return s

    def drop(self, key: str) -> None:
        self._by_key.pop(key, None)

    def _trim(self) -> None:
        while len(self._by_key) > self._max:
            key, oldest = next(iter(self._by_key.items()))
            if oldest.active:  # never drop one mid-call; try again at the next open
                self._by_key.move_to_end(key)
                return
            del self._by_key[key]


class PromptIndex:
    """Learned chains by prompt prefix key (``warmloop.workers.gateway.calls``): how a
    call without a session, or a session's first call, finds which engines hold the
    start of its prompt before anything is tokenized."""

    def __init__(self, *, max_entries: int) -> None:
        self._max = max_entries
        self._chains: OrderedDict[str, Chain] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chains)

    def put(self, key: str, chain: Chain) -> None:
        if not chain.blocks:
            return
        self._chains[key] = chain
        self._chains.move_to_end(key)
        while len(self._chains) > self._max:
            self._chains.popitem(last=False)

    def longest(self, keys: list[str]) -> Chain | None:
        """The chain of the longest of ``keys`` (shortest first) learned."""
        for key in reversed(keys):
            chain = self._chains.get(key)
            if chain is not None:
                self._chains.move_to_end(key)
                return chain
        return None
