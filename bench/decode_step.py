"""``epd bench decode-step``: time one batched decode step against the memory-bandwidth floor.

A decode step reads every weight of the language model once (the LM head included; the token
embedding only for the batch's rows), so on a CPU its time is bounded below by

    floor = bytes of weights read per step / GEMV bandwidth

where the bandwidth is measured in the same run with one large matrix-vector product in the
model's dtype (the best this machine streams weights). The report gives each batch size's step
time, that floor, and the ratios (step / floor, step / batch-1 step).

A mixture-of-experts model reads only the routed experts its tokens chose, so its floor depends
on the batch and is counted from the routing of the steps timed:

    bytes(step) = dense bytes + sum over MoE layers of (distinct experts chosen in that layer by
                  the step's tokens) x bytes of one expert

where "dense bytes" is everything else (attention, Gated DeltaNet, router, shared expert, norms,
LM head). At batch 1 that is exactly top_k experts per layer (``epd.memory_plan.
active_bytes_per_token``); at batch b at most min(E, b x top_k), and E x (1 - (1 - top_k/E)^b)
under uniform routing (reported beside the measured count).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch
from tqdm.auto import tqdm

from decode_svc.batch import DecodeBatch
from epd import kernels, positions
from epd.lm import TextModelRunner

_PROMPT_TOKENS = 64  # each request's cached context when the steps are timed
_GEMV_BYTES = 512 * 1024**2


def weight_bytes_per_step(runner: TextModelRunner) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table, plus the LM
    head; for a MoE model every routed expert counted (see ``expert_split`` for the real read)."""
    total = 0
    for name, param in runner.model.named_parameters():
        if not name.startswith("embed_tokens."):
            total += param.numel() * param.element_size()
    # pre-packed linear weights (epd.kernels.PackedLinear, DecodeLinear) are buffers, not
    # parameters, and a DecodeLinear's is padded to whole panels: count the weight itself
    for module in runner.model.modules():
        if isinstance(module, (kernels.PackedLinear, kernels.DecodeLinear)):
            total += module.out_features * module.in_features * module.dtype.itemsize
    head = runner.lm_head_weight
    return total + head.numel() * head.element_size()


def expert_split(runner: TextModelRunner) -> tuple[int, int, int]:
    """(bytes a step reads besides the routed experts, bytes of one routed expert, MoE layers);
    (all, 0, 0) for a dense model."""
    experts = [layer.mlp.experts for layer in runner.model.layers if hasattr(layer.mlp, "experts")]
    if not experts:
        return weight_bytes_per_step(runner), 0, 0
    all_experts = sum(e.gate_up_proj.numel() * e.gate_up_proj.element_size()
                      + e.down_proj.numel() * e.down_proj.element_size() for e in experts)
    each = all_experts // (len(experts) * experts[0].num_experts)
    return weight_bytes_per_step(runner) - all_experts, each, len(experts)


class ExpertCounter:
    """Counts, per decode step, the distinct routed experts each MoE layer's router chose (a
    forward hook on every router: what the step's grouped expert product reads)."""

    def __init__(self, runner: TextModelRunner) -> None:
        self.chosen: list[set[int]] = []
        self._handles = []
        for layer in runner.model.layers:
            if hasattr(layer.mlp, "gate"):
                self._handles.append(layer.mlp.gate.register_forward_hook(self._hook))
        self.per_step: list[int] = []

    def _hook(self, module, inputs, output) -> None:
        self.chosen.append(set(output[2].flatten().tolist()))

    def end_step(self) -> None:
        self.per_step.append(sum(len(c) for c in self.chosen))
        self.chosen = []

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def gemv_bandwidth(dtype: torch.dtype, device: torch.device, repeats: int = 7) -> float:
    """Bytes per second one large matrix-vector product streams (median of ``repeats``), by the
    fastest of ATen's ``F.linear``, oneDNN with a pre-packed weight (``epd.kernels.PackedLinear``)
    and epd's decode kernel (``epd.kernels.DecodeLinear``, what a decode replica uses on a CPU):
    the floor is the best this machine streams weights."""
    cols = 1024
    rows = _GEMV_BYTES // (cols * torch.empty((), dtype=dtype).element_size())
    matrix = torch.randn(rows, cols, dtype=torch.float32, device=device).to(dtype)
    vector = torch.randn(1, cols, dtype=dtype, device=device)
    products = [functools.partial(torch.nn.functional.linear, weight=matrix)]
    make = kernels.linear_maker(device, dtype)
    if make is not None:
        products.append(make(matrix))
    if kernels.can_decode_pack(matrix):
        products.append(kernels.DecodeLinear(matrix))
    best = min(_median_time(product, vector, device, repeats) for product in products)
    return matrix.numel() * matrix.element_size() / best


def _median_time(product, vector: torch.Tensor, device: torch.device, repeats: int) -> float:
    times = []
    with torch.inference_mode():
        product(vector)  # warm-up
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            product(vector)
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefilled_batch(runner: TextModelRunner, rows: int, context: int,
                    vocab: int | None = None) -> tuple[DecodeBatch, list[int]]:
    """A decode batch of ``rows`` requests, each a prompt of its own of ``context`` random text
    tokens (ids below ``vocab``, the model's vocabulary by default; seeded by the slot), prefilled,
    and each row's greedy next token: what the decode-step benches step. The rows' tokens differ,
    so a MoE router sees a real batch."""
    vocab = vocab or runner.lm_head_weight.shape[0]
    pos, _ = positions.mrope_positions(context, [])
    batch, tokens = DecodeBatch(runner), []
    for slot in range(rows):
        ids = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(slot))
        state = runner.new_state()
        tokens.append(int(runner.logits(runner.forward(runner.embed(ids), pos, state)).argmax()))
        batch.add(state)
    return batch, tokens


