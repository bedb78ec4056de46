"""``epd bench simulate``: a discrete-event simulation of prefill routing at fleet sizes this
machine cannot run (8 to 256 prefill replicas and more).

What is real and what is modelled:

- Real (imported, not copied): the router's selection (``epd.discovery.Balancer.pick`` with a
  ``routing.PrefillRoute`` and each policy of ``epd.routing``), the prefix keys
  (``epd.prefix.request_block_hashes``), each replica's prefix cache (``PrefixCache``: its
  lookup, its byte bound, LRU eviction and block sharing, and the summary it reports) and where
  prefill snapshots a prompt (``snapshot_points``). The cache holds tiny stand-in tensors scaled
  so that a block's K/V and a snapshot's linear-attention state keep the measured model's ratio
  of bytes; its capacity is ``--prefix-cache-mb`` in the model's own bytes.
- Modelled: a replica computes one prompt at a time, first come first served, in
  ``fixed_s + per_token_s x (prompt tokens - cached tokens)`` (measured on this machine:
  ``--measure``); a replica reports its queued work and summary every ``HEARTBEAT_S`` and
  ``Membership.MIN_REPORT_S`` after it stores a snapshot, and routers see a report one
  ``POLL_S`` later (the most a ``RegistryWatch`` takes: at once while it waits in the registry,
  at most ``POLL_S`` after its last read); the router's own calls count at once, and the
  router that sent a prompt learns the snapshots it stored from the reply (``Balancer.note_stored``). Encode,
  handoff and decode are not simulated: the next turn comes ``answer x TPOT + think time`` after
  the first token. TTFT here is queueing plus prefill.

The trace: conversations arrive as a Poisson process; each has one image in its first turn and
``--turns`` turns; every turn resends the whole conversation (system prompt shared by all
conversations, image, earlier turns and answers) plus new user text. The arrival rate is set so
the trace's prefill work *without* any cache would keep the fleet ``--utilization`` busy.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from epd import prefix, routing
from epd.discovery import HEARTBEAT_S, Balancer, Endpoint, Load, Membership, RoleContext
from epd.lm import HybridState
from epd.v1 import epd_pb2
from prefill_svc.caches import PrefixCache, snapshot_points

POLL_S = RoleContext.poll_s  # the longest a router's watch takes to see a report (its default)
IMAGE_TOKEN = 151655  # any id: the keys only need the placeholders to be one
POLICIES = ("round-robin", "least-load", "affinity", "epd")


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 8
    conversations_per_replica: int = 12
    turns: int = 4
    system_tokens: int = 128
    image_grid: tuple[int, int] = (16, 16)  # merged grid: 256 image tokens
    user_tokens: tuple[int, int] = (32, 160)
    answer_tokens: int = 64
    tpot_s: float = 0.03
    think_s: float = 5.0
    utilization: float = 0.7
    routers: int = 1
    block_size: int = 64
    snapshot_every_blocks: int = 4
    prefix_cache_mb: int = 512
    per_token_s: float = 1e-3
    fixed_s: float = 0.01
    kv_bytes_per_token: int = 24576
    linear_state_bytes: int = 18 * 2**20
    seed: int = 0


@dataclass
class Turn:
    conversation: int
    index: int
    token_ids: list[int]
    image_key: str
    arrival: float = 0.0
    start: float = 0.0
    first_token: float = 0.0
    cached: int = 0
    replica: str = ""


@dataclass
class Conversation:
    index: int
    start: float
    image_key: str
    turns_text: list[list[int]]  # each turn's user text
    answers: list[list[int]]


def make_trace(config: SimConfig) -> list[Conversation]:
    rng = random.Random(config.seed)
    system = [rng.randrange(1000, 100_000) for _ in range(config.system_tokens)]
    work = expected_uncached_work(config, rng_seed=config.seed)
    rate = config.utilization * config.num_replicas / work  # conversations per second
    conversations, now = [], 0.0
    for index in range(config.num_replicas * config.conversations_per_replica):
        now += rng.expovariate(rate)
        texts = [[rng.randrange(1000, 100_000) for _ in range(rng.randint(*config.user_tokens))]
                 for _ in range(config.turns)]
        answers = [[rng.randrange(1000, 100_000) for _ in range(config.answer_tokens)] for _ in range(config.turns)]
        texts[0] = system + texts[0]
        conversations.append(Conversation(index, now, f"image-{config.seed}-{index}", texts, answers))
    return conversations


def prompt_of(config: SimConfig, conversation: Conversation, turn: int) -> list[int]:
    h, w = config.image_grid
    tokens: list[int] = []
    for k in range(turn + 1):
        text = conversation.turns_text[k]
        if k == 0:  # the system prompt, then the image, then the first question
            tokens += text[:config.system_tokens] + [1] + [IMAGE_TOKEN] * (h * w) + [2] + text[config.system_tokens:]
        else:
            tokens += text
        if k < turn:
            tokens += conversation.answers[k]
    return tokens


def expected_uncached_work(config: SimConfig, rng_seed: int) -> float:
    """Seconds of prefill one conversation costs when nothing is ever cached (the trace's load unit)."""
    h, w = config.image_grid
    mean_user = sum(config.user_tokens) / 2
    total = 0.0
    for turn in range(config.turns):
        tokens = config.system_tokens + h * w + 2 + (turn + 1) * mean_user + turn * config.answer_tokens
        total += config.fixed_s + config.per_token_s * tokens
    return total


class SimReplica:
    """One prefill replica: a FIFO of prompts and a real ``PrefixCache`` holding stand-in tensors."""

    def __init__(self, name: str, config: SimConfig) -> None:
        self.name = name
        self.config = config
        # Stand-in tensors: one float of K and one of V per token in one layer, and a linear state
        # sized to keep the model's ratio of snapshot bytes to per-token K/V bytes.
        self.scale = config.kv_bytes_per_token / 8
        self.linear_floats = max(1, int(config.linear_state_bytes / self.scale / 4))
        self.cache = PrefixCache(int(config.prefix_cache_mb * 2**20 / self.scale), config.block_size,
                                 config.snapshot_every_blocks)
        self.queue: list[tuple[Turn, list[bytes], int]] = []
        self.busy_until = 0.0
        self.busy_s = 0.0
        self.running = False
        self.load = Load(prefix_block_size=config.block_size)

    def queued_tokens(self) -> int:
        return sum(len(turn.token_ids) - cached for turn, _, cached in self.queue)

    def state(self, num_tokens: int) -> HybridState:
        state = HybridState.empty(2)
        state.num_tokens = num_tokens
        state.conv[0] = torch.zeros(1, self.linear_floats)
        state.keys[1] = torch.zeros(1, 1, num_tokens, 1)
        state.values[1] = torch.zeros(1, 1, num_tokens, 1)
        return state

    def report(self) -> Load:
        return Load(queued_tokens=self.queued_tokens(), prefix_summary=self.cache.summary(),
                    prefix_block_size=self.config.block_size)


@dataclass
class Result:
    policy: str
    turns: list[Turn]
    busy_s: dict[str, float]
    extra: dict = field(default_factory=dict)

    def figures(self) -> dict:
        later = [t for t in self.turns if t.index > 0]
        ttft = sorted(t.first_token - t.arrival for t in self.turns)
        ttft_later = sorted(t.first_token - t.arrival for t in later)
        busy = list(self.busy_s.values())
        mean_busy = statistics.fmean(busy)
        return {
            "policy": self.policy,
            "cached_fraction_turns2": sum(t.cached for t in later) / max(1, sum(len(t.token_ids) for t in later)),
            "cached_fraction": sum(t.cached for t in self.turns) / sum(len(t.token_ids) for t in self.turns),
            "imbalance": max(busy) / mean_busy if mean_busy else 1.0,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "ttft_p50_turns2_s": _pct(ttft_later, 50), "ttft_p99_turns2_s": _pct(ttft_later, 99),
            "requests": len(self.turns),
            **self.extra,
        }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


@dataclass(frozen=True)
class ReplayTurn:
    """One request of a real run, replayed (``replay_trace``): when it reached prefill, its prompt,
    and where its turn's generation prompt begins (what the next turn shares)."""

    conversation: int
    index: int
    arrival: float
    token_ids: list[int]
    turn_start: int


def simulate(config: SimConfig, policy_name: str, replay: list[ReplayTurn] | None = None) -> Result:
    """Run the trace through ``config.routers`` routers using ``policy_name``; returns every turn's
    times. ``replay``: these requests at their own arrival times instead of ``make_trace``'s
    conversations (each turn arrives when the real one did, not after the simulated answer)."""
    replicas = {f"prefill-{i}": SimReplica(f"prefill-{i}", config) for i in range(config.num_replicas)}
    balancers = [Balancer("prefill") for _ in range(config.routers)]
    clock = [0.0]  # the simulation's time, which the policies read
    policies = [None if policy_name == "least-load" else routing.make_policy(policy_name, lambda: clock[0])
                for _ in balancers]
    seen_loads = {name: Load(prefix_block_size=config.block_size) for name in replicas}

    def endpoints() -> list[Endpoint]:
        return [Endpoint(name=n, role="prefill", address=n, incarnation="1", load=seen_loads[n]) for n in replicas]

    for balancer in balancers:
        balancer.update(endpoints())
    events: list = []
    order = itertools.count()

    def at(time: float, kind: str, *args) -> None:
        heapq.heappush(events, (time, next(order), kind, args))

    conversations = make_trace(config) if replay is None else []
    for conversation in conversations:
        at(conversation.start, "arrive", conversation, 0)
    for turn in replay or []:
        at(turn.arrival, "arrive", turn, turn.index)
    for i, name in enumerate(replicas):  # heartbeats, spread over the second
        at(HEARTBEAT_S * i / len(replicas), "heartbeat", name)
    pending_reports: dict[str, Load] = {}
    apply_scheduled = False
    report_soon: set[str] = set()
    done_turns: list[Turn] = []
    done_count, total_turns = 0, len(conversations) * config.turns + len(replay or [])
    turn_starts: dict[int, int | None] = {}  # id(turn) -> where its generation prompt begins (replay)
    pick_s = 0.0  # the router's CPU time choosing (what routing costs it per request)
    rng = random.Random(config.seed + 1)
    calls: dict[int, tuple[int, str, int]] = {}  # id(turn) -> (router, replica, work counted)

    def start_next(replica: SimReplica, now: float) -> None:
        if replica.running or not replica.queue:
            return
        turn, hashes, _ = replica.queue[0]
        cached, _ = replica.cache.lookup(hashes, len(turn.token_ids))  # the real lookup, at the front of the queue
        turn.cached, turn.start = cached, now
        replica.queue[0] = (turn, hashes, cached)
        compute = config.fixed_s + config.per_token_s * (len(turn.token_ids) - cached)
        replica.running = True
        replica.busy_s += compute
        at(now + compute, "finish", replica.name)

    while events:
        now, _, kind, args = heapq.heappop(events)
        clock[0] = now
        if kind == "arrive":
            conversation, index = args
            if isinstance(conversation, ReplayTurn):
                token_ids = conversation.token_ids
                turn = Turn(conversation.conversation, index, token_ids, f"image-{conversation.conversation}",
                            arrival=now)
                turn_starts[id(turn)] = conversation.turn_start
            else:
                token_ids = prompt_of(config, conversation, index)
                turn = Turn(conversation.index, index, token_ids, conversation.image_key, arrival=now)
            router = rng.randrange(config.routers)
            hashes_by_size: dict[int, list[bytes]] = {}

            def hashes_for(block_size: int, turn=turn, cache=hashes_by_size) -> list[bytes]:
                if block_size not in cache:
                    ref = epd_pb2.ImageRef(store_key=turn.image_key, merged_height=config.image_grid[0],
                                           merged_width=config.image_grid[1])
                    cache[block_size] = prefix.request_block_hashes(
                        turn.token_ids, 0, [ref], IMAGE_TOKEN, None, block_size, "sim")[1]
                return cache[block_size]

            policy = policies[router]
            route = None if policy is None else routing.PrefillRoute(policy, len(token_ids), hashes_for)
            started = time.perf_counter()
            name, _ = balancers[router].pick(route=route)
            pick_s += time.perf_counter() - started
            turn.replica = name
            calls[id(turn)] = (router, name, route.chosen.work_tokens if route is not None else 0)
            replica = replicas[name]
            hashes = hashes_for(config.block_size)
            replica.queue.append((turn, hashes, 0))
            start_next(replica, now)
        elif kind == "finish":
            replica = replicas[args[0]]
            turn, hashes, cached = replica.queue.pop(0)
            replica.running = False
            turn.first_token = now
            # Each turn extends the last one token for token here, so the last full block is where
            # the next turn's prefix ends (the real prefill also snapshots at the last <|im_start|>).
            stored = []
            for end in snapshot_points(len(turn.token_ids), config.block_size, config.snapshot_every_blocks,
                                       turn_starts.pop(id(turn), None)):
                blocks = hashes[:end // config.block_size]
                if end > cached and replica.cache.wants(blocks[-1]) and replica.cache.insert(blocks, replica.state(end)):
                    stored.append(prefix.summary_key(blocks[-1]))
                    if replica.name not in report_soon:
                        report_soon.add(replica.name)
                        at(now + Membership.MIN_REPORT_S, "soon", replica.name)
            router, name, work = calls.pop(id(turn))
            balancers[router].note_stored(name, b"".join(stored))  # the reply says what it stored
            balancers[router].release(name, True, work)
            done_turns.append(turn)
            done_count += 1
            if replay is None and turn.index + 1 < config.turns:
                conversation = conversations[turn.conversation]
                gap = config.answer_tokens * config.tpot_s + rng.expovariate(1 / config.think_s)
                at(now + gap, "arrive", conversation, turn.index + 1)
            start_next(replica, now)
        elif kind in ("heartbeat", "soon"):
            name = args[0]
            replica = replicas[name]
            if kind == "soon":
                report_soon.discard(name)
            elif done_count < total_turns:  # the periodic beat: the next one a second later
                at(now + HEARTBEAT_S, "heartbeat", name)
            load = replica.report()
            if load != seen_loads[name]:
                pending_reports[name] = load
                if not apply_scheduled:
                    apply_scheduled = True
                    at(now + POLL_S, "apply")
        elif kind == "apply":  # the routers' watches re-read the registry
            apply_scheduled = False
            seen_loads.update(pending_reports)
            pending_reports.clear()
            listed = endpoints()
            for balancer in balancers:
                balancer.update(listed)
    return Result(policy_name, done_turns, {n: r.busy_s for n, r in replicas.items()},
                  {"pick_us": pick_s / max(1, len(done_turns)) * 1e6})


def run(sizes: list[int], config: SimConfig, policies=POLICIES) -> list[dict]:
    torch.set_num_threads(1)  # the stand-in tensors are tiny: more threads only contend
    rows = []
    for size in sizes:
        sized = SimConfig(**{**config.__dict__, "num_replicas": size})
        for policy in policies:
            figures = simulate(sized, policy).figures()
            rows.append({"replicas": size, "routers": sized.routers, **figures})
            print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row: dict) -> str:
    return (f"{row['replicas']:>4} {row['routers']:>3} {row['policy']:<12} cached(t2+) {row['cached_fraction_turns2']:6.1%}  "
            f"imbalance {row['imbalance']:5.2f}  TTFT p50 {row['ttft_p50_s']:7.3f} s  p99 {row['ttft_p99_s']:7.3f} s  "
            f"(turns 2+: p50 {row['ttft_p50_turns2_s']:7.3f}  p99 {row['ttft_p99_turns2_s']:7.3f})  "
            f"pick {row['pick_us']:.0f} us  n={row['requests']}")


def markdown_table(rows: list[dict]) -> str:
    lines = ["| replicas | routers | policy | cached tokens, turns 2+ | busiest / mean replica | TTFT p50 | TTFT p99 "
             "| TTFT p50, turns 2+ | TTFT p99, turns 2+ | router CPU per pick |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['replicas']} | {r['routers']} | {r['policy']} | {r['cached_fraction_turns2']:.1%} | "
                     f"{r['imbalance']:.2f} | {r['ttft_p50_s'] * 1000:.0f} ms | {r['ttft_p99_s'] * 1000:.0f} ms | "
                     f"{r['ttft_p50_turns2_s'] * 1000:.0f} ms | {r['ttft_p99_turns2_s'] * 1000:.0f} ms | {r['pick_us']:.0f} us |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    sizes = sorted({r["replicas"] for r in rows})
    policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for policy in policies:
        mine = {r["replicas"]: r for r in rows if r["policy"] == policy and r["routers"] == rows[0]["routers"]}
        xs = [s for s in sizes if s in mine]
        axes[0].plot(xs, [mine[s]["cached_fraction_turns2"] for s in xs], marker="o", label=policy)
        axes[1].plot(xs, [mine[s]["ttft_p50_turns2_s"] for s in xs], marker="o", label=f"{policy} p50")
        axes[1].plot(xs, [mine[s]["ttft_p99_turns2_s"] for s in xs], marker="x", linestyle="--", label=f"{policy} p99")
        axes[2].plot(xs, [mine[s]["imbalance"] for s in xs], marker="o", label=policy)
    for ax, title in zip(axes, ("cached fraction of turns 2+", "TTFT of turns 2+ (s)", "busiest / mean replica")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("prefill replicas")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend()
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(sizes: list[int], config: SimConfig, json_path: str | None, plot_path: str | None) -> list[dict]:
    rows = run(sizes, config)
    print(markdown_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"config": config.__dict__, "rows": rows}, f, indent=1)
    if plot_path:
        plot(rows, plot_path)
    return rows
