"""Which prefill replica a request goes to: the router's policies, plain Python.

The router knows, for each prefill replica that takes work, the calls it has in flight there,
the prefill work it sent there and that has not come back (in prompt tokens still to compute),
and the replica's own last report (``discovery.Load``: its queued tokens and a summary of the
prefix snapshots it holds). A ``PrefillRoute`` is one request's view of that: for each replica the
tokens of this prompt its prefix cache would serve (``epd.prefix.cached_tokens``, the same keys
and the same search as the cache itself), and the work queued there.

Policies (``router.prefill_routing``):

- ``least-load``: fewest calls in flight (ties: the one picked least recently). Blind to caches.
- ``round-robin``: each replica in turn.
- ``affinity``: the longest cached prefix (ties: least load). Blind to load.
- ``epd`` (default): the smallest expected time to first token, measured in prompt tokens still
  to compute: the replica's queued work plus this prompt's tokens it does not hold. The balance
  rule: a replica whose queued work, or whose work sent by this router in the last ``RECENT_S``
  (decaying), exceeds ``BALANCE_FACTOR`` times the mean of the replicas (plus
  ``BALANCE_SLACK_TOKENS``, so an idle fleet is no constraint) is passed over whatever it holds;
  the least loaded replica is never passed over. So affinity can make one replica at most about
  1.5x as busy as the mean, never pile the work onto it.

Decode workers (``DecodeRoute``, prefill's handoff): among the workers whose free K/V memory
(as last reported, less what waits there) holds the request, the one with the fewest handoffs
waiting there plus calls in flight from this prefill replica (ties: the balancer's order, least
recently picked first); when none has room, the same order over all of them (decode's Reserve then
says which is full).

``Balancer.pick`` (``epd.discovery``) asks a route to choose among the replicas its breakers
allow; the simulator (``bench/simulate.py``) drives the same classes.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from epd.prefix import cached_tokens, lookup_blocks, summary_key

BALANCE_FACTOR = 1.5
BALANCE_SLACK_TOKENS = 256
RECENT_S = 30.0  # the time constant of "work sent recently" in the balance rule
POLICY_NAMES = ("epd", "least-load", "round-robin", "affinity")


@dataclass(frozen=True)
class Replica:
    """One allowed prefill replica as a route sees it, in the balancer's order (least calls in
    flight, then least recently picked)."""

    name: str
    calls: int  # this router's calls in flight to it
    sent_tokens: int  # prompt tokens this router sent it that are not computed yet (its own estimate)
    reported_tokens: int  # the tokens queued there, as the replica last reported (every router's work)
    block_size: int  # its prefix keys' block size; 0: it has no prefix cache
    held: Container[bytes]  # its prefix summary (epd.prefix.decode_summary)
    free_kv_tokens: int = -1  # decode: K/V tokens free, less what is waiting or reserved (-1: not told)
    num_waiting: int = 0  # decode: handoffs waiting for the batch or on the way

    @property
    def queued_tokens(self) -> int:
        """Work queued there: the larger of what this router knows it sent and what the replica last said."""
        return max(self.sent_tokens, self.reported_tokens)


@dataclass(frozen=True)
class Choice:
    replica: Replica
    cached_tokens: int
    work_tokens: int  # what this prompt adds to the replica's queue


class Route(Protocol):
    """What ``Balancer.pick`` asks: choose one of the allowed replicas (given in the balancer's
    order); ``chosen`` is the last choice (its ``work_tokens`` count against the replica)."""

    chosen: Choice | None

    def choose(self, replicas: Sequence[Replica], holders: Mapping[bytes, set[str]] | None = None) -> Choice: ...


class Policy:
    name = ""

    def choose(self, choices: Sequence[Choice]) -> Choice:
        raise NotImplementedError


class LeastLoad(Policy):
    name = "least-load"

    def choose(self, choices: Sequence[Choice]) -> Choice:
        return choices[0]  # the balancer's order is already least calls, then least recently picked


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, choices: Sequence[Choice]) -> Choice:
        ordered = sorted(choices, key=lambda c: c.replica.name)
        return ordered[next(self._turn) % len(ordered)]


class AffinityOnly(Policy):
    name = "affinity"

    def choose(self, choices: Sequence[Choice]) -> Choice:
        return max(choices, key=lambda c: c.cached_tokens)  # max keeps the first (least loaded) of ties


class ExpectedTTFT(Policy):
    """epd's: the least expected time to first token among the replicas the balance rule allows.

    The rule looks at two measures of load, each against ``balance_factor`` times its mean over the
    replicas plus ``slack_tokens``: the work queued now, and the work this router sent each replica
    recently (decaying with time constant ``recent_s``). The second keeps a prefix every
    conversation shares (a long system prompt) from drawing every new conversation, and then
    every later turn of them, to the one replica that holds it while queues stay short: once that
    replica has had its share, new work goes elsewhere and the prefix is cached there too."""

    name = "epd"

    def __init__(self, balance_factor: float = BALANCE_FACTOR, slack_tokens: int = BALANCE_SLACK_TOKENS,
                 recent_s: float = RECENT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.balance_factor = balance_factor
        self.slack_tokens = slack_tokens
        self.recent_s = recent_s
        self.clock = clock
        self._recent: dict[str, tuple[float, float]] = {}  # name -> (decayed work sent, as of when)

    def recent_tokens(self, name: str, now: float) -> float:
        work, when = self._recent.get(name, (0.0, now))
        return work * math.exp(-(now - when) / self.recent_s)

    def _within(self, loads: list[float]) -> list[bool]:
        limit = self.balance_factor * sum(loads) / len(loads) + self.slack_tokens
        least = min(loads)
        return [load <= limit or load == least for load in loads]

    def choose(self, choices: Sequence[Choice]) -> Choice:
        now = self.clock()
        queued = [c.replica.queued_tokens for c in choices]
        recent = [self.recent_tokens(c.replica.name, now) for c in choices]
        allowed = [c for c, ok_queued, ok_recent in zip(choices, self._within(queued), self._within(recent))
                   if ok_queued and ok_recent]
        if not allowed:  # each measure spares its least loaded replica, but not always the same one
            allowed = [c for c, ok in zip(choices, self._within(queued)) if ok]
        best = min(allowed, key=lambda c: (c.replica.queued_tokens + c.work_tokens, c.replica.queued_tokens))
        self._recent[best.replica.name] = (self.recent_tokens(best.replica.name, now) + best.work_tokens, now)
        return best


def make_policy(name: str, clock: Callable[[], float] = time.monotonic) -> Policy:
    """The policy called ``name``; ``clock`` is its time (the simulator passes its own)."""
    policies = {"least-load": LeastLoad, "round-robin": RoundRobin, "affinity": AffinityOnly}
    if name == "epd":
        return ExpectedTTFT(clock=clock)
    if name not in policies:
        raise ValueError(f"prefill routing must be one of {', '.join(POLICY_NAMES)}, got {name!r}")
    return policies[name]()


class PrefillRoute:
    """One prefill request's choice of replica. ``hashes_for(block_size)`` gives the request's
    prefix keys for a block size (computed once per size, on first use)."""

    def __init__(self, policy: Policy, num_tokens: int, hashes_for: Callable[[int], Sequence[bytes]]) -> None:
        self.policy = policy
        self.num_tokens = num_tokens
        self._hashes_for = hashes_for
        self._hashes: dict[int, Sequence[bytes]] = {}
        self.chosen: Choice | None = None

    def cached_tokens(self, replica: Replica) -> int:
        if not replica.block_size:
            return 0
        return cached_tokens(self._hashes_of(replica.block_size), self.num_tokens, replica.block_size, replica.held)

    def prepare(self, block_sizes: Iterable[int]) -> None:
        """Compute the prefix keys for each of ``block_sizes`` now (the router calls this in a
        worker thread for a long prompt: thousands of blocks hashed on its event loop would stall
        every stream it relays)."""
        for block_size in block_sizes:
            if block_size:
                self._hashes_of(block_size)

    def _hashes_of(self, block_size: int) -> Sequence[bytes]:
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = self._hashes_for(block_size)
        return hashes

    def cached_by_replica(self, replicas: Sequence[Replica], holders: Mapping[bytes, set[str]]) -> dict[str, int]:
        """``cached_tokens`` of every replica at once, from ``holders`` (summary key -> the replicas
        holding it): the request's blocks are walked once, longest prefix first, instead of once
        per replica (a router in front of hundreds of replicas would otherwise spend milliseconds
        a request here)."""
        found: dict[str, int] = {}
        sizes: dict[int, set[str]] = {}
        for replica in replicas:
            if replica.block_size:
                sizes.setdefault(replica.block_size, set()).add(replica.name)
        for block_size, left in sizes.items():
            hashes = self._hashes_of(block_size)
            for block in lookup_blocks(len(hashes), self.num_tokens, block_size):
                holding = holders.get(summary_key(hashes[block - 1]))
                if holding:
                    for name in holding & left:
                        found[name] = block * block_size
                    left -= holding
                    if not left:
                        break
        return found

    def choose(self, replicas: Sequence[Replica], holders: Mapping[bytes, set[str]] | None = None) -> Choice:
        if holders is None:
            cached = {replica.name: self.cached_tokens(replica) for replica in replicas}
        else:
            cached = self.cached_by_replica(replicas, holders)
        choices = [Choice(r, cached.get(r.name, 0), self.num_tokens - cached.get(r.name, 0)) for r in replicas]
        self.chosen = self.policy.choose(choices)
        return self.chosen


class DecodeRoute:
    """One handoff's choice of decode worker (see the module docstring)."""

    def __init__(self, need_tokens: int) -> None:
        self.need_tokens = need_tokens
        self.chosen: Choice | None = None

    def choose(self, replicas: Sequence[Replica], holders: Mapping[bytes, set[str]] | None = None) -> Choice:
        def fits(r: Replica) -> bool:
            return r.free_kv_tokens < 0 or r.free_kv_tokens >= self.need_tokens

        best = min(replicas, key=lambda r: (not fits(r), r.num_waiting + r.calls))  # min keeps the balancer's order
        self.chosen = Choice(best, 0, 0)
        return self.chosen
