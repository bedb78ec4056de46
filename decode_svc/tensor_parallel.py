"""A decode replica whose language model spans N processes (tensor parallelism, ``decode.tensor_parallel``).

Rank 0 is the decode role itself (the Ray actor: gRPC server, ``DecodeEngine``, scheduler, block
pool, membership); it starts ranks 1..N-1 as local processes (``python -m
decode_svc.tensor_parallel``) and joins them in a ``torch.distributed`` group (gloo on a CPU,
NCCL on a GPU is not wired yet): ``epd.tp_group``, which prefill's replica of N ranks shares.
Each rank holds its shard of the weights (``epd.tensor_parallel.shard_runner``: attention and
Gated DeltaNet heads, MLP and expert columns, the vocabulary) and a ``DecodeBatch`` of its shard of every request's state (its K/V
heads, its linear-attention heads), with the same block ids and slots on every rank.

Only rank 0 decides anything. Every operation the engine's loop thread makes on the batch
(``add``, ``move``, ``truncate``, ``state_of``) and every step is first broadcast to the other ranks
as a command (JSON in a uint8 tensor: nothing is pickled), then run by all of them in the same
order, so the collectives inside the forward (row-parallel all-reduces, the head's all-gather)
pair up. The engine sees one replica: ``TPRunner`` answers for the whole model (the state a
handoff carries is the whole state, checked against the whole model's shapes), ``TPBatch`` splits
an admitted state into its shards on the way in (each rank cuts its own from the broadcast whole)
and gathers a swapped-out one back into the whole state on rank 0. A prefill with any degree
hands its whole state to it unchanged.

Faults (``epd.tp_group``): a rank that dies takes the replica with it. Rank 0 watches its
followers and exits at once when one ends (a step whose collective fails also exits), so the
router resumes the replica's streams elsewhere and the controller restarts the replica as it
would any dead decode worker; a follower whose rank 0 is gone exits too (a failed collective, or
its parent process gone).
"""

from __future__ import annotations

import torch

from decode_svc.batch import DecodeBatch
from decode_svc.blocks import BlockPool
from epd.lm import HybridState, TextModelRunner
from epd.tensor_parallel import gather_state, split_state
from epd.tensors import forward_team
from epd.tp_group import FollowerGroup, broadcast_state, follower_main, receive, send, whole_shapes

# --------------------------------------------------------------------------- rank 0: what the engine sees


