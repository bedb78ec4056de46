"""A steady load and a health watch on a router, run as its own process (``python -m tests.netload``)
where the test process cannot reach the router itself: inside the workstation's network namespace
of tests/ssh_hosts.py.

``--clients`` threads each send one greedy request after another (one image each: a fresh one,
or one of a few repeated ones, so both the encoders and the store serve), and one thread asks the
router's ``grpc.health.v1`` every ``--health-every-s``. Everything goes to ``--out`` as JSON
lines: one ``request`` record per request (the prompt and image seeds, so the test can rebuild
the request for transformers; the tokens, or the status and message; wall-clock start and end;
how often it moved to another decode worker), a ``begin`` record when each request is sent (so
the test can tell what is in flight), and one ``health`` record per change of the router's
answer. It runs until the file ``--stop`` exists, then lets the requests in flight end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time

PROMPTS = ("Describe this picture.", "What colours do you see?", "Is there a line in the image?",
           "Tell me a short story about this image.")
REPEATED_SEEDS = (1, 2, 3, 4)


def image(seed: int, size: int) -> bytes:
    from bench.synthetic import make_image

    return make_image(size, size, seed=seed)


class Recorder:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        with self._lock:
            self._file.write(json.dumps(record) + "\n")


def client_loop(index: int, args, recorder: Recorder, stop: threading.Event, fresh) -> None:
    import grpc

    from epd import client

    rng = random.Random(index)
    sent = 0
    while not stop.is_set():
        seed = next(fresh) if rng.random() < args.fresh_ratio else rng.choice(REPEATED_SEEDS)
        prompt = rng.choice(PROMPTS)
        sent += 1
        record = {"kind": "request", "client": index, "n": sent, "prompt": prompt, "seeds": [seed],
                  "size": args.size, "max_tokens": args.max_tokens, "start": time.time()}
        recorder.write({"kind": "begin", "client": index, "n": sent, "start": record["start"]})
        try:
            result = client.generate(args.router, client.user_request(
                prompt, [image(seed, args.size)], max_tokens=args.max_tokens, temperature=0.0),
                timeout_s=args.timeout_s)
            record.update(ok=True, token_ids=result.token_ids, resumes=result.summary.resumes,
                          ttft_s=result.summary.ttft_s, images_encoded=result.summary.images_encoded)
        except grpc.RpcError as error:
            record.update(ok=False, code=error.code().name, error=error.details())
        except Exception as error:  # noqa: BLE001 - recorded: the test explains or fails on it
            record.update(ok=False, code=type(error).__name__, error=str(error))
        record["end"] = time.time()
        recorder.write(record)
        stop.wait(args.pause_s)


def health_loop(args, recorder: Recorder, stop: threading.Event) -> None:
    from grpc_health.v1 import health_pb2

    from epd import rpc

    last = None
    while not stop.is_set():
        at = time.time()
        status = rpc.health_status(args.router, timeout_s=args.health_timeout_s)
        state = "SERVING" if status == health_pb2.HealthCheckResponse.SERVING else \
            "NO_ANSWER" if status is None else health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        if state != last:
            recorder.write({"kind": "health", "time": at, "status": state})
            last = state
        stop.wait(max(0.0, args.health_every_s - (time.time() - at)))
    recorder.write({"kind": "health", "time": time.time(), "status": "END"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--router", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop", required=True)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--fresh-ratio", type=float, default=0.5)
    parser.add_argument("--first-fresh-seed", type=int, default=1000)
    parser.add_argument("--pause-s", type=float, default=0.2)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--health-every-s", type=float, default=0.15)
    parser.add_argument("--health-timeout-s", type=float, default=1.0)
    args = parser.parse_args()

    fresh_seeds = _Counter(args.first_fresh_seed)
    recorder = Recorder(args.out)
    stop = threading.Event()
    threads = [threading.Thread(target=health_loop, args=(args, recorder, stop), daemon=True)]
    threads += [threading.Thread(target=client_loop, args=(i, args, recorder, stop, fresh_seeds),
                                 daemon=True) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    while not os.path.exists(args.stop):
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(timeout=args.timeout_s + 30)
    recorder.write({"kind": "end", "time": time.time()})


class _Counter:
    """Fresh image seeds, each handed out once, shared by the client threads."""

    def __init__(self, first: int) -> None:
        self.next_value, self.lock = first, threading.Lock()

    def __iter__(self):
        return self

    def __next__(self) -> int:
        with self.lock:
            self.next_value += 1
            return self.next_value - 1


if __name__ == "__main__":
    main()
