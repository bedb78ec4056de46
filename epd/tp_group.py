"""The machinery a tensor-parallel replica of a model role shares, whichever role it is
(``prefill_svc.tensor_parallel``, ``decode_svc.tensor_parallel``): its N processes, the command
channel between them, and each rank's shard of the weights (``epd.tensor_parallel``).

Rank 0 is the role's own process (the Ray actor: gRPC, engine, scheduler); ``FollowerGroup``
starts ranks 1..N-1 as local processes (``python -m <the role's follower module>``), joins them in
a ``torch.distributed`` group (gloo over loopback; NCCL on a GPU is not wired yet), waits until
every rank has loaded its shard, watches them and stops them. Only rank 0 decides: every
operation that runs a collective is first broadcast to the followers as a command (JSON in a
uint8 tensor: nothing is pickled), then run by every rank in the same order, so the collectives
inside it pair up. Commands are sent from one thread of rank 0 only.

Faults: a follower that ends takes its replica with it (``fail``: rank 0 exits at once, so the
replica's callers retry elsewhere and the controller restarts it as any dead replica); a follower
whose rank 0 is gone exits too (a failed collective, or its parent process gone:
``follower_main``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from epd.lm import HybridState, TextModelRunner
from epd.tensor_parallel import shard_runner

log = logging.getLogger(__name__)

# an idle replica sends nothing for as long as no request comes: the followers wait that long
# (bounded anyway by their watch of the parent process)
IDLE_TIMEOUT = datetime.timedelta(days=7)


# --------------------------------------------------------------------------- the command channel


def send(message: dict) -> None:
    """Rank 0: one command to every follower."""
    payload = torch.frombuffer(bytearray(json.dumps(message, separators=(",", ":")).encode()), dtype=torch.uint8)
    dist.broadcast(torch.tensor([payload.numel()], dtype=torch.long), src=0)
    dist.broadcast(payload, src=0)


def receive() -> dict:
    """A follower: the next command rank 0 sends."""
    size = torch.zeros(1, dtype=torch.long)
    dist.broadcast(size, src=0)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=0)
    return json.loads(bytes(payload.numpy()).decode())


def broadcast_tensor(tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank 0's ``tensor`` to every rank (the followers pass None and get a new one of
    ``shape``/``dtype``, which a command told them)."""
    out = tensor.contiguous() if tensor is not None else torch.empty(shape, dtype=dtype)
    dist.broadcast(out, src=0)
    return out


def broadcast_state(state: HybridState | None, runner: TextModelRunner, world: int, num_tokens: int) -> HybridState:
    """Rank 0's whole ``state`` to every rank (the others pass None and get it); ``runner`` is the
    rank's sharded runner, which gives the whole state's shapes."""
    tensors = {}
    for name, shape in whole_shapes(runner, world, num_tokens).items():
        tensors[name] = broadcast_tensor(state_tensor(state, name) if state is not None else None, shape,
                                         runner.state_dtype(name))
    return HybridState.from_named_tensors(runner.num_layers, num_tokens, tensors)


def state_tensor(state: HybridState, name: str) -> torch.Tensor:
    kind, layer = name.split(".")
    return getattr(state, kind)[int(layer)]


def whole_shapes(local: TextModelRunner, world: int, num_tokens: int) -> dict[str, tuple[int, ...]]:
    """The whole model's state shapes from a rank's sharded runner: every state tensor is split
    over the ranks along its head (or channel) dimension, 1."""
    return {name: (shape[0], shape[1] * world, *shape[2:]) for name, shape in local.state_shapes(num_tokens).items()}


# --------------------------------------------------------------------------- the shards


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


# --------------------------------------------------------------------------- rank 0