class TPRunner(TextModelRunner):
    """Rank 0's view of the whole model: shapes, sizes and checks of the whole state; a
    ``decode_step`` that every rank runs together. Shares the sharded runner's modules."""

    def __init__(self, local: TextModelRunner, world: int, group: FollowerGroup) -> None:
        super().__init__(model=local.model, lm_head_weight=local.lm_head_weight)
        self.lm_head = local.lm_head
        self.local = local
        self.world = world
        self.group = group

    def state_shapes(self, num_tokens: int) -> dict[str, tuple[int, ...]]:
        return whole_shapes(self.local, self.world, num_tokens)

    def decode_step(self, batch: TPBatch, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        if len(batch) == 0 or len(token_ids) != len(batch) or len(positions) != len(batch):
            return self.local.decode_step(batch.local, token_ids, positions)  # raises its ValueError

        def run() -> torch.Tensor:
            send({"op": "step", "tokens": list(token_ids), "positions": list(positions),
                  "tables": [list(table) for table in batch.local.tables], "lengths": batch.local.lengths})
            return self.local.decode_step(batch.local, token_ids, positions)

        return self.group.guard("decode step", run)


class TPBatch:
    """The ``DecodeBatch`` the engine drives on rank 0: each call runs on every rank's shard."""

    def __init__(self, runner: TPRunner, max_slots: int, pool: BlockPool) -> None:
        self.runner = runner
        self.local = DecodeBatch(runner.local, max_slots=max_slots, pool=pool)
        self.max_slots = max_slots
        self._guard("batch", lambda: send({"op": "batch", "max_slots": max_slots, "num_blocks": pool.num_blocks,
                                            "block_size": pool.block_size}))

    def __len__(self) -> int:
        return len(self.local)

    @property
    def lengths(self) -> list[int]:
        return self.local.lengths

    @property
    def tables(self) -> list[list[int]]:
        return self.local.tables

    def kv_bytes(self) -> int:
        return self.local.kv_bytes() * self.runner.world

    def slot_bytes(self) -> int:
        return self.local.slot_bytes() * self.runner.world

    def nbytes(self) -> int:
        return self.kv_bytes() + self.slot_bytes()

    def _guard(self, what: str, call):
        return self.runner.group.guard(what, call)

    def add(self, state: HybridState, blocks: list[int] | None = None) -> int:
        runner = self.runner
        runner.check_state(state)  # the whole state, before any rank is told anything
        if len(self.local) >= self.max_slots:
            raise ValueError(f"the decode batch has all {self.max_slots} slots in use")
        if blocks is None or len(blocks) * self.local.block_size < state.num_tokens:
            raise ValueError(f"{len(blocks or [])} K/V blocks cannot hold a {state.num_tokens}-token state")

        def run() -> int:
            send({"op": "add", "blocks": list(blocks), "num_tokens": state.num_tokens})
            whole = broadcast_state(state, runner.local, runner.world, state.num_tokens)
            return self.local.add(split_state(runner.local, whole, 0, runner.world), blocks)

        return self._guard("add", run)

    def move(self, src: int, dst: int) -> None:
        def run() -> None:
            send({"op": "move", "src": src, "dst": dst})
            self.local.move(src, dst)

        self._guard("move", run)

    def truncate(self, size: int) -> None:
        if size == len(self.local):
            return
        if not 0 <= size <= len(self.local):
            raise IndexError(f"cannot truncate a batch of {len(self.local)} to {size}")

        def run() -> None:
            send({"op": "truncate", "size": size})
            self.local.truncate(size)

        self._guard("truncate", run)

    def state_of(self, slot: int, blocks: list[int] | None = None, length: int | None = None) -> HybridState:
        """The slot's whole state (every rank's shard gathered): what a swapped-out request keeps."""
        blocks = list(self.local.tables[slot] if blocks is None else blocks)
        length = self.local.lengths[slot] if length is None else length

        def run() -> HybridState:
            send({"op": "state_of", "slot": slot, "blocks": blocks, "length": length})
            return gather_state(self.runner.local, self.local.state_of(slot, blocks, length), self.runner.world)

        return self._guard("state_of", run)


# --------------------------------------------------------------------------- the N processes


class TensorParallelGroup(FollowerGroup):
    """Rank 0's side (``epd.tp_group.FollowerGroup``), with the runner and batch the engine drives."""

    def __init__(self, model_dir: str, world: int, dtype: str, prepack: bool, num_threads: int, cpus: str,
                 start_timeout_s: float = 600) -> None:
        super().__init__("decode", "decode_svc.tensor_parallel", model_dir, world, dtype, prepack, num_threads,
                         cpus, start_timeout_s)
        self.runner = TPRunner(self.local, world, self)

    def make_batch(self, runner: TPRunner, max_slots: int, pool: BlockPool) -> TPBatch:
        return TPBatch(runner, max_slots, pool)


def follow(rank: int, world: int, runner: TextModelRunner) -> None:
    """A follower rank: run every command rank 0 broadcasts until ``stop``."""
    batch: DecodeBatch | None = None
    while True:
        message = receive()
        op = message["op"]
        if op == "stop":
            return
        if op == "batch":  # rank 0's engine made its batch: the same slots and block ids here
            # the same ids as rank 0's pool index this rank's shard of the K/V; rank 0 hands them out
            batch = DecodeBatch(runner, max_slots=message["max_slots"],
                                pool=BlockPool(message["num_blocks"], message["block_size"]))
        elif batch is None:
            raise RuntimeError(f"tensor-parallel command {op!r} before the batch was made")
        elif op == "step":
            if message["lengths"] != batch.lengths:
                raise RuntimeError(f"rank {rank} holds slots of lengths {batch.lengths}, rank 0 {message['lengths']}")
            for slot, table in enumerate(message["tables"]):
                batch.tables[slot][:] = table
            forward_team()  # this thread's team, given back if a C++ operator's first use reset it
            runner.decode_step(batch, message["tokens"], message["positions"])
        elif op == "add":
            whole = broadcast_state(None, runner, world, message["num_tokens"])
            batch.add(split_state(runner, whole, rank, world), list(message["blocks"]))
        elif op == "move":
            batch.move(message["src"], message["dst"])
        elif op == "truncate":
            batch.truncate(message["size"])
        elif op == "state_of":
            gather_state(runner, batch.state_of(message["slot"], message["blocks"], message["length"]), world)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op!r}")


def main(argv: list[str] | None = None) -> None:
    follower_main("decode", follow, argv)


if __name__ == "__main__":
    main()
