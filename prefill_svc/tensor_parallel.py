"""A prefill replica whose language model spans N processes (tensor parallelism, ``prefill.tensor_parallel``).

Rank 0 is the prefill role itself (the Ray actor: gRPC server, ``PrefillEngine``, its scheduler,
both caches, membership); it starts ranks 1..N-1 as local processes (``python -m
prefill_svc.tensor_parallel``) and joins them in a gloo group (``epd.tp_group``, shared with
decode's replica of N ranks). Each rank holds its shard of the weights
(``epd.tensor_parallel.shard_runner``) and its shard of the state of every prompt being computed
(its K/V heads, its linear-attention heads), by an id rank 0 gives the prompt.

Only rank 0 decides. The engine's scheduler thread is the only one that sends: each forward (the
chunks of every prompt in it: their ids and lengths, the spliced embeddings and M-RoPE positions
broadcast from rank 0, so the followers need no store and no image), each LM-head call (the
hidden rows broadcast; the head is vocabulary-parallel) and each gather of a prompt's whole state
is a command all ranks run in the same order. The whole state exists only on rank 0, when the
engine asks for it (``TPRunner.whole``): a prefix snapshot and the handoff, so any decode (TP=1 or
TP=b) takes it unchanged. A cached prefix the engine restores is split on the way in: rank 0 cuts
its shard at once and broadcasts the whole with the prompt's first forward, from which each
follower cuts its own. A prompt that ends (done, failed, cancelled, from any thread) has its
shards dropped with the next command (``end``).

Faults as decode's (``epd.tp_group``): a follower that ends takes the replica down at once (the
router retries its prompts on another prefill replica; the controller restarts it), a follower
whose rank 0 is gone exits.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epd.lm import HybridState, TextModelRunner
from epd.tensor_parallel import gather_state, split_state
from epd.tensors import dtype_name, forward_team, parse_dtype
from epd.tp_group import FollowerGroup, broadcast_state, broadcast_tensor, follower_main, receive, send, whole_shapes


@dataclass(eq=False)
class ShardedState(HybridState):
    """Rank 0's shard of a prompt's state; the followers hold theirs under the same ``shard_id``."""

    shard_id: int = 0
    restored: HybridState | None = None  # a cached prefix's whole state, until the followers are sent it
    ended: bool = False  # the followers drop their shards with the next command (or have)
    released: bool = False  # the followers dropped them after its last gather: nothing more runs on it


class TPRunner(TextModelRunner):
    """Rank 0's view of the whole model for the prefill engine: the whole state's shapes and sizes,
    forwards and LM-head calls that every rank runs together, and (``PromptStates``) the prompts'
    sharded states. Shares the sharded runner's modules (the embedding is whole on every rank)."""

    def __init__(self, local: TextModelRunner, world: int, group: FollowerGroup) -> None:
        super().__init__(model=local.model, lm_head_weight=local.lm_head_weight)
        self.lm_head = local.lm_head
        self.local = local
        self.world = world
        self.group = group
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._ended: list[int] = []  # shards the followers drop with the next command

    def state_shapes(self, num_tokens: int) -> dict[str, tuple[int, ...]]:
        return whole_shapes(self.local, self.world, num_tokens)

    # ------------------------------------------------------------ the prompts' states (PromptStates)

    def start(self, cached: HybridState | None) -> ShardedState:
        with self._lock:
            shard_id = next(self._ids)
        state = ShardedState.empty(self.num_layers)
        state.shard_id = shard_id
        if cached is not None:  # this rank's cut now; the followers cut theirs at its first forward
            shard = split_state(self.local, cached, 0, self.world)
            state.keys, state.values, state.conv, state.recurrent = shard.keys, shard.values, shard.conv, \
                shard.recurrent
            state.num_tokens, state.restored = cached.num_tokens, cached
        return state

    def whole(self, state: HybridState, release: bool = False) -> HybridState:
        if not isinstance(state, ShardedState):
            return state
        if state.released:
            raise ValueError(f"prompt state {state.shard_id} was released")
        if state.restored is not None:  # never computed on: the followers were never sent it
            whole = state.restored
        else:
            def run() -> HybridState:
                send({"op": "gather", "id": state.shard_id, "release": release, "drop": self._take_ended()})
                return gather_state(self.local, state, self.world)

            whole = self.group.guard("prefill gather", run)
        if release:
            state.ended = state.released = True
        return whole

    def end(self, state: HybridState) -> None:
        if isinstance(state, ShardedState) and not state.ended:
            state.ended = True
            with self._lock:
                self._ended.append(state.shard_id)

    def held_shards(self) -> list[int]:
        """How many prompts' shards each follower holds, after the drops due (a check for tests and
        debugging: it sends a command, so only call it while the engine is idle)."""
        def run() -> list[int]:
            send({"op": "held", "drop": self._take_ended()})
            counts = [torch.zeros(1, dtype=torch.long) for _ in range(self.world)]
            dist.all_gather(counts, torch.zeros(1, dtype=torch.long))
            return [int(count) for count in counts[1:]]

        return self.group.guard("prefill held", run)

    def _take_ended(self) -> list[int]:
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    # ------------------------------------------------------------ what runs on every rank

    def forward_rows(self, chunks: list[tuple[torch.Tensor, torch.Tensor, HybridState]],
                     every_row: frozenset[int] = frozenset()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        states = [state for _, _, state in chunks]
        for state in states:
            # one that ended (its prompt was cancelled since the batch was picked) still runs: its
            # shards are dropped after this command, which carries the drop
            if not isinstance(state, ShardedState) or state.released:
                raise ValueError("a tensor-parallel prefill computes on states it started (and has not released)")
        lengths = [embeds.shape[0] for embeds, _, _ in chunks]
        embeds = torch.cat([e.to(self.device, self.dtype) for e, _, _ in chunks])  # [ΣT, hidden]
        positions = torch.cat([p for _, p, _ in chunks], dim=1).to(torch.long)  # [3, ΣT]
        restored = [state for state in states if state.restored is not None]

        def run() -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
            send({"op": "forward", "ids": [s.shard_id for s in states], "lengths": lengths,
                  "every_row": sorted(every_row), "dtype": dtype_name(embeds.dtype),
                  "restored": [[s.shard_id, s.restored.num_tokens] for s in restored], "drop": self._take_ended()})
            for state in restored:
                broadcast_state(state.restored, self.local, self.world, state.restored.num_tokens)
                state.restored = None
            broadcast_tensor(embeds, (), embeds.dtype)
            broadcast_tensor(positions, (), positions.dtype)
            return self.local.forward_rows(_chunks(embeds, positions, lengths, states), every_row)

        return self.group.guard("prefill forward", run)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        def run() -> torch.Tensor:
            send({"op": "logits", "shape": list(hidden.shape), "dtype": dtype_name(hidden.dtype),
                  "drop": self._take_ended()})
            return self.local.logits(broadcast_tensor(hidden, (), hidden.dtype))

        return self.group.guard("prefill logits", run)


def _chunks(embeds: torch.Tensor, positions: torch.Tensor, lengths: list[int], states: list[HybridState]):
    out, start = [], 0
    for length, state in zip(lengths, states):
        out.append((embeds[start:start + length], positions[:, start:start + length], state))
        start += length
    return out


class TensorParallelGroup(FollowerGroup):
    """Rank 0's side (``epd.tp_group.FollowerGroup``), with the runner the engine drives."""

    def __init__(self, model_dir: str, world: int, dtype: str, prepack: bool, num_threads: int, cpus: str,
                 start_timeout_s: float = 600) -> None:
        super().__init__("prefill", "prefill_svc.tensor_parallel", model_dir, world, dtype, prepack, num_threads,
                         cpus, start_timeout_s)
        self.runner = TPRunner(self.local, world, self)


def follow(rank: int, world: int, runner: TextModelRunner) -> None:
    """A follower rank: run every command rank 0 broadcasts until ``stop``."""
    states: dict[int, HybridState] = {}
    hidden_size = runner.model.config.hidden_size
    while True:
        message = receive()
        op = message["op"]
        if op == "stop":
            return
        if op == "held":
            for shard_id in message["drop"]:
                states.pop(shard_id, None)
            dist.all_gather([torch.zeros(1, dtype=torch.long) for _ in range(world)],
                            torch.tensor([len(states)], dtype=torch.long))
        elif op == "forward":
            for shard_id, num_tokens in message["restored"]:
                states[shard_id] = split_state(runner, broadcast_state(None, runner, world, num_tokens), rank, world)
            lengths = message["lengths"]
            embeds = broadcast_tensor(None, (sum(lengths), hidden_size), parse_dtype(message["dtype"]))
            positions = broadcast_tensor(None, (3, sum(lengths)), torch.long)
            prompt_states = [states.setdefault(shard_id, runner.new_state()) for shard_id in message["ids"]]
            forward_team()  # this thread's team, given back if a C++ operator's first use reset it
            runner.forward_rows(_chunks(embeds, positions, lengths, prompt_states), frozenset(message["every_row"]))
        elif op == "logits":
            forward_team()
            runner.logits(broadcast_tensor(None, tuple(message["shape"]), parse_dtype(message["dtype"])))
        elif op == "gather":
            gather_state(runner, states[message["id"]], world)
            if message["release"]:
                del states[message["id"]]
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op!r}")
        for shard_id in message.get("drop", ()):  # after the command: a prompt may end as it runs
            states.pop(shard_id, None)


def main(argv: list[str] | None = None) -> None:
    follower_main("prefill", follow, argv)


if __name__ == "__main__":
    main()
