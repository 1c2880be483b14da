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
from collections.abc import Callable
from dataclasses import dataclass, field

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
    family: str | None = None
    """Its prompt family (``Call.family``), as its first call had it."""
    seen: float = field(default_factory=time.monotonic)


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


class FamilyHomes:
    """Where each prompt family's sessions live: sessions whose chat opens with the same
    system prompt (and tools, model, salt: ``Call.prefix_keys[0]``) share its prefix.

    A new session of a family goes to the family's home, the engine that served the
    most of its sessions seen in the last ``window_s``, as far as the router is told:
    the family's prefix counts as cached there only. Why: the prefix directory lists
    every engine that holds a copy, and once a spill-over has put a copy on a second
    engine the router sends new sessions to whichever is less loaded, so that every
    family ends up on every engine. Each then holds every family's prefix, which on
    small KV pools crowds out the sessions' own turns (bench-gateway, 4 families on
    two 64-block pools, the calls replayed through a block cache: every family on both
    engines hits 0.59 under LRU, families kept apart 0.69-0.85 by how they pair up).
    Load still wins: a home over ``RoutingConfig.max_load`` is passed over as before,
    and that spill-over mixes families again (``GatewayConfig.family_homes``).

    A family new to the gateway goes to the engine home to the fewest families (then
    to the one whose families carry fewer sessions; then by load), so that the
    prefixes spread evenly.

    Hazard: a home is a majority of recent sessions, so a family whose home filled up
    moves as its spill-over sessions outnumber the rest. Families are spread by count,
    not weight: one family carrying most of the sessions weighs on its home as much as
    the load limit lets it.
    """

    def __init__(self, *, window_s: float = 300.0, max_members: int = 512,
                 max_families: int = 4096, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._window_s, self._max_members, self._max = window_s, max_members, max_families
        self._clock = clock
        self._families: OrderedDict[str, OrderedDict[str, tuple[str, float]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._families)

    def home(self, family: str, engines: list[str]) -> str | None:
        """The engine among ``engines`` serving most of the family's recent sessions; a
        family with none yet: the engine home to the fewest families, then to the
        fewest of their sessions (each family's prefix costs its home KV blocks for as
        long as it lives there). None: a tie."""
        counts = self._counts(family, engines)
        if not any(counts.values()):
            homed = {e: [0, 0] for e in engines}  # families, and their sessions
            for other in self._families:
                if other != family:
                    theirs = self._counts(other, engines)
                    e = _top(theirs)
                    if e is not None:
                        homed[e][0] += 1
                        homed[e][1] += sum(theirs.values())
            ranked = sorted(homed, key=lambda e: homed[e])
            if len(ranked) > 1 and homed[ranked[0]] == homed[ranked[1]]:
                return None
            return ranked[0] if ranked else None
        return _top(counts)

    def _counts(self, family: str, engines: list[str]) -> dict[str, int]:
        since = self._clock() - self._window_s
        counts = {e: 0 for e in engines}
        for engine, seen in (self._families.get(family) or {}).values():
            if seen >= since and engine in counts:
                counts[engine] += 1
        return counts

    def served(self, family: str, session: str, engine: str) -> None:
        """The family's session ``session`` was just served by ``engine``."""
        members = self._families.get(family)
        if members is None:
            members = self._families[family] = OrderedDict()
            while len(self._families) > self._max:
                self._families.popitem(last=False)
        self._families.move_to_end(family)
        members[session] = (engine, self._clock())
        members.move_to_end(session)
        while len(members) > self._max_members:
            members.popitem(last=False)

    def ended(self, family: str, session: str) -> None:
        members = self._families.get(family)
        if members is not None:
            members.pop(session, None)


def _top(counts: dict[str, int]) -> str | None:
    """The key with the highest count, None on a tie for it (or none at all)."""
    ranked = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)
    if not ranked or (len(ranked) > 1 and ranked[0][1] == ranked[1][1]):
        return None
    return ranked[0][0]
