"""How much splitting one clip across encoder replicas cuts its encode wall time.

``python -m bench.video_split --model DIR [--replicas 1,2,4] [--size 224x224] [--seconds 8] [--fps 8] [--threads N]``

Each replica is a process of its own holding the vision tower (as an encoder replica does), with
torch set to its share of the cores (cores // replicas, at least 1; ``--threads`` fixes it). The
clip's temporal patches are cut into one chunk per replica (``epd.video.chunks``); every replica
decodes, preprocesses and encodes its chunk at once, and the rows are concatenated in order.
Reported per replica count: the wall time from submitting the chunks to the last result (best of
``--repeats``), per-frame time, the speedup over one replica, and whether the embeddings equal one
replica's bit for bit. Also each chunk's CPU time (its process's, decode + preprocess + forward):
with one thread per replica it is the chunk's work whatever else the machine runs, so ``cpu(1
replica) / max over chunks cpu(N)`` is the speedup N free cores would give (the critical path),
and ``sum over chunks cpu(N) / cpu(1)`` the work splitting adds. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

_VISION = None


def _init(model_dir: str, threads: int) -> None:
    global _VISION
    import torch

    from epd import checkpoint

    torch.set_num_threads(threads)
    _VISION = checkpoint.build_vision_model(model_dir, dtype=torch.float32, device="cpu")


def _encode(args):
    import torch

    from epd import video

    data, settings, first, count = args
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        pixels, grid = video.load_chunk_pixels(data, settings, first, count)
        decoded = time.process_time()
        rows = _VISION(pixels, grid_thw=torch.tensor([grid])).pooler_output
    end = time.process_time()
    return first, rows.numpy().tobytes(), tuple(rows.shape), time.perf_counter() - start, end - cpu, decoded - cpu


def measure(model_dir: str, data: bytes, replicas: int, repeats: int, threads: int = 0) -> dict:
    from epd import video
    from epd.modelinfo import ModelInfo

    settings = ModelInfo.load(model_dir).video_settings()
    info = video.probe_video(data, settings)
    grid_t = info.grid_thw[0]
    per_chunk = -(-grid_t // replicas)
    jobs = [(data, settings, first, count) for first, count in video.chunks(grid_t, per_chunk)]
    threads = threads or max(1, (os.cpu_count() or 1) // replicas)
    ctx = mp.get_context("spawn")
    with ctx.Pool(replicas, initializer=_init, initargs=(model_dir, threads)) as pool:
        pool.map(_encode, jobs, chunksize=1)  # warm-up: weights paged in, kernels chosen
        walls, rows, cpus, decodes = [], b"", [], []
        for _ in range(repeats):
            start = time.perf_counter()
            results = sorted(pool.map(_encode, jobs, chunksize=1))
            walls.append(time.perf_counter() - start)
            rows = b"".join(r[1] for r in results)
            cpus.append([r[4] for r in results])
            decodes.append([r[5] for r in results])
    wall = min(walls)
    cpu = [min(c) for c in zip(*cpus)]  # per chunk, the least of the repeats
    decode = [min(c) for c in zip(*decodes)]
    return {"replicas": replicas, "chunks": len(jobs), "threads_per_replica": threads, "wall_s": wall,
            "walls_s": walls, "chunk_cpu_s": cpu, "chunk_decode_cpu_s": decode,
            "per_frame_ms": 1000 * wall / len(info.indices), "frames": len(info.indices),
            "grid_thw": list(info.grid_thw), "rows_sha": __import__("hashlib").sha256(rows).hexdigest()}


def main(argv=None) -> int:
    from bench.synthetic import make_clip

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--size", default="224x224")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--fps", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per replica (0: cores // replicas)")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    data = make_clip(width, height, int(args.seconds * args.fps), fps=args.fps, seed=7)
    load_before = os.getloadavg()
    rows = [measure(args.model, data, int(n), args.repeats, args.threads) for n in args.replicas.split(",")]
    base, first_sha = rows[0], rows[0]["rows_sha"]
    for row in rows:
        row["speedup"] = base["wall_s"] / row["wall_s"]
        row["critical_path_speedup"] = sum(base["chunk_cpu_s"]) / max(row["chunk_cpu_s"])
        row["work_ratio"] = sum(row["chunk_cpu_s"]) / sum(base["chunk_cpu_s"])
        row["identical_to_first"] = row.pop("rows_sha") == first_sha
        print(f"{row['replicas']} replica(s): {row['chunks']} chunk(s), {row['wall_s']:.3f} s wall, "
              f"{row['per_frame_ms']:.1f} ms/frame, speedup {row['speedup']:.2f}x; chunk CPU "
              f"{'/'.join(f'{c:.2f}' for c in row['chunk_cpu_s'])} s (decode+preprocess "
              f"{'/'.join(f'{c:.2f}' for c in row['chunk_decode_cpu_s'])}), critical-path speedup "
              f"{row['critical_path_speedup']:.2f}x, work {row['work_ratio']:.2f}x; "
              f"identical: {row['identical_to_first']}", flush=True)
    print(json.dumps({"load_average_before": load_before, "load_average": os.getloadavg(), "cpus": os.cpu_count(),
                      "size": args.size,
                      "seconds": args.seconds, "fps": args.fps, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
