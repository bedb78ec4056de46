"""Encoder benchmarks: how encoding scales with replicas, and with the batch size of one replica.

    python -m bench.encoders --model DIR --replicas 1,2 --images 32 --size 448x448
    python -m bench.encoders --model DIR --batch-sizes 1,2,4,8 --size 448x448

With ``--batch-sizes`` (in process, no servers): one encoder replica's vision forward over B images
at once, for each B; images per second and the time each image waited for its batch, so the
smallest batch at the knee of images/s can be the default (on a compute-bound CPU a bigger batch
does not raise images/s, and every image of a batch waits for the whole forward).

Otherwise:

One local stack (``epd serve``'s: local Ray, embedded Redis) with as many encoder replicas as the
largest count, each replica limited to ``--threads`` torch threads (default 1, so N replicas use N
cores and the comparison is about replicas, not threads). For each count, largest first (the
stack is scaled down between runs with the same drain ``epd scale`` uses):

- throughput: ``--images`` fresh images sent to the Encoder service as concurrent one-image calls;
  images per second over the wall time (the encoders' own work: decode, resize, ViT, store write);
- TTFT: a request with ``--ttft-images`` fresh images through the router (max_tokens 1), so its
  images are split over the replicas and encoded in parallel; the median of ``--ttft-runs``.

Fresh images every time: a store hit would skip the encoders.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench.synthetic import make_image
from epd import client, rpc
from epd.config import DeployConfig, EncodeConfig, ServeConfig, StoreConfig
from epd.v1 import epd_pb2, epd_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.encoders", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--replicas", default="1,2", help="comma-separated replica counts")
    parser.add_argument("--images", type=int, default=32, help="images per throughput run")
    parser.add_argument("--size", default="448x448", help="WIDTHxHEIGHT of every image")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per encoder replica (default 1; with --batch-sizes every core)")
    parser.add_argument("--concurrency", type=int, default=0, help="Encode calls in flight (0: 2 per replica)")
    parser.add_argument("--ttft-images", type=int, default=4)
    parser.add_argument("--ttft-runs", type=int, default=3)
    parser.add_argument("--batch-sizes", default="", help="B,B,...: time one replica's forward over B images")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", dest="json_path", default="", help="write the batch-size table as JSON")
    args = parser.parse_args(argv)
    if args.batch_sizes:
        return _batch_sizes(args)
    args.threads = 1 if args.threads is None else args.threads
    counts = sorted({int(n) for n in args.replicas.split(",")}, reverse=True)
    width, height = (int(v) for v in args.size.lower().split("x"))
    seeds = itertools.count(1_000_000)

    from control.local import LocalStack

    config = DeployConfig(serve=ServeConfig(model_dir=args.model, encode=EncodeConfig(num_threads=args.threads)),
                          num_encoders=counts[0])
    stack = LocalStack(config)
    rows = []
    try:
        router = stack.start()
        import ray

        status = ray.get(stack.controller.status.remote())
        internal = rpc.internal_transport(stack.deploy.serve.security)  # the Encoder service is internal
        encoder = functools.partial(
            epd_pb2_grpc.EncoderStub(internal.channel(status["roles"]["encode"][0]["address"])).Encode,
            metadata=internal.metadata)
        for count in counts:
            ray.get(stack.controller.scale.remote("encoder", count))
            concurrency = args.concurrency or 2 * count
            _encode(encoder, [make_image(width, height, seed=next(seeds)) for _ in range(2 * count)], concurrency)
            images = [make_image(width, height, seed=next(seeds)) for _ in range(args.images)]
            wall = _encode(encoder, images, concurrency)
            ttfts = []
            for _ in range(args.ttft_runs):
                request_images = [make_image(width, height, seed=next(seeds)) for _ in range(args.ttft_images)]
                result = client.generate(router, client.user_request("Describe them.", request_images, max_tokens=1))
                ttfts.append(result.summary.ttft_s)
            rows.append((count, args.images, wall, args.images / wall, statistics.median(ttfts)))
            print(f"replicas={count} done: {args.images / wall:.2f} images/s, "
                  f"ttft({args.ttft_images} images)={statistics.median(ttfts) * 1000:.0f} ms", file=sys.stderr)
    finally:
        stack.stop()
    _print_table(rows, args, width, height)
    return 0


def _batch_sizes(args) -> int:
    """Images/s of one replica's vision forward at each batch size (in process, no servers)."""
    import json

    import torch

    from encode_svc.engine import EncoderEngine
    from epd import imaging
    from epd.discovery import RoleContext
    from epd.tensors import configure_threads

    width, height = (int(v) for v in args.size.lower().split("x"))
    sizes = sorted({int(n) for n in args.batch_sizes.split(",")})
    # No store: only the vision forward is timed.
    serve = ServeConfig(model_dir=args.model, encode=EncodeConfig(dtype=args.dtype),
                        store=StoreConfig(redis_url="unix:///nonexistent/redis.sock"))
    engine = EncoderEngine(serve, RoleContext(name="encoder-bench"))
    configure_threads(args.threads or 0)  # this thread runs the forwards below
    pixels = [imaging.load_pixels(make_image(width, height, seed=n), engine.settings) for n in range(max(sizes))]
    engine._run_vision([pixels[0][0]], [pixels[0][1]])  # warm-up (oneDNN builds its kernels)
    rows = []
    for batch in sizes:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            engine._run_vision([p for p, _ in pixels[:batch]], [g for _, g in pixels[:batch]])
            times.append(time.perf_counter() - start)
        wall = statistics.median(times)
        rows.append({"batch": batch, "forward_s": wall, "images_per_s": batch / wall, "wait_per_image_s": wall})
    engine.stop()
    base = rows[0]["images_per_s"]
    print(f"one encoder replica, {width}x{height}, {args.dtype}, {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'forward_s':>10} {'images/s':>9} {'x batch 1':>9}")
    for row in rows:
        print(f"{row['batch']:>5} {row['forward_s']:>10.3f} {row['images_per_s']:>9.2f} {row['images_per_s'] / base:>9.2f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"size": args.size, "dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows}, f,
                      indent=2)
    return 0


def _encode(encode, images: list[bytes], concurrency: int) -> float:
    """Encode ``images`` as concurrent one-image calls (``encode``: the Encode call); returns the wall time."""
    def one(index_and_data):
        index, data = index_and_data
        key = f"epd:emb:v1:bench:{hashlib.sha256(data).hexdigest()}"  # a fresh image: a fresh key
        reply = encode(epd_pb2.EncodeRequest(items=[epd_pb2.EncodeItem(store_key=key, data=data)]), timeout=600)
        if reply.images[0].error:
            raise RuntimeError(reply.images[0].error)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, enumerate(images)))
    return time.perf_counter() - start


def _print_table(rows, args, width: int, height: int) -> None:
    base = {r[0]: r for r in rows}.get(min(r[0] for r in rows))
    print(f"encoder scaling: {args.images} images of {width}x{height}, {args.threads} torch thread(s) per replica")
    print(f"{'replicas':>8} {'images':>6} {'wall_s':>8} {'images/s':>9} {'speedup':>8} "
          f"{f'ttft_{args.ttft_images}img_ms':>15} {'ttft_speedup':>12}")
    for count, num_images, wall, rate, ttft in sorted(rows):
        print(f"{count:>8} {num_images:>6} {wall:>8.2f} {rate:>9.2f} {rate / base[3]:>7.2f}x "
              f"{ttft * 1000:>15.0f} {base[4] / ttft:>11.2f}x")


if __name__ == "__main__":
    sys.exit(main())