def time_decode_step(runner: TextModelRunner, batch_size: int, steps: int = 8, warmup: int = 2,
                     counter: ExpertCounter | None = None) -> float:
    """Median seconds of one decode step with ``batch_size`` requests of _PROMPT_TOKENS context
    (``counter``, when given, counts the experts each timed step chose)."""
    batch, tokens = prefilled_batch(runner, batch_size, _PROMPT_TOKENS)
    times = []
    if counter is not None:
        counter.chosen, counter.per_step = [], []
    for step in range(warmup + steps):
        _sync(runner.device)
        start = time.perf_counter()
        logits = runner.decode_step(batch, tokens, [_PROMPT_TOKENS + step] * batch_size)
        tokens = logits.argmax(dim=-1).tolist()
        _sync(runner.device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
        if counter is not None:
            counter.end_step()
    if counter is not None:
        counter.per_step = counter.per_step[warmup:]
    return statistics.median(times)


def run_decode_step_bench(model_dir: str, batch_sizes: list[int], dtype: str = "float32",
                          json_path: str | None = None) -> dict:
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be positive integers, got {batch_sizes}")
    runner = TextModelRunner.load(model_dir, dtype=dtype, decode=True)  # as a decode replica loads it
    weights = weight_bytes_per_step(runner)
    dense, expert_bytes, moe_layers = expert_split(runner)
    bandwidth = gemv_bandwidth(runner.dtype, runner.device)
    floor_s = weights / bandwidth
    counter = ExpertCounter(runner) if moe_layers else None
    rows = []
    for batch_size in tqdm(batch_sizes, desc="decode step", unit="batch size"):
        rows.append({"batch_size": batch_size, "step_s": time_decode_step(runner, batch_size, counter=counter)})
        if counter is not None:
            rows[-1].update(_moe_floor(runner, batch_size, counter.per_step, dense, expert_bytes, bandwidth))
    base = next((r["step_s"] for r in rows if r["batch_size"] == 1), None)
    for row in rows:
        row["ratio_to_floor"] = row["step_s"] / row.get("floor_s", floor_s)
        row["ratio_to_batch1"] = row["step_s"] / base if base else None
        row["tokens_per_s"] = row["batch_size"] / row["step_s"]
    report = {
        "model": os.path.abspath(model_dir),
        "dtype": dtype,
        "device": str(runner.device),
        "torch_threads": torch.get_num_threads(),
        "context_tokens": _PROMPT_TOKENS,
        "weight_bytes_per_step": weights,
        "gemv_bandwidth_gb_s": bandwidth / 1e9,
        "floor_s": floor_s,  # every weight read (a MoE model: each row has its own floor_s)
        "moe": {"dense_bytes": dense, "expert_bytes": expert_bytes, "moe_layers": moe_layers} if moe_layers else None,
        "steps": rows,
        "machine": machine_info(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    print(f"weights read per step: {weights / 1e9:.3f} GB; GEMV bandwidth {bandwidth / 1e9:.2f} GB/s; "
          f"floor {floor_s * 1e3:.1f} ms")
    if moe_layers:
        print(f"MoE: {dense / 1e9:.3f} GB besides the routed experts + {expert_bytes / 1e6:.3f} MB per expert "
              f"chosen, {moe_layers} layers; floor per row from the experts its steps chose")
    print(f"{'batch':>5} {'step ms':>9} {'floor ms':>9} {'x floor':>8} {'x b1':>6} {'tok/s':>8}"
          + (f" {'experts/step':>12} {'uniform':>8}" if moe_layers else ""))
    for row in rows:
        b1 = f"{row['ratio_to_batch1']:.2f}" if row["ratio_to_batch1"] else "-"
        line = (f"{row['batch_size']:>5} {row['step_s'] * 1e3:>9.1f} {row.get('floor_s', floor_s) * 1e3:>9.2f} "
                f"{row['ratio_to_floor']:>8.2f} {b1:>6} {row['tokens_per_s']:>8.1f}")
        if moe_layers:
            line += f" {row['experts_read_per_step']:>12.1f} {row['experts_uniform_per_step']:>8.1f}"
        print(line)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _moe_floor(runner: TextModelRunner, batch_size: int, per_step: list[int], dense: int, expert_bytes: int,
               bandwidth: float) -> dict:
    """A MoE row's floor: dense bytes + the experts its timed steps chose (mean) x one expert's bytes."""
    config = runner.model.config
    num, top_k = config.num_experts, config.num_experts_per_tok
    layers = sum(hasattr(layer.mlp, "experts") for layer in runner.model.layers)
    chosen = statistics.mean(per_step)
    read = dense + chosen * expert_bytes
    return {
        "experts_read_per_step": chosen,  # over every MoE layer
        "experts_uniform_per_step": layers * num * (1 - (1 - top_k / num) ** batch_size),
        "weight_bytes_read": read,
        "floor_s": read / bandwidth,
    }


def machine_info() -> dict:
    import psutil

    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),  # MKL and oneDNN rank differently on Intel and AMD CPUs
        "torch": torch.__version__,
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
