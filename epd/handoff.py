"""The prefill -> decode handoff on the wire: one header, then raw tensor bytes in chunks.

The header lists each tensor's name, dtype and shape; the bytes follow back to back in that order,
cut into chunks small enough for gRPC's message limits. No pickle anywhere.

When sender and receiver share a host, the bytes need not cross gRPC at all: the sender writes
them once into a file of the host's shared-memory directory (``shared_dir``: ``/dev/shm``, a
tmpfs) and sends the header alone, naming the file (``shared_file``); the receiver checks the
header as ever, maps the file copy-on-write (its tensors are views of the mapping, nothing is
copied until decode moves the state into its slot) and removes it. Measured on a two-core host
(docs/BENCHMARKS.md, "The handoff on one host"): a ~21 MB state streamed as 1 MiB chunks cost
both processes' Python threads tens of milliseconds each, and a wave of handoffs at once, with
both roles computing, seconds. A receiver that cannot see the file (another host, another mount
namespace) answers FAILED_PRECONDITION, and the sender streams to it from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import re
import stat
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

import torch

from epd import errors, tensors
from epd.core_share import pid_alive
from epd.lm import HybridState, TextModelRunner
from epd.v1 import epd_pb2

CHUNK_BYTES = 1 << 20
SHARED_DIR_ENV = "EPD_HANDOFF_SHARED_DIR"  # where same-host handoffs are written; empty: never
SHARED_PREFIX = "epd-handoff-"
_SHARED_NAME = re.compile(rf"{SHARED_PREFIX}(\d+)-[0-9a-f]{{32}}")  # <writer pid>-<uuid4 hex>
SHARED_ALIGN = 64  # each tensor of a shared file starts on a 64-byte boundary (views of any dtype)


def shared_dir() -> str:
    """The host's shared-memory directory for handoffs (``EPD_HANDOFF_SHARED_DIR``, default
    ``/dev/shm``); empty when there is none (same-host handoffs then stream like any other)."""
    path = os.environ.get(SHARED_DIR_ENV, "/dev/shm")
    return path if path and os.path.isdir(path) else ""


def _shared_layout(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Each tensor's offset in a shared file, and the file's size."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // SHARED_ALIGN) * SHARED_ALIGN
    return offsets, end


def write_shared(header: epd_pb2.HandoffHeader, state: HybridState) -> str | None:
    """Fill ``header.tensors`` from ``state``, write the tensors' bytes into a new file of
    ``shared_dir()`` (only this user may read it) and name it in ``header.shared_file``; returns
    its path, which the caller removes once the handoff has ended (the receiver removes it as it
    maps it). None, and nothing left behind, when there is no such directory or it is full (a
    container's small ``/dev/shm``): the caller streams the bytes."""
    directory = shared_dir()
    if not directory:
        return None
    named = state.named_tensors()
    _fill_specs(header, named)
    flats = [tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for _, tensor in named]
    offsets, size = _shared_layout(flat.numel() for flat in flats)
    name = f"{SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        try:
            os.ftruncate(fd, size)
            for flat, offset in zip(flats, offsets):
                view = memoryview(flat.numpy())
                while view:  # tmpfs allocates as it is written: a full one fails here, never later
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
        finally:
            os.close(fd)
    except OSError:
        remove_shared(path)
        return None
    header.shared_file = name
    return path


def remove_shared(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_stale_shared(directory: str | None = None) -> int:
    """Remove the handoff files of writers that are gone (a sender killed between writing one and
    the end of its handoff leaves it behind); returns how many. A prefill servicer calls it as it
    starts, so a restarted one cleans up after the one it replaces."""
    directory = shared_dir() if directory is None else directory
    removed = 0
    if not directory:
        return removed
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            match = _SHARED_NAME.fullmatch(name)
            if match and not pid_alive(int(match.group(1))):
                remove_shared(os.path.join(directory, name))
                removed += 1
    return removed


def shared_parts(header: epd_pb2.HandoffHeader) -> Iterator[epd_pb2.HandoffChunk]:
    """The stream of a handoff whose bytes are in a shared file: the header alone."""
    yield epd_pb2.HandoffChunk(header=header)


@dataclass
class Handoff:
    """A request as decode receives it."""

    header: epd_pb2.HandoffHeader
    state: HybridState


def chunks(header: epd_pb2.HandoffHeader, state: HybridState, chunk_bytes: int = CHUNK_BYTES) -> Iterator[epd_pb2.HandoffChunk]:
    """Fill ``header.tensors`` from ``state`` and yield the header chunk, then the data chunks."""
    named = state.named_tensors()
    _fill_specs(header, named)
    header.ClearField("shared_file")
    yield epd_pb2.HandoffChunk(header=header)
    pending = bytearray()
    for _, tensor in named:
        pending += tensors.to_bytes(tensor)
        while len(pending) >= chunk_bytes:
            yield epd_pb2.HandoffChunk(data=bytes(pending[:chunk_bytes]))
            del pending[:chunk_bytes]
    if pending:
        yield epd_pb2.HandoffChunk(data=bytes(pending))


def _fill_specs(header: epd_pb2.HandoffHeader, named: list[tuple[str, torch.Tensor]]) -> None:
    del header.tensors[:]
    for name, tensor in named:
        header.tensors.add(name=name, dtype=tensors.dtype_name(tensor.dtype), shape=list(tensor.shape))


async def chunks_async(header: epd_pb2.HandoffHeader, state: HybridState,
                       chunk_bytes: int = CHUNK_BYTES) -> AsyncIterator[epd_pb2.HandoffChunk]:
    """``chunks`` for an asyncio client stream: each chunk is cut on an executor thread, so the
    event loop never copies tensor bytes."""
    loop = asyncio.get_running_loop()
    parts = chunks(header, state, chunk_bytes)
    while True:
        part = await loop.run_in_executor(None, next, parts, None)
        if part is None:
            return
        yield part


class Receiver:
    """Rebuilds a handoff chunk by chunk without trusting its header.

    With the receiving model's ``runner``, the header is checked against the model before anything
    is kept: the prompt length, and the prompt plus the tokens still to generate, within the
    model's positions, the first token within its vocabulary, and exactly the tensors a state of
    that length has (names, shapes, dtypes). Without one, each spec must still be a supported
    dtype and non-negative sizes. Either way bytes are kept only up to what the header lists, so a
    forged or corrupt stream costs at most the size of a real state, and tensors are built only
    once every byte has arrived. Raises ValueError; ``errors.FailedPrecondition`` for a header
    naming a shared file this host cannot read (``shared_directory``, default ``shared_dir()``)."""

    def __init__(self, num_layers: int, device: torch.device | str = "cpu", runner: TextModelRunner | None = None,
                 shared_directory: str | None = None):
        self.num_layers = num_layers
        self.device = device
        self.runner = runner
        self.shared_directory = shared_directory  # where a shared file is looked for; None: shared_dir()
        self.header: epd_pb2.HandoffHeader | None = None
        self._sizes: list[int] = []
        self._total = 0
        self._data = bytearray()
        self._shared = False  # the bytes are in a shared file, not in data chunks

    def add(self, part: epd_pb2.HandoffChunk) -> None:
        kind = part.WhichOneof("part")
        if self.header is None:
            if kind != "header":
                raise ValueError("handoff stream must start with a header")
            self._check_header(part.header)
            self.header = part.header
            return
        if kind != "data":
            raise ValueError("handoff stream has a second header")
        if self._shared:
            raise ValueError("handoff stream has data chunks but its header names a shared file")
        excess = len(self._data) + len(part.data) - self._total
        if excess > 0:
            raise ValueError(f"handoff stream has {excess} bytes past its last tensor (its header lists {self._total})")
        self._data += part.data

    def finish(self) -> Handoff:
        if self.header is None:
            raise ValueError("handoff stream must start with a header")
        if self._shared:
            named = self._map_shared()
        else:
            named = {}
            offset = 0
            view = memoryview(self._data)
            for spec, size in zip(self.header.tensors, self._sizes):
                if offset + size > len(self._data):
                    raise ValueError(f"handoff stream ended inside tensor {spec.name!r}")
                named[spec.name] = tensors.from_bytes(view[offset : offset + size], spec.dtype,
                                                      spec.shape).to(self.device)
                offset += size
            view.release()
        state = HybridState.from_named_tensors(self.num_layers, self.header.prompt_len, named)
        if self.runner is not None:
            self.runner.check_state(state)
        return Handoff(header=self.header, state=state)

    def _map_shared(self) -> dict[str, torch.Tensor]:
        """The tensors of the header's shared file, as copy-on-write views of its mapping; the
        file is removed once mapped (the mapping keeps its pages until the last view is freed).
        ``errors.FailedPrecondition`` where this host cannot read it (the sender then streams)."""
        name = self.header.shared_file
        directory = shared_dir() if self.shared_directory is None else self.shared_directory
        if not directory:
            raise errors.FailedPrecondition(f"handoff: no shared-memory directory here to read {name} from")
        path = os.path.join(directory, name)
        try:  # O_NOFOLLOW: a link planted in a shared directory is never followed
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as error:
            raise errors.FailedPrecondition(f"handoff: shared file {name} cannot be read here ({error.strerror})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise errors.FailedPrecondition(f"handoff: shared file {name} is not a file of this user")
            offsets, size = _shared_layout(self._sizes)
            if info.st_size != size:
                raise ValueError(f"handoff shared file holds {info.st_size} bytes; its header lists {size}")
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
        finally:
            os.close(fd)
        remove_shared(path)
        named = {}
        for spec, size, offset in zip(self.header.tensors, self._sizes, offsets):
            dtype = tensors.parse_dtype(spec.dtype)
            if size:
                flat = torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=offset)
                tensor = flat.view(dtype).reshape(tuple(spec.shape))
            else:
                tensor = torch.empty(tuple(spec.shape), dtype=dtype)
            named[spec.name] = tensor.to(self.device)
        return named

    def _check_header(self, header: epd_pb2.HandoffHeader) -> None:
        if header.shared_file and not _SHARED_NAME.fullmatch(header.shared_file):
            raise ValueError(f"handoff shared_file {header.shared_file[:80]!r} is not a handoff file's name")
        self._shared = bool(header.shared_file)
        names = [spec.name for spec in header.tensors]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"handoff stream lists tensor {name!r} twice")
        for spec in header.tensors:
            if spec.dtype not in tensors.DTYPES or any(size < 0 for size in spec.shape):
                raise ValueError(f"handoff tensor {spec.name!r} has dtype {spec.dtype[:20]!r} and shape "
                                 f"{list(spec.shape)[:8]}; expected a supported dtype and non-negative sizes")
        if self.runner is not None:
            self._check_against_model(header)
        self._sizes = [tensors.byte_size(spec.dtype, spec.shape) for spec in header.tensors]
        self._total = sum(self._sizes)

    def _check_against_model(self, header: epd_pb2.HandoffHeader) -> None:
        runner = self.runner
        max_len = runner.model.config.max_position_embeddings
        if not 1 <= header.prompt_len <= max_len:
            raise ValueError(f"handoff prompt_len is {header.prompt_len}; must be in [1, {max_len}]")
        if not 0 <= header.first_token < runner.vocab_size:
            raise ValueError(f"handoff first_token is {header.first_token}; the vocabulary has {runner.vocab_size}")
        vocab = runner.vocab_size
        named = [("stop_token_ids", header.sampling.stop_token_ids), ("logit_bias", header.sampling.logit_bias.keys()),
                 ("generated_token_ids", header.generated_token_ids), ("prompt_token_set", header.prompt_token_set)]
        for name, ids in named:
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"handoff {name} has a token id outside the vocabulary of {vocab}")
        if header.generated_token_ids and len(header.generated_token_ids) != max(1, header.num_generated):
            raise ValueError(f"handoff lists {len(header.generated_token_ids)} generated tokens for num_generated "
                             f"{header.num_generated}")
        if header.generated_token_ids and header.generated_token_ids[-1] != header.first_token:
            raise ValueError("handoff generated_token_ids must end with first_token")
        # Decode's K/V grows by a token a step: the last position it would reach must exist.
        last = header.prompt_len + header.sampling.max_tokens - max(1, header.num_generated)
        if last > max_len:
            raise ValueError(f"handoff asks for {header.sampling.max_tokens} tokens after a {header.prompt_len}-token "
                             f"prompt, past the model's {max_len} positions")
        want = runner.state_shapes(header.prompt_len)
        have = {spec.name: spec for spec in header.tensors}
        if have.keys() != want.keys():
            missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
            raise ValueError(f"handoff tensors do not match the model: missing {missing[:4]}, unexpected {extra[:4]}")
        for name, shape in want.items():
            spec = have[name]
            dtype = tensors.dtype_name(runner.state_dtype(name))
            if tuple(spec.shape) != shape or spec.dtype != dtype:
                raise ValueError(f"handoff tensor {name} is {spec.dtype}{list(spec.shape)[:8]}, "
                                 f"expected {dtype}{list(shape)}")


def receive(parts: Iterable[epd_pb2.HandoffChunk], num_layers: int, device: torch.device | str = "cpu",
            runner: TextModelRunner | None = None) -> Handoff:
    """Rebuild a handoff (see ``Receiver``); raises ValueError when the stream is malformed, cut
    short, or (with ``runner``) not a state of that model."""
    receiver = Receiver(num_layers, device, runner)
    for part in parts:
        receiver.add(part)
    return receiver.finish()
