"""The prefill -> decode handoff on the wire: one header, then raw tensor bytes in chunks.

The header lists each tensor's name, dtype and shape; the bytes follow back to back in that order,
cut into chunks small enough for gRPC's message limits. No pickle anywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

import torch

from epd import tensors
from epd.lm import HybridState, TextModelRunner
from epd.v1 import epd_pb2

CHUNK_BYTES = 1 << 20


@dataclass
class Handoff:
    """A request as decode receives it."""

    header: epd_pb2.HandoffHeader
    state: HybridState


def chunks(header: epd_pb2.HandoffHeader, state: HybridState, chunk_bytes: int = CHUNK_BYTES) -> Iterator[epd_pb2.HandoffChunk]:
    """Fill ``header.tensors`` from ``state`` and yield the header chunk, then the data chunks."""
    named = state.named_tensors()
    del header.tensors[:]
    for name, tensor in named:
        header.tensors.add(name=name, dtype=tensors.dtype_name(tensor.dtype), shape=list(tensor.shape))
    yield epd_pb2.HandoffChunk(header=header)
    pending = bytearray()
    for _, tensor in named:
        pending += tensors.to_bytes(tensor)
        while len(pending) >= chunk_bytes:
            yield epd_pb2.HandoffChunk(data=bytes(pending[:chunk_bytes]))
            del pending[:chunk_bytes]
    if pending:
        yield epd_pb2.HandoffChunk(data=bytes(pending))


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
    once every byte has arrived. Raises ValueError."""

    def __init__(self, num_layers: int, device: torch.device | str = "cpu", runner: TextModelRunner | None = None):
        self.num_layers = num_layers
        self.device = device
        self.runner = runner
        self.header: epd_pb2.HandoffHeader | None = None
        self._sizes: list[int] = []
        self._total = 0
        self._data = bytearray()

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
        excess = len(self._data) + len(part.data) - self._total
        if excess > 0:
            raise ValueError(f"handoff stream has {excess} bytes past its last tensor (its header lists {self._total})")
        self._data += part.data

    def finish(self) -> Handoff:
        if self.header is None:
            raise ValueError("handoff stream must start with a header")
        named: dict[str, torch.Tensor] = {}
        offset = 0
        view = memoryview(self._data)
        for spec, size in zip(self.header.tensors, self._sizes):
            if offset + size > len(self._data):
                raise ValueError(f"handoff stream ended inside tensor {spec.name!r}")
            named[spec.name] = tensors.from_bytes(view[offset : offset + size], spec.dtype, spec.shape).to(self.device)
            offset += size
        view.release()
        state = HybridState.from_named_tensors(self.num_layers, self.header.prompt_len, named)
        if self.runner is not None:
            self.runner.check_state(state)
        return Handoff(header=self.header, state=state)

    def _check_header(self, header: epd_pb2.HandoffHeader) -> None:
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