class FollowerGroup:
    """Rank 0's side: starts the followers (``python -m follower_module``), joins the group, loads
    its own shard (``local``), watches the followers, stops them."""

    def __init__(self, role: str, follower_module: str, model_dir: str, world: int, dtype: str, prepack: bool,
                 num_threads: int, cpus: str, start_timeout_s: float = 600) -> None:
        self.role = role
        self.world = world
        self._stopping = False
        port = free_port()
        common = ["--world", str(world), "--port", str(port), "--model", model_dir, "--dtype", dtype,
                  "--num-threads", str(num_threads), "--cpus", cpus, *([] if prepack else ["--no-prepack"])]
        self.followers = [subprocess.Popen([sys.executable, "-m", follower_module, "--rank", str(rank), *common],
                                           stdin=subprocess.DEVNULL)
                          for rank in range(1, world)]
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                    timeout=datetime.timedelta(seconds=start_timeout_s))
            self.local = load_shard(model_dir, dtype, 0, world, prepack)
            send({"op": "ready"})  # every follower has loaded its shard once this returns
            # from here on a follower may wait for a command as long as the replica is idle
        except BaseException:
            self.kill()
            raise
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()
        log.info("%s: tensor parallel over %d ranks (pids %s), gloo", role, world,
                 [os.getpid(), *(p.pid for p in self.followers)])

    def _watch(self) -> None:
        while not self._stopping:
            for rank, process in enumerate(self.followers, start=1):
                if process.poll() is not None and not self._stopping:
                    self.fail(f"rank {rank} (pid {process.pid}) exited with {process.returncode}")
            time.sleep(0.2)

    def fail(self, why: str) -> None:
        """A rank is gone or the ranks are out of step: end the whole replica now, so its callers
        retry elsewhere and the controller restarts it."""
        if self._stopping:
            return
        log.error("%s: tensor-parallel replica lost a rank (%s); exiting so it is restarted", self.role, why)
        self.kill()
        os._exit(1)

    def guard(self, what: str, call: Callable):
        """``call()``; any failure (a rank gone, the ranks out of step) ends the replica (``fail``)."""
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - the replica ends
            self.fail(f"{what}: {error}")
            raise

    def kill(self) -> None:
        for process in self.followers:
            if process.poll() is None:
                process.kill()
        for process in self.followers:
            process.wait()

    def stop(self) -> None:
        """After the engine has stopped (no other thread sends): tell the followers to exit."""
        self._stopping = True
        try:
            send({"op": "stop"})
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


# --------------------------------------------------------------------------- a follower


def join(rank: int, world: int, port: int, model_dir: str, dtype: str, prepack: bool) -> TextModelRunner:
    """A follower: join rank 0's group, load this rank's shard, wait for ``ready``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=IDLE_TIMEOUT)
    runner = load_shard(model_dir, dtype, rank, world, prepack)
    message = receive()
    if message["op"] != "ready":
        raise RuntimeError(f"tensor-parallel command {message['op']!r} before ready")
    return runner


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)  # rank 0 is gone: so is the replica


def follower_main(role: str, follow: Callable[[int, int, TextModelRunner], None], argv: list[str] | None) -> None:
    """The ``__main__`` of a role's follower module: ``follow(rank, world, runner)`` runs every
    command rank 0 sends until ``stop``; the process exits non-zero on any failure and at once
    when rank 0's process is gone."""
    from epd.tensors import configure_threads

    parser = argparse.ArgumentParser(description=f"a follower rank of a tensor-parallel {role} replica")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--cpus", default="")
    parser.add_argument("--no-prepack", dest="prepack", action="store_false")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {role} tp rank {args.rank} %(levelname)s %(message)s")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    # A follower computes in lockstep with rank 0, which sizes the step's threads for the replica
    # (epd.core_share): it takes no share of its own.
    os.environ.pop("EPD_CORE_SHARE", None)
    configure_threads(args.num_threads, args.cpus)
    try:
        runner = join(args.rank, args.world, args.port, args.model, args.dtype, args.prepack)
        follow(args.rank, args.world, runner)
    except Exception as error:  # noqa: BLE001 - rank 0 gone (a failed collective) or out of step
        log.error("%s tensor-parallel rank %d stops: %s", role, args.rank, error)
        sys.exit(1)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
