"""The prefill -> decode handoff on the wire: one header, then raw tensor bytes in chunks.

The header lists each tensor's name, dtype and shape; the bytes follow back to back in that order,
cut into chunks small enough for gRPC's message limits. No pickle anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from epd import tensors
from epd.lm import HybridState
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


def receive(parts: Iterable[epd_pb2.HandoffChunk], num_layers: int, device: torch.device | str = "cpu") -> Handoff:
    """Rebuild a handoff; raises ValueError when the stream is malformed or cut short."""
    iterator = iter(parts)
    first = next(iterator, None)
    if first is None or first.WhichOneof("part") != "header":
        raise ValueError("handoff stream must start with a header")
    header = first.header
    data = bytearray()
    for part in iterator:
        if part.WhichOneof("part") != "data":
            raise ValueError("handoff stream has a second header")
        data += part.data
    named: dict[str, torch.Tensor] = {}
    offset = 0
    for spec in header.tensors:
        if spec.name in named:
            raise ValueError(f"handoff stream lists tensor {spec.name!r} twice")
        size = tensors.byte_size(spec.dtype, spec.shape)
        if offset + size > len(data):
            raise ValueError(f"handoff stream ended inside tensor {spec.name!r}")
        named[spec.name] = tensors.from_bytes(memoryview(data)[offset : offset + size], spec.dtype, spec.shape).to(device)
        offset += size
    if offset != len(data):
        raise ValueError(f"handoff stream has {len(data) - offset} bytes past its last tensor")
    state = HybridState.from_named_tensors(num_layers, header.prompt_len, named)
    return Handoff(header=header, state=state)
