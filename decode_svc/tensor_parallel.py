"""A decode replica whose language model spans N processes (tensor parallelism, ``decode.tensor_parallel``).

Rank 0 is the decode role itself (the Ray actor: gRPC server, ``DecodeEngine``, scheduler, block
pool, membership); it starts ranks 1..N-1 as local processes (``python -m
decode_svc.tensor_parallel``) and joins them in a ``torch.distributed`` group (gloo on a CPU,
NCCL on a GPU is not wired yet). Each rank holds its shard of the weights
(``epd.tensor_parallel.shard_runner``: attention and Gated DeltaNet heads, MLP and expert
columns, the vocabulary) and a ``DecodeBatch`` of its shard of every request's state (its K/V
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

Faults: a rank that dies takes the replica with it. Rank 0 watches its followers and exits at
once when one ends (a step whose collective fails also exits), so the router resumes the
replica's streams elsewhere and the controller restarts the replica as it would any dead
decode worker; a follower whose rank 0 is gone exits too (a failed collective, or its parent
process gone).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from decode_svc.batch import DecodeBatch
from decode_svc.blocks import BlockPool
from epd.lm import HybridState, TextModelRunner
from epd.tensor_parallel import gather_state, shard_runner, split_state

log = logging.getLogger(__name__)

# an idle replica sends nothing for as long as no request comes: the followers wait that long
_IDLE_TIMEOUT = datetime.timedelta(days=7)


# --------------------------------------------------------------------------- the command channel


def _send(message: dict) -> None:
    payload = torch.frombuffer(bytearray(json.dumps(message, separators=(",", ":")).encode()), dtype=torch.uint8)
    dist.broadcast(torch.tensor([payload.numel()], dtype=torch.long), src=0)
    dist.broadcast(payload, src=0)


def _receive() -> dict:
    size = torch.zeros(1, dtype=torch.long)
    dist.broadcast(size, src=0)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=0)
    return json.loads(bytes(payload.numpy()).decode())


def _broadcast_state(state: HybridState | None, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype],
                     num_layers: int, num_tokens: int) -> HybridState:
    """Rank 0's whole ``state`` to every rank (the others pass None and get it)."""
    tensors = {}
    for name, shape in shapes.items():
        tensor = (state_tensor(state, name).contiguous() if state is not None
                  else torch.empty(shape, dtype=dtypes[name]))
        dist.broadcast(tensor, src=0)
        tensors[name] = tensor
    return HybridState.from_named_tensors(num_layers, num_tokens, tensors)


def state_tensor(state: HybridState, name: str) -> torch.Tensor:
    kind, layer = name.split(".")
    return getattr(state, kind)[int(layer)]


def whole_shapes(local: TextModelRunner, world: int, num_tokens: int) -> dict[str, tuple[int, ...]]:
    """The whole model's state shapes from a rank's sharded runner: every state tensor is split
    over the ranks along its head (or channel) dimension, 1."""
    return {name: (shape[0], shape[1] * world, *shape[2:]) for name, shape in local.state_shapes(num_tokens).items()}


# --------------------------------------------------------------------------- rank 0: what the engine sees


