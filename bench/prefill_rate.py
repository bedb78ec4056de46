"""``epd bench simulate --measure MODEL``: this machine's prefill cost, ``fixed_s + per_token_s x tokens``
for one prompt (chunked as prefill chunks it, ``prefill.chunk_tokens``), fitted by least squares
over a few prompt lengths (best of seven runs each, one torch thread). The simulator's replicas compute at this rate."""

from __future__ import annotations

import time

import torch

from epd import positions
from epd.config import PrefillConfig
from epd.lm import TextModelRunner

LENGTHS = (64, 256, 1024, 2048)


def time_prefill(runner: TextModelRunner, num_tokens: int, chunk_tokens: int, repeats: int = 7) -> float:
    token_ids = torch.randint(0, runner.vocab_size, (num_tokens,))
    embeds = runner.embed(token_ids)
    pos, _ = positions.mrope_positions(num_tokens, [])
    best = float("inf")
    for _ in range(repeats):
        state = runner.new_state()
        start = time.perf_counter()
        for lo in range(0, num_tokens, chunk_tokens):
            hi = min(num_tokens, lo + chunk_tokens)
            runner.forward_many([(embeds[lo:hi], pos[:, lo:hi], state)])
        best = min(best, time.perf_counter() - start)
    return best


def measure(model_dir: str, dtype: str = "float32", lengths=LENGTHS, threads: int = 1) -> dict:
    """``threads``: torch threads, one by default (a replica per core; on a shared machine more
    threads mostly measure the contention)."""
    torch.set_num_threads(threads)
    runner = TextModelRunner.load(model_dir, dtype=dtype)
    chunk = PrefillConfig().chunk_tokens
    time_prefill(runner, 64, chunk, repeats=1)  # warm-up
    rows = [(n, time_prefill(runner, n, chunk)) for n in lengths]
    xs, ys = [n for n, _ in rows], [t for _, t in rows]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return {"model_dir": model_dir, "dtype": dtype, "chunk_tokens": chunk, "per_token_s": slope,
            "fixed_s": max(0.0, mean_y - slope * mean_x), "rows": [{"tokens": n, "s": t} for n, t in rows],
            "threads": torch.get_num_threads(), "kv_bytes_per_token": runner.kv_bytes_per_token(),
            "linear_state_bytes": runner.slot_state_bytes()}
