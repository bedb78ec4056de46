"""The router's CPU per streamed token, through the gRPC front and the OpenAI-compatible HTTP front,
side by side on one running stack (``epd serve --http-port P``).

Each round sends the same text-only streamed requests (greedy, EOS ignored, ``--output-tokens``
each, ``--concurrency`` in flight) through one front with ``epd bench``'s own clients
(``bench.load.OpenAIStub`` for HTTP: a streamed chat completion with usage and token ids), and
reads the CPU seconds the router process and this client process used meanwhile (psutil: user +
system). An idle router still spends CPU (its registry watch and heartbeats): its rate, measured
first over ``--idle-s``, times each round's wall time is subtracted, so what is left is the
streaming's. CPU seconds per 1,000 tokens do not depend on how busy the machine is the way wall
time does, so a shared machine still gives a usable ratio. Rounds alternate the fronts (ABBA...).

    python -m bench.router_cost --http 127.0.0.1:8000 --grpc 127.0.0.1:50051 --rounds 4

The router process is the one listening on the HTTP port (``ray::RouterServer``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import psutil

from bench.load import OpenAIStub
from epd import rpc
from epd.v1 import epd_pb2, epd_pb2_grpc

PROMPT = "Tell me a long story about a lighthouse keeper and the sea, with many details."


def router_process(http_port: int) -> psutil.Process:
    """The process listening on ``http_port`` (the router replica that serves the HTTP front)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == http_port and conn.pid:
            return psutil.Process(conn.pid)
    raise SystemExit(f"no process of this user listens on port {http_port}")


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def run_round(api: str, stub, requests: int, concurrency: int, output_tokens: int) -> dict:
    """Send ``requests`` streamed requests, ``concurrency`` at a time; count tokens and events."""
    request = epd_pb2.GenerateRequest(
        messages=[epd_pb2.ChatMessage(role="user", content=[epd_pb2.ContentPart(text=PROMPT)])],
        sampling=epd_pb2.SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True))
    pending = iter(range(requests))
    lock = threading.Lock()
    counts = {"tokens": 0, "events": 0, "failed": 0}

    def worker() -> None:
        while True:
            with lock:
                if next(pending, None) is None:
                    return
            tokens = events = 0
            try:
                for event in stub.Generate(request, timeout=600):
                    if event.WhichOneof("event") == "chunk" and event.chunk.token_ids:
                        tokens += len(event.chunk.token_ids)
                        events += 1
            except Exception:  # noqa: BLE001 - counted, the round goes on
                with lock:
                    counts["failed"] += 1
                continue
            with lock:
                counts["tokens"] += tokens
                counts["events"] += events

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"api": api, "wall_s": time.perf_counter() - start, **counts}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", required=True, help="the HTTP front's HOST:PORT")
    parser.add_argument("--grpc", required=True, help="the router's gRPC HOST:PORT")
    parser.add_argument("--requests", type=int, default=32, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="rounds, alternating grpc/openai (ABBA...)")
    parser.add_argument("--idle-s", type=float, default=20.0, help="seconds to measure the idle router's CPU rate")
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args(argv)
    router = router_process(int(args.http.rpartition(":")[2]))
    me = psutil.Process()
    channel = rpc.channel(args.grpc)
    stubs = {"grpc": epd_pb2_grpc.RouterStub(channel), "openai": OpenAIStub(args.http, 600)}
    for api in ("grpc", "openai"):  # warm-up: first-call costs are not what this measures
        run_round(api, stubs[api], 2, 2, 8)
    before = _cpu(router)
    time.sleep(args.idle_s)
    idle = (_cpu(router) - before) / args.idle_s
    print(f"idle router: {idle:.4f} CPU s per s", flush=True)
    order = [("grpc", "openai") if i % 4 in (0, 3) else ("openai", "grpc") for i in range(args.rounds)]
    rounds = []
    for pair in order:
        for api in pair:
            router_before, client_before, load_before = _cpu(router), _cpu(me), psutil.getloadavg()[0]
            got = run_round(api, stubs[api], args.requests, args.concurrency, args.output_tokens)
            got["router_cpu_s"], got["client_cpu_s"] = _cpu(router) - router_before, _cpu(me) - client_before
            got["router_cpu_s"] -= idle * got["wall_s"]
            got["load"] = (load_before, psutil.getloadavg()[0])
            per = 1000 / max(1, got["tokens"])
            got["router_cpu_s_per_1k"], got["client_cpu_s_per_1k"] = got["router_cpu_s"] * per, got["client_cpu_s"] * per
            rounds.append(got)
            print(f"{api:6s} tokens {got['tokens']:6d} events {got['events']:6d} failed {got['failed']} "
                  f"wall {got['wall_s']:6.1f} s  router above idle {got['router_cpu_s_per_1k']:.3f} s/1k tokens  "
                  f"client {got['client_cpu_s_per_1k']:.3f} s/1k  load {got['load'][0]:.1f}-{got['load'][1]:.1f}",
                  flush=True)
    channel.close()
    summary = {}
    for api in ("grpc", "openai"):
        mine = [r for r in rounds if r["api"] == api]
        tokens = sum(r["tokens"] for r in mine)
        summary[api] = {key: 1000 * sum(r[key] for r in mine) / max(1, tokens)
                        for key in ("router_cpu_s", "client_cpu_s")}
    print(f"router CPU s per 1k tokens: grpc {summary['grpc']['router_cpu_s']:.3f}, openai "
          f"{summary['openai']['router_cpu_s']:.3f} ({summary['openai']['router_cpu_s'] / summary['grpc']['router_cpu_s']:.2f}x); "
          f"client: grpc {summary['grpc']['client_cpu_s']:.3f}, openai {summary['openai']['client_cpu_s']:.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "idle_cpu_per_s": idle, "rounds": rounds, "per_1k_tokens": summary}, out,
                  indent=1)


if __name__ == "__main__":
    main()
