"""``python -m bench.handoff_cost MODEL``: what one prompt's handoff costs the two processes' CPUs
outside a stack, each way it can go: as a gRPC stream (``handoff.chunks`` cut into 1 MiB chunks,
serialized, parsed, reassembled by ``handoff.Receiver``) and through a shared-memory file
(``handoff.write_shared``, then ``Receiver`` mapping it). The state is a real prefill's, of a
``--tokens`` prompt; each round's wall times in milliseconds, the first round cold (fresh buffers
fault their pages in), as a served process's often are."""

from __future__ import annotations

import argparse
import json
import time

import torch

from epd import handoff, positions
from epd.lm import TextModelRunner
from epd.v1 import epd_pb2


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.handoff_cost", description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    runner = TextModelRunner.load(args.model_dir, dtype=args.dtype)
    ids = torch.randint(0, runner.vocab_size, (args.tokens,))
    pos, _ = positions.mrope_positions(args.tokens, [])
    state = runner.new_state()
    runner.forward_many([(runner.embed(ids), pos, state)])

    def header() -> epd_pb2.HandoffHeader:
        h = epd_pb2.HandoffHeader(request_id="bench", prompt_len=args.tokens, first_token=1)
        h.sampling.max_tokens = 16
        return h

    rows = []
    for round_ in range(args.rounds):
        t0 = time.perf_counter()
        wire = [part.SerializeToString() for part in handoff.chunks(header(), state)]
        t1 = time.perf_counter()
        receiver = handoff.Receiver(runner.num_layers, runner=runner)
        for data in wire:
            receiver.add(epd_pb2.HandoffChunk.FromString(data))
        receiver.finish()
        t2 = time.perf_counter()
        h = header()
        path = handoff.write_shared(h, state)
        if path is None:
            raise SystemExit("no shared-memory directory here (/dev/shm or EPD_HANDOFF_SHARED_DIR)")
        t3 = time.perf_counter()
        receiver = handoff.Receiver(runner.num_layers, runner=runner)
        receiver.add(epd_pb2.HandoffChunk.FromString(epd_pb2.HandoffChunk(header=h).SerializeToString()))
        receiver.finish()
        t4 = time.perf_counter()
        rows.append({"round": round_, "state_bytes": state.nbytes(), "stream_send_ms": 1e3 * (t1 - t0),
                     "stream_receive_ms": 1e3 * (t2 - t1), "shared_send_ms": 1e3 * (t3 - t2),
                     "shared_receive_ms": 1e3 * (t4 - t3)})
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)


if __name__ == "__main__":
    main()
