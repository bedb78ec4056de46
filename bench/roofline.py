"""A lower bound on a workload's time on this machine: its FLOPs at the machine's peak and its
decode weight traffic at the machine's bandwidth, both measured in the same run.

The model (``docs/BENCHMARKS.md``, "The roofline"), per request, from the checkpoint's parameter
counts:

- vision, per distinct image encoded: ``2 x vision params x patches + 4 x depth x patches^2 x hidden``
  (every patch through every weight, plus full attention over the image's patches in every block);
- prefill: ``2 x language-model params (the embedding table excluded) x prompt tokens`` plus one
  LM-head row (``2 x hidden x vocab``);
- decode with ideal batching: ``ceil(N / C) x (O - 1)`` steps for N requests, C in flight and O
  output tokens each, every step ``max(weight bytes / bandwidth, 2 x (LM params + LM head) x C / peak)``
  (a step reads every weight once; with enough rows it is compute-bound instead).
- a mixture-of-experts model: "LM params" are a token's active ones (its top_k experts a layer,
  ``epd.memory_plan.active_params_per_token``), and a step's weight bytes count the experts its C
  tokens choose, E x (1 - (1 - k/E)^C) a layer under uniform routing (``ModelCost.step_weight_bytes``).

The stages run one after another on the same cores here (a lower bound: nothing overlaps better
than perfectly), so ``roofline_s`` is their sum and a system's ``efficiency`` is
``roofline_s / its wall time``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from epd import kernels, memory_plan

PEAK_SIZE = 2048
GEMV_BYTES = 1 << 30


@dataclass(frozen=True)
class MachineLimits:
    peak_flops: float  # FLOP/s of a large matrix product in the dtype, the best path this machine has
    bandwidth: float  # bytes/s a large matrix-vector product streams in the dtype, the best path


@dataclass(frozen=True)
class ModelCost:
    vision_params: int
    vision_depth: int
    vision_hidden: int
    lm_params: int  # the language model without its embedding table
    lm_head_params: int  # vocab x hidden
    hidden: int
    weight_bytes: int  # every LM weight once, the LM head included (a dense model's decode step reads it all)
    merge: int  # image tokens per patch is 1 / merge^2
    # a mixture-of-experts model: a token computes with (and a step reads) only the routed experts chosen
    active_lm_params: int = 0  # lm_params with only top_k experts a layer (= lm_params when dense)
    expert_bytes: int = 0  # one routed expert of one layer
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0

    def step_weight_bytes(self, batch: int) -> float:
        """Bytes one decode step of ``batch`` tokens reads: a MoE layer reads the experts its tokens
        chose, E x (1 - (1 - k/E)^batch) of them expected under uniform routing."""
        if not self.moe_layers:
            return self.weight_bytes
        dense = self.weight_bytes - self.moe_layers * self.num_experts * self.expert_bytes
        chosen = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** max(1, batch))
        return dense + self.moe_layers * chosen * self.expert_bytes

    @classmethod
    def of(cls, model_dir: str, dtype: torch.dtype) -> ModelCost:
        from epd.checkpoint import count_parameters, read_config
        from epd.family import family_of

        family = family_of(model_dir)
        config = read_config(model_dir)
        with torch.device("meta"):
            vision = family.vision_model(config.vision_config)
            text = family.text_model(config.text_config)
        text_config = config.text_config
        embedding = text_config.vocab_size * text_config.hidden_size
        lm_params = count_parameters(text) - embedding
        size = torch.empty((), dtype=dtype).element_size()
        raw = memory_plan.read_raw_config(model_dir)
        params = memory_plan.count_params(raw)
        moe = {}
        if params.experts:
            head = params.head or params.embedding
            moe = dict(active_lm_params=memory_plan.active_params_per_token(raw) - head,
                       expert_bytes=params.expert_params_each * size, moe_layers=text_config.num_hidden_layers,
                       num_experts=text_config.num_experts, top_k=text_config.num_experts_per_tok)
        return cls(vision_params=count_parameters(vision), vision_depth=config.vision_config.depth,
                   vision_hidden=config.vision_config.hidden_size, lm_params=lm_params, lm_head_params=embedding,
                   hidden=text_config.hidden_size, weight_bytes=(lm_params + embedding) * size,
                   merge=config.vision_config.spatial_merge_size, **({"active_lm_params": lm_params} | moe))


def measure(dtype: torch.dtype, device: str = "cpu", repeats: int = 5) -> MachineLimits:
    """The machine's peak and bandwidth in ``dtype``: the best of ATen's products and oneDNN's
    packed ones (the runner uses whichever is faster)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=generator).to(device, dtype)
    b = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=generator).to(device, dtype)
    rows = GEMV_BYTES // (1024 * torch.empty((), dtype=dtype).element_size())
    matrix = torch.randn(rows, 1024, generator=generator).to(device, dtype)
    vector = torch.randn(1, 1024, generator=generator).to(device, dtype)
    products = [lambda: torch.nn.functional.linear(a, b)]
    vectors = [lambda: torch.nn.functional.linear(vector, matrix)]
    make = kernels.linear_maker(torch.device(device), dtype)  # oneDNN's, or epd's where oneDNN lacks the dtype
    if make is not None:
        packed_b, packed_m = make(b), make(matrix)
        products.append(lambda: packed_b(a))
        vectors.append(lambda: packed_m(vector))
    flops = 2 * PEAK_SIZE**3
    peak = max(flops / _best_time(run, device, repeats) for run in products)
    bandwidth = max(GEMV_BYTES / _best_time(run, device, repeats) for run in vectors)
    return MachineLimits(peak_flops=peak, bandwidth=bandwidth)


def _best_time(run, device: str, repeats: int) -> float:
    times = []
    with torch.inference_mode():
        run()  # warm-up (and oneDNN's primitive creation)
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bound(cost: ModelCost, limits: MachineLimits, image_tokens: list[int], prompt_tokens: list[int],
          concurrency: int, output_tokens: int) -> dict:
    """The roofline of a workload: ``image_tokens`` of each distinct image encoded, the prompt
    tokens of each request, the requests in flight and the tokens each generates."""
    vision_flops = 0.0
    for tokens in image_tokens:
        patches = tokens * cost.merge**2
        vision_flops += 2 * cost.vision_params * patches + 4 * cost.vision_depth * patches**2 * cost.vision_hidden
    active = cost.active_lm_params or cost.lm_params  # a MoE token computes with its top_k experts only
    prefill_flops = sum(2 * active * tokens + 2 * cost.lm_head_params for tokens in prompt_tokens)
    num_requests = len(prompt_tokens)
    steps = math.ceil(num_requests / max(1, concurrency)) * max(0, output_tokens - 1)
    batch = min(concurrency, num_requests)
    step_s = max(cost.step_weight_bytes(batch) / limits.bandwidth,
                 2 * (active + cost.lm_head_params) * batch / limits.peak_flops)
    stages = {"vision_s": vision_flops / limits.peak_flops, "prefill_s": prefill_flops / limits.peak_flops,
              "decode_s": steps * step_s}
    return {"roofline_s": sum(stages.values()), "stages": stages, "decode_steps": steps, "decode_step_s": step_s,
            "limits": asdict(limits), "model": asdict(cost)}