class TPRunner(TextModelRunner):
    """Rank 0's view of the whole model: shapes, sizes and checks of the whole state; a
    ``decode_step`` that every rank runs together. Shares the sharded runner's modules."""

    def __init__(self, local: TextModelRunner, world: int, on_failure) -> None:
        super().__init__(model=local.model, lm_head_weight=local.lm_head_weight)
        self.lm_head = local.lm_head
        self.local = local
        self.world = world
        self._on_failure = on_failure

    def state_shapes(self, num_tokens: int) -> dict[str, tuple[int, ...]]:
        return whole_shapes(self.local, self.world, num_tokens)

    def decode_step(self, batch: TPBatch, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        if len(batch) == 0 or len(token_ids) != len(batch) or len(positions) != len(batch):
            return self.local.decode_step(batch.local, token_ids, positions)  # raises its ValueError
        try:
            _send({"op": "step", "tokens": list(token_ids), "positions": list(positions),
                   "tables": [list(table) for table in batch.local.tables], "lengths": batch.local.lengths})
            return self.local.decode_step(batch.local, token_ids, positions)
        except Exception as error:  # noqa: BLE001 - a rank is gone or out of step: the replica ends
            self._on_failure(f"decode step: {error}")
            raise


class TPBatch:
    """The ``DecodeBatch`` the engine drives on rank 0: each call runs on every rank's shard."""

    def __init__(self, runner: TPRunner, max_slots: int, pool: BlockPool) -> None:
        self.runner = runner
        self.local = DecodeBatch(runner.local, max_slots=max_slots, pool=pool)
        self.max_slots = max_slots
        self._guard("batch", lambda: _send({"op": "batch", "max_slots": max_slots, "num_blocks": pool.num_blocks,
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
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - ranks out of step: the replica ends
            self.runner._on_failure(f"{what}: {error}")
            raise

    def add(self, state: HybridState, blocks: list[int] | None = None) -> int:
        runner = self.runner
        runner.check_state(state)  # the whole state, before any rank is told anything
        if len(self.local) >= self.max_slots:
            raise ValueError(f"the decode batch has all {self.max_slots} slots in use")
        if blocks is None or len(blocks) * self.local.block_size < state.num_tokens:
            raise ValueError(f"{len(blocks or [])} K/V blocks cannot hold a {state.num_tokens}-token state")

        def run() -> int:
            _send({"op": "add", "blocks": list(blocks), "num_tokens": state.num_tokens})
            shapes = runner.state_shapes(state.num_tokens)
            whole = _broadcast_state(state, shapes, {n: runner.state_dtype(n) for n in shapes}, runner.num_layers,
                                     state.num_tokens)
            return self.local.add(split_state(runner.local, whole, 0, runner.world), blocks)

        return self._guard("add", run)

    def move(self, src: int, dst: int) -> None:
        def run() -> None:
            _send({"op": "move", "src": src, "dst": dst})
            self.local.move(src, dst)

        self._guard("move", run)

    def truncate(self, size: int) -> None:
        if size == len(self.local):
            return
        if not 0 <= size <= len(self.local):
            raise IndexError(f"cannot truncate a batch of {len(self.local)} to {size}")

        def run() -> None:
            _send({"op": "truncate", "size": size})
            self.local.truncate(size)

        self._guard("truncate", run)

    def state_of(self, slot: int, blocks: list[int] | None = None, length: int | None = None) -> HybridState:
        """The slot's whole state (every rank's shard gathered): what a swapped-out request keeps."""
        blocks = list(self.local.tables[slot] if blocks is None else blocks)
        length = self.local.lengths[slot] if length is None else length

        def run() -> HybridState:
            _send({"op": "state_of", "slot": slot, "blocks": blocks, "length": length})
            return gather_state(self.runner.local, self.local.state_of(slot, blocks, length), self.runner.world)

        return self._guard("state_of", run)


# --------------------------------------------------------------------------- the N processes


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def load_shard(model_dir: str, dtype: str, rank: int, world: int, prepack: bool) -> TextModelRunner:
    """This rank's shard of the language model (on a CPU, its linears pre-packed after the cut).

    The whole model is opened in the dtype it is stored in: safetensors maps the files, so no
    weight is copied until the cut copies this rank's slices (the pages it read are page cache,
    shared by the ranks), each converted to ``dtype`` as it is cut: a rank never holds a converted
    copy of the whole model."""
    from epd import checkpoint, kernels
    from epd.tensors import dtype_name, parse_dtype

    stored = checkpoint.stored_dtype(model_dir)
    runner = TextModelRunner.load(model_dir, dtype=dtype_name(stored), device="cpu", prepack=False)
    runner = shard_runner(runner, rank, world, dtype=parse_dtype(dtype))
    if prepack and kernels.can_prepack(runner.device, runner.dtype):
        kernels.prepack_linears(runner.model)  # not the head: it is this rank's vocabulary rows
    return runner


class TensorParallelGroup:
    """Rank 0's side: starts the followers, joins the group, watches them, stops them."""

    def __init__(self, model_dir: str, world: int, dtype: str, prepack: bool, num_threads: int, cpus: str,
                 start_timeout_s: float = 600) -> None:
        self.world = world
        self._stopping = False
        port = free_port()
        common = ["--world", str(world), "--port", str(port), "--model", model_dir, "--dtype", dtype,
                  "--num-threads", str(num_threads), "--cpus", cpus,
                  *([] if prepack else ["--no-prepack"])]
        self.followers = [subprocess.Popen([sys.executable, "-m", "decode_svc.tensor_parallel", "--rank", str(rank),
                                            *common], stdin=subprocess.DEVNULL)
                          for rank in range(1, world)]
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                    timeout=datetime.timedelta(seconds=start_timeout_s))
            self.local = load_shard(model_dir, dtype, 0, world, prepack)
            _send({"op": "ready"})  # every follower has loaded its shard once this returns
            # from here on a follower may wait for a command as long as the replica is idle
        except BaseException:
            self.kill()
            raise
        self.runner = TPRunner(self.local, world, self.fail)
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()
        log.info("decode: tensor parallel over %d ranks (pids %s), gloo", world,
                 [os.getpid(), *(p.pid for p in self.followers)])

    def make_batch(self, runner: TPRunner, max_slots: int, pool: BlockPool) -> TPBatch:
        return TPBatch(runner, max_slots, pool)

    def _watch(self) -> None:
        while not self._stopping:
            for rank, process in enumerate(self.followers, start=1):
                if process.poll() is not None and not self._stopping:
                    self.fail(f"rank {rank} (pid {process.pid}) exited with {process.returncode}")
            time.sleep(0.2)

    def fail(self, why: str) -> None:
        """A rank is gone or the ranks are out of step: end the whole replica now, so its streams
        break (the router resumes them) and the controller restarts it."""
        if self._stopping:
            return
        log.error("decode: tensor-parallel replica lost a rank (%s); exiting so it is restarted", why)
        self.kill()
        os._exit(1)

    def kill(self) -> None:
        for process in self.followers:
            if process.poll() is None:
                process.kill()
        for process in self.followers:
            process.wait()

    def stop(self) -> None:
        """After the engine's loop has ended (no other thread sends): tell the followers to exit."""
        self._stopping = True
        try:
            _send({"op": "stop"})
        except Exception:  # noqa: BLE001 - a follower already gone
            pass
        deadline = time.monotonic() + 5
        for process in self.followers:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def follow(rank: int, world: int, port: int, model_dir: str, dtype: str, prepack: bool) -> None:
    """A follower rank: load its shard, then run every command rank 0 broadcasts until ``stop``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=_IDLE_TIMEOUT)
    runner = load_shard(model_dir, dtype, rank, world, prepack)
    batch: DecodeBatch | None = None
    while True:
        message = _receive()
        op = message["op"]
        if op == "ready":
            continue
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
            runner.decode_step(batch, message["tokens"], message["positions"])
        elif op == "add":
            num_tokens = message["num_tokens"]
            shapes = whole_shapes(runner, world, num_tokens)
            whole = _broadcast_state(None, shapes, {n: runner.state_dtype(n) for n in shapes}, runner.num_layers,
                                     num_tokens)
            batch.add(split_state(runner, whole, rank, world), list(message["blocks"]))
        elif op == "move":
            batch.move(message["src"], message["dst"])
        elif op == "truncate":
            batch.truncate(message["size"])
        elif op == "state_of":
            gather_state(runner, batch.state_of(message["slot"], message["blocks"], message["length"]), world)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op!r}")


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)  # rank 0 is gone: so is the replica


def main(argv: list[str] | None = None) -> None:
    import argparse

    from epd.tensors import configure_threads

    parser = argparse.ArgumentParser(description="a follower rank of a tensor-parallel decode replica")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--cpus", default="")
    parser.add_argument("--no-prepack", dest="prepack", action="store_false")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp rank {args.rank} %(levelname)s %(message)s")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    # A follower computes in lockstep with rank 0, which sizes the step's threads for the replica
    # (epd.core_share): it takes no share of its own.
    os.environ.pop("EPD_CORE_SHARE", None)
    configure_threads(args.num_threads, args.cpus)
    try:
        follow(args.rank, args.world, args.port, args.model, args.dtype, args.prepack)
    except Exception as error:  # noqa: BLE001 - rank 0 gone (a failed collective) or out of step
        log.error("tensor-parallel rank %d stops: %s", args.rank, error)
        sys.exit(1)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


if __name__ == "__main__":
    main()
