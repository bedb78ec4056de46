"""``epd bench``: build the workload, run it through epd (a running router, or a local stack this
starts and stops), optionally through a baseline after it (transformers in this process, or a
vLLM server this starts: ``bench.peers.vllm``), and report.

The epd phase runs first and its stack is stopped before the baseline loads, so the two never
compete for the machine, and both figures come from one invocation on one workload. The load
average is sampled during each system's run (other work on the cores skews every figure).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import threading
from dataclasses import dataclass

from bench.load import APIS, LoadRunner, LoadSettings
from bench.metrics import (
    LATENCY_KEYS,
    Slo,
    latency_samples,
    stage_figures,
    summarize,
)
from bench.workload import (
    ImageSize,
    PromptMaker,
    Workload,
    WorkloadSpec,
    build_workload,
)
from epd.config import ConfigError, DeployConfig, redacted

BASELINES = ("transformers", "vllm")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {message}")


@dataclass(frozen=True)
class BenchConfig:
    num_requests: int
    """Requests in all (a conversation of --turns turns is that many requests)."""
    images_per_request: int
    """New images in each conversation's first turn (later turns resend them); 0: text only."""
    prompt_tokens: int
    """About this many tokens of text per user turn."""
    output_tokens: int
    """Every request generates exactly this many tokens (greedy, EOS ignored)."""
    image_sizes: tuple[ImageSize, ...] = ()
    """Sizes to draw images from, with relative weights."""
    addr: str | None = None
    """A running router's HOST:PORT; or None to start the local stack ``stack``."""
    stack: DeployConfig | None = None
    """The local stack to start for the run (its checkpoint is also the baseline's)."""
    concurrency: int | None = None
    """Closed loop: conversations in flight."""
    request_rate: float | None = None
    """Open loop: conversations started per second, Poisson arrivals."""
    repeat_ratio: float = 0.0
    """Probability that an image reuses an earlier image's bytes (encoder-cache hits)."""
    turns: int = 1
    """Turns per conversation (multi-turn: each resends the earlier turns and answers)."""
    seed: int = 0
    """Fixes images, prompts, repeats and arrival times."""
    baseline: str | None = None
    """``transformers``: run the same workload through Qwen3_5ForConditionalGeneration.generate;
    ``vllm``: through a vLLM CPU server started on the same checkpoint (``bench.peers.vllm``)."""
    json_path: str | None = None
    plot_path: str | None = None
    slo_ttft_s: float | None = None
    """Goodput counts requests whose TTFT is at most this (seconds)."""
    slo_tpot_s: float | None = None
    """Goodput counts requests whose TPOT is at most this (seconds)."""
    timeout_s: float = 600.0
    """Per-request deadline."""
    warmup: int = 1
    """Untimed requests sent to each system before its run (first-call costs are not measured)."""
    baseline_threads: int = 0
    """torch threads of the baseline; 0: torch's default (one per core)."""
    api: str = "grpc"
    """The front the load goes through: ``grpc`` (epd.v1.Router) or ``openai`` (the HTTP front's
    /v1/chat/completions; with --addr, give the HTTP front's HOST:PORT)."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """Sent as a bearer token when the deployment requires one (from EPD_API_KEY)."""
    vllm_env: str | None = None
    """The vLLM baseline's virtual environment (``make vllm-env``); None: ``bench.peers.vllm``'s default."""
    vllm_args: tuple[str, ...] = ()
    """More arguments for the vLLM baseline's ``vllm serve``, after the bench's own."""
    videos_per_request: int = 0
    """New clips in each conversation's first turn (later turns resend them); they share ``repeat_ratio``."""
    video_sizes: tuple[ImageSize, ...] = ()
    """Clip frame sizes to draw from, with relative weights."""
    video_seconds: float = 4.0
    """Each clip's length in seconds."""
    video_fps: float = 8.0
    """The clips' frame rate as written in the file (the server samples them at its own fps, 2 by default)."""
    tokenizer_dir: str | None = None
    """A checkpoint whose tokenizer counts the prompts' tokens (each prompt is the longest run of
    words within ``prompt_tokens``); None: the ``stack``'s checkpoint, and with ``addr`` an estimate
    of one token a word (a tokenizer may split a word in several: the server then gets longer
    prompts than asked)."""

    def __post_init__(self) -> None:
        _check((self.addr is None) != (self.stack is None), "addr/model", "give exactly one of --addr and --model")
        _check((self.concurrency is None) != (self.request_rate is None), "concurrency/request_rate",
               "give exactly one of --concurrency and --request-rate")
        _check(1 <= self.num_requests <= 1_000_000, "num_requests", f"must be in [1, 1000000], got {self.num_requests}")
        _check(0 <= self.images_per_request <= 64, "images_per_request",
               f"must be in [0, 64], got {self.images_per_request}")
        _check(self.images_per_request == 0 or bool(self.image_sizes), "image_sizes",
               "--image-sizes is needed when --images-per-request is above 0")
        _check(0 <= self.videos_per_request <= 16, "videos_per_request",
               f"must be in [0, 16], got {self.videos_per_request}")
        _check(self.videos_per_request == 0 or bool(self.video_sizes), "video_sizes",
               "--video-sizes is needed when --videos-per-request is above 0")
        _check(0 < self.video_seconds <= 3600, "video_seconds", f"must be in (0, 3600], got {self.video_seconds}")
        _check(0 < self.video_fps <= 240, "video_fps", f"must be in (0, 240], got {self.video_fps}")
        _check(self.videos_per_request == 0 or self.baseline is None, "baseline",
               "--baseline runs images only: transformers' video processor needs torchvision, which epd's "
               "environment does not install (tests/test_video_reference.py uses its own); drop --videos-per-request")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            _check(1 <= value <= 1_000_000, name, f"must be in [1, 1000000], got {value}")
        _check(self.concurrency is None or 1 <= self.concurrency <= 4096, "concurrency",
               f"must be in [1, 4096], got {self.concurrency}")
        _check(self.request_rate is None or self.request_rate > 0, "request_rate",
               f"must be > 0, got {self.request_rate}")
        _check(0.0 <= self.repeat_ratio <= 1.0, "repeat_ratio", f"must be in [0, 1], got {self.repeat_ratio}")
        _check(1 <= self.turns <= 1000, "turns", f"must be in [1, 1000], got {self.turns}")
        _check(self.baseline in (None, *BASELINES), "baseline", f"must be one of {BASELINES}, got {self.baseline!r}")
        _check(self.baseline is None or self.model_dir is not None, "baseline",
               f"--baseline {self.baseline} runs on local weights: give --model DIR (not --addr)")
        _check(self.baseline != "vllm" or self.dtype == "bfloat16", "baseline",
               "vLLM's CPU engine runs this model in bfloat16 only: add --dtype bfloat16 (epd then runs in it too)")
        _check(0 <= self.baseline_threads <= 1024, "baseline_threads",
               f"must be in [0, 1024], got {self.baseline_threads}")
        _check(0 <= self.warmup <= 1000, "warmup", f"must be in [0, 1000], got {self.warmup}")
        _check(self.api in APIS, "api", f"must be one of {APIS}, got {self.api!r}")
        for name in ("slo_ttft_s", "slo_tpot_s", "timeout_s"):
            value = getattr(self, name)
            _check(value is None or value > 0, name, f"must be > 0, got {value}")

    @property
    def model_dir(self) -> str | None:
        return self.stack.serve.model_dir if self.stack else None

    @property
    def prompt_tokenizer_dir(self) -> str | None:
        """The checkpoint whose tokenizer sizes the prompts (``tokenizer_dir``, else the stack's)."""
        return self.tokenizer_dir or self.model_dir

    @property
    def dtype(self) -> str:
        """The language model's dtype (the baseline runs in it too); float32 against a remote router."""
        return self.stack.serve.prefill.dtype if self.stack else "float32"

    def workload_spec(self) -> WorkloadSpec:
        return WorkloadSpec(
            num_requests=self.num_requests, images_per_request=self.images_per_request, image_sizes=self.image_sizes,
            prompt_tokens=self.prompt_tokens, repeat_ratio=self.repeat_ratio, turns=self.turns,
            request_rate=self.request_rate, seed=self.seed, num_warmup=self.warmup,
            videos_per_request=self.videos_per_request, video_sizes=self.video_sizes,
            video_seconds=self.video_seconds, video_fps=self.video_fps,
        )

    def to_json(self) -> dict:
        """The config as the report records it: no secret (the stack's API key and internal token
        read ``***`` when set, a Redis URL keeps no password)."""
        out = redacted(self)
        out.pop("api_key")
        out["image_sizes"] = [str(size) for size in self.image_sizes]
        out["video_sizes"] = [str(size) for size in self.video_sizes]
        out["model_dir"], out["dtype"] = self.model_dir, self.dtype
        return out


def machine() -> dict:
    """The machine, and how busy it was (other work on the cores skews every figure): its CPU
    model and vector instruction sets too, since the same 2-core machine type has come with and
    without AVX-512 BF16, which changes every bfloat16 figure (docs/BENCHMARKS.md)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cpu_count": os.cpu_count(), "memory_gib": round(memory / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), **cpu_model(),
            "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}


VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "avx_ne_convert")


def cpu_model() -> dict:
    """``cpu_model`` (the model name), ``cpu_family``/``cpu_model_number`` and which of
    ``VECTOR_FLAGS`` the CPU has, from /proc/cpuinfo (empty where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "flags") and key not in fields:
                    fields[key] = value.strip()
                if key == "flags":
                    break
    except OSError:
        return {}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name", ""), "cpu_family": fields.get("cpu family", ""),
            "cpu_model_number": fields.get("model", ""), "cpu_flags": [f for f in VECTOR_FLAGS if f in flags]}


def prompt_maker(config: BenchConfig) -> PromptMaker:
    """Sizes the workload's prompts: with the tokenizer of ``config.prompt_tokenizer_dir`` where
    there is one, else by the one-token-a-word estimate."""
    directory = config.prompt_tokenizer_dir
    return PromptMaker.from_model_dir(directory) if directory else PromptMaker()


def run_bench(config: BenchConfig, prompts: PromptMaker | None = None) -> dict:
    """Run everything the config asks for; returns the report (also written to ``json_path``).
    ``prompts``: the config's ``prompt_maker`` where the caller made it already."""
    host = machine()  # before the run: the load average of the run itself would say nothing
    prompts = prompts or prompt_maker(config)
    workload = build_workload(config.workload_spec(), prompts, _video_settings(config))
    slo = Slo(config.slo_ttft_s, config.slo_tpot_s)
    limits = _measure_limits(config)  # on the quiet machine, before either system runs
    with LoadSampler() as epd_load:
        records, duration, prefill_work = _run_epd(config, workload)
    report = {**summarize(records, duration, slo), **stage_figures(records), "load_avg": epd_load.figures()}
    if prefill_work:
        report["prefill_replicas"] = prefill_work
    report["workload"] = {"conversations": len(workload.conversations), "unique_images": workload.num_unique_images,
                          "repeated_images": workload.num_repeated_images}
    if config.videos_per_request:
        report["workload"].update({"unique_videos": workload.num_unique_videos,
                                   "repeated_videos": workload.num_repeated_videos})
    if limits is not None:
        report["roofline"] = _roofline(config, workload, records, limits)
        report["efficiency"] = _efficiency(report["roofline"], duration)
    samples = {"epd": latency_samples(records)}
    if config.baseline == "transformers":
        import torch

        from bench.baseline import run_transformers

        with LoadSampler() as base_load:
            base_records, base_duration = run_transformers(config.model_dir, config.dtype, workload,
                                                           config.output_tokens, config.baseline_threads)
        report["baseline"] = {"name": "transformers", "torch_threads": torch.get_num_threads(),
                              **summarize(base_records, base_duration, slo), "load_avg": base_load.figures()}
        samples["transformers"] = latency_samples(base_records)
        merge_baseline(report, limits is not None)
    elif config.baseline == "vllm":
        from bench.peers.vllm import VllmUnavailable

        try:
            with LoadSampler() as base_load:
                base_records, base_duration, server = _run_vllm(config, workload)
        except VllmUnavailable as error:  # epd's figures stand; the report says why vLLM's are missing
            report["baseline_error"] = str(error)
        else:
            report["baseline"] = {"name": "vllm", "server": server, **summarize(base_records, base_duration, slo),
                                  "load_avg": base_load.figures()}
            samples["vllm"] = latency_samples(base_records)
            merge_baseline(report, limits is not None)
    report.update({"config": config.to_json(), "machine": host,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    report["requests"] = report.pop("requests")  # the long per-request list last, for readers of the file
    if config.json_path:
        _write_json(config.json_path, report)
    if config.plot_path:
        _write_plot(config, report, samples)
    return report


def _video_settings(config: BenchConfig):
    """The checkpoint's video settings (how many frames the server samples from a clip); None
    against a remote router: transformers' defaults."""
    if not config.videos_per_request or not config.model_dir:
        return None
    from epd.modelinfo import ModelInfo

    return ModelInfo.load(config.model_dir).video_settings()


def _measure_limits(config: BenchConfig):
    """The machine's peak and bandwidth in the run's dtype (a roofline needs the checkpoint, for
    its parameter counts, and a closed loop, for its batch size; its cost model counts images, not
    clips, so a run with clips has none)."""
    if not config.model_dir or not config.concurrency or config.videos_per_request:
        return None
    from bench.roofline import measure
    from epd.tensors import default_device, parse_dtype

    return measure(parse_dtype(config.dtype), default_device())


def _roofline(config: BenchConfig, workload: Workload, records, limits) -> dict:
    """The workload's lower bound (``bench.roofline``), and for each request the bound of the
    encodes and prefills that were served before its first token (the work queued ahead of it)."""
    from bench.roofline import ModelCost, bound
    from epd.modelinfo import ModelInfo
    from epd.tensors import parse_dtype

    settings = ModelInfo.load(config.model_dir).image_settings(64 * 1024 * 1024)
    images = {image.index: image for c in workload.conversations for t in c.turns for image in t.images}
    image_tokens = [_image_tokens(image, settings) for image in images.values()]
    served = sorted((r for r in records if r.ok and r.ttft_s is not None), key=lambda r: r.sent_s + r.ttft_s)
    cost = ModelCost.of(config.model_dir, parse_dtype(config.dtype))
    result = bound(cost, limits, image_tokens, [r.prompt_tokens for r in served], config.concurrency,
                   config.output_tokens)
    per_request = result["stages"]["vision_s"] / max(1, len(served)) + result["stages"]["prefill_s"] / max(1, len(served))
    # The work between a request's arrival and its first token: the encodes and prefills of the
    # requests whose first token came in that window, its own included.
    firsts = [r.sent_s + r.ttft_s for r in served]
    ahead = [per_request * sum(r.sent_s <= first <= mine for first in firsts) for r, mine in zip(served, firsts)]
    result["ttft_work_ahead_s"] = _percentiles(ahead)
    return result


def _image_tokens(image, settings) -> int:
    from epd.imaging import smart_resize

    height, width = smart_resize(image.height, image.width, settings.factor, settings.min_pixels, settings.max_pixels)
    return (height // settings.factor) * (width // settings.factor)


def _percentiles(values: list[float]) -> dict:
    import numpy as np

    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def _efficiency(roofline: dict, wall_s: float) -> float | None:
    return roofline["roofline_s"] / wall_s if wall_s else None


def _run_epd(config: BenchConfig, workload: Workload):
    settings = LoadSettings(output_tokens=config.output_tokens, concurrency=config.concurrency,
                            timeout_s=config.timeout_s)
    """epd's records and wall time, and (a local stack) each prefill replica's work in the run."""
    if config.addr:
        return (*LoadRunner(config.addr, settings, config.api, config.api_key).run(workload), {})
    from control.local import LocalStack

    stack = LocalStack(config.stack)
    try:
        address = stack.start()
        if config.api == "openai":
            address = stack.http_addresses()[0]
        before = _prefill_work(stack)  # the warm-up's and start-up's work is not the run's
        records, duration = LoadRunner(address, settings, config.api, config.api_key).run(workload)
        after = _prefill_work(stack)
        work = {name: {key: value - before.get(name, {}).get(key, 0) for key, value in figures.items()}
                for name, figures in after.items()}
        return records, duration, work
    finally:
        stack.stop()


def _prefill_work(stack) -> dict[str, dict]:
    """Each prefill replica's work since it started (``PrefillServer.work``: busy seconds, computed tokens)."""
    import ray

    names = [r["name"] for r in ray.get(stack.controller.status.remote(), timeout=60)["roles"]["prefill"]]
    handles = {name: ray.get_actor(name, namespace=stack.deploy.namespace) for name in names}
    return dict(zip(handles, ray.get([h.work.remote() for h in handles.values()], timeout=60)))


def _comparison(epd: dict, baseline: dict) -> dict:
    base_tok_s, base_ttft = baseline["throughput_tok_s"], baseline["ttft_s"]["p50"]
    return {
        "speedup_throughput": epd["throughput_tok_s"] / base_tok_s if base_tok_s else None,
        "ttft_ratio": epd["ttft_s"]["p50"] / base_ttft if base_ttft and epd["ttft_s"]["p50"] is not None else None,
    }


RATE_KEYS = ("throughput_tok_s", "request_throughput", "goodput")


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def ratios(epd: dict, baseline: dict) -> dict:
    """epd's figure over the baseline's, for every figure both report: the rates (above 1: epd
    does more per second), the latency percentiles (below 1: epd is faster), the wall time."""
    out = {key: _ratio(epd[key], baseline[key]) for key in RATE_KEYS}
    out["duration_s"] = _ratio(epd["duration_s"], baseline["duration_s"])
    for key in LATENCY_KEYS:
        out[key] = {p: _ratio(epd[key][p], baseline[key][p]) for p in ("mean", "p50", "p90", "p99")}
    return out


def merge_baseline(report: dict, with_roofline: bool) -> None:
    """Put the baseline's share of the roofline and the epd/baseline ratios into ``report`` (whose
    ``baseline`` holds the baseline's figures): the same roofline for both systems, so both
    efficiencies are read against one number."""
    baseline = report["baseline"]
    if with_roofline:
        baseline["efficiency"] = _efficiency(report["roofline"], baseline["duration_s"])
    report.update(_comparison(report, baseline))
    report["ratios"] = ratios(report, baseline)
    # Both systems count the prompt of each request; a difference in a first turn means they saw
    # different inputs (a chat template or an image resize of their own), which the reader has to
    # know. Later turns carry each system's own earlier answers, so they may differ.
    def firsts(rows: list[dict]) -> list[tuple[int, int]]:
        return [(r["conversation"], r["prompt_tokens"]) for r in rows if r["turn"] == 0 and not r["error"]]

    report["prompt_tokens_match"] = firsts(report["requests"]) == firsts(baseline["requests"])


class LoadSampler:
    """The 1-minute load average during a block, sampled every ``every_s`` seconds."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.samples.append(os.getloadavg()[0])

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> LoadSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def figures(self) -> dict:
        values = self.samples
        return {"start": round(values[0], 2), "end": round(values[-1], 2),
                "mean": round(sum(values) / len(values), 2), "max": round(max(values), 2),
                "samples": len(values)}


def _run_vllm(config: BenchConfig, workload: Workload):
    """The workload through a vLLM server started for it on the bench's checkpoint (after epd's
    stack stopped), through the same load generator over the OpenAI API; then the server stopped."""
    from bench.peers import vllm

    env = vllm.find_env(config.vllm_env)
    model = _model_json(config.model_dir)
    text = model.get("text_config", model)
    sizes = [(s.width, s.height) for s in config.image_sizes]
    longest = _longest_request(config, workload)
    server = vllm.VllmServer(env, config.model_dir, dtype=config.dtype,
                             max_model_len=vllm.model_len(config.stack.serve.router.max_model_len, longest,
                                                          int(text.get("max_position_embeddings") or 0)),
                             limit_mm=vllm.mm_limits(config.images_per_request, sizes), extra_args=config.vllm_args)
    print(f"starting vLLM {env.version} on {config.model_dir} (about a minute) ...", flush=True)
    settings = LoadSettings(output_tokens=config.output_tokens, concurrency=config.concurrency,
                            timeout_s=config.timeout_s)
    try:
        address = server.start()
        records, duration = LoadRunner(address, settings, "openai", label="vllm").run(workload)
    finally:
        server.stop()
    return records, duration, server.describe()


def _model_json(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def _longest_request(config: BenchConfig, workload: Workload) -> int:
    """An upper estimate of the longest request in tokens: its images, every turn's text (a word
    is at least a token; PromptMaker keeps to the count), every earlier answer, the template."""
    from epd.modelinfo import ModelInfo

    settings = ModelInfo.load(config.model_dir).image_settings(64 * 1024 * 1024)
    images = {image.index: image for c in workload.conversations for t in c.turns for image in t.images}
    image_tokens = max((_image_tokens(image, settings) for image in images.values()), default=0)
    return config.images_per_request * (image_tokens + 2) + config.turns * (config.prompt_tokens
                                                                             + config.output_tokens + 16)


def _write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def _write_plot(config: BenchConfig, report: dict, samples: dict) -> None:
    from bench.plot import write_plot

    systems = {"epd": report, **({report["baseline"]["name"]: report["baseline"]} if "baseline" in report else {})}
    sizes = ",".join(f"{s.width}x{s.height}" for s in config.image_sizes) or "none"
    mode = f"concurrency {config.concurrency}" if config.concurrency else f"{config.request_rate:g} req/s"
    clips = (f", {config.videos_per_request} clip(s) of {config.video_seconds:g} s"
             if config.videos_per_request else "")
    title = (f"epd bench: {config.num_requests} requests, {mode}, {config.images_per_request} image(s) of {sizes}"
             f"{clips}, "
             f"{config.prompt_tokens} prompt / {config.output_tokens} output tokens, {config.turns} turn(s), "
             f"{config.dtype}")
    os.makedirs(os.path.dirname(os.path.abspath(config.plot_path)), exist_ok=True)
    write_plot(config.plot_path, samples, {name: r["throughput_tok_s"] for name, r in systems.items()},
               {name: r["request_throughput"] for name, r in systems.items()}, title)


def _video_line(video: dict) -> str:
    def p50(figures: dict, scale: float = 1.0, unit: str = " s") -> str:
        return "n/a" if figures["p50"] is None else f"{figures['p50'] * scale:.3g}{unit}"

    return (f"  clips {video['videos']}: chunks encoded {video['chunks_encoded']} of {video['chunks']}, video tokens "
            f"{video['video_tokens']}, encode per frame p50 {p50(video['encode_ms_per_frame'], unit=' ms')}; TTFT p50 "
            f"{p50(video['ttft_s_clips_encoded'])} with its clips encoded, {p50(video['ttft_s_clips_from_store'])} "
            "with them from the store")


def format_report(report: dict) -> str:
    """The report as a few readable lines for the terminal."""
    def ms(figures: dict) -> str:
        if figures["p50"] is None:
            return "n/a"
        return " / ".join(f"{figures[k] * 1000:.1f}" for k in ("mean", "p50", "p90", "p99"))

    def block(name: str, r: dict) -> list[str]:
        lines = [f"{name}: {r['completed']}/{r['num_requests']} ok, {r['failed']} failed, {r['duration_s']:.2f} s, "
                 f"{r['request_throughput']:.2f} req/s, {r['throughput_tok_s']:.1f} tok/s, goodput "
                 f"{r['goodput']:.2f} req/s"]
        lines += [f"  {key[:-2]:5s} ms mean/p50/p90/p99: {ms(r[key])}" for key in LATENCY_KEYS]
        if "load_avg" in r:
            load = r["load_avg"]
            lines.append(f"  load average during the run (1 min): {load['start']:.2f} at start, mean "
                         f"{load['mean']:.2f}, max {load['max']:.2f}; prompt tokens {r['prompt_tokens_total']}")
        lines += [f"  error: {error}" for error in r["errors"]]
        return lines

    settings = report.get("config", {})
    shape = [] if not settings.get("stack") else \
        ["aggregated" if settings["stack"].get("aggregate") else "separate P/D"]
    shown = (["openai"] if settings.get("api") == "openai" else []) + shape
    lines = block(f"epd ({', '.join(shown)})" if shown else "epd", report)
    ratio = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    if "roofline" in report:
        stages = report["roofline"]["stages"]
        lines.append(f"  roofline {report['roofline']['roofline_s']:.2f} s (vision {stages['vision_s']:.2f}, prefill "
                     f"{stages['prefill_s']:.2f}, decode {stages['decode_s']:.2f}); efficiency "
                     f"{ratio(report['efficiency'])}" + (f", baseline {ratio(report['baseline']['efficiency'])}"
                                                         if "baseline" in report else ""))
    if settings and not settings.get("tokenizer_dir") and not settings.get("model_dir"):
        lines.append(f"  note: prompts sized at one token a word ({settings.get('prompt_tokens')} words of text a "
                     f"turn; the server counted {report['prompt_tokens_total']} prompt tokens in all): give "
                     f"--tokenizer DIR to size them with the model's tokenizer")
    if report.get("config", {}).get("api") == "openai":
        lines.append(f"  cached tokens {report['cached_tokens']} (images and stage timings: not reported over HTTP)")
    else:
        lines.append(f"  images encoded {report['images_encoded']}, cached {report['images_cached']}, "
                     f"cached tokens {report['cached_tokens']}, store/encode {ratio(report['store_overhead_ratio'])}, "
                     f"handoff/prefill {ratio(report['handoff_overhead_ratio'])}")
        if "video" in report:
            lines.append(_video_line(report["video"]))
    if "baseline" in report:
        base = report["baseline"]
        name = base.get("name", "transformers")
        if name == "vllm":
            server = base["server"]
            name = f"vllm {server['version']} (openai)"
        lines += block(name, base)
        if base.get("name") == "vllm":
            startup = server["startup_s"]
            lines.append(f"  server: started in {'n/a' if startup is None else f'{startup:.0f} s'}, "
                         f"--max-model-len {server['max_model_len']}, "
                         f"VLLM_CPU_OMP_THREADS_BIND={server['omp_threads_bind']}"
                         + (f", more arguments: {' '.join(server['extra_args'])}" if server.get("extra_args") else ""))
        lines.append(f"speedup (tok/s) {ratio(report['speedup_throughput'])}, "
                     f"TTFT p50 ratio {ratio(report['ttft_ratio'])}")
        if "ratios" in report:
            r = report["ratios"]
            lines.append("epd / baseline: " + ", ".join(
                [f"{key} {ratio(r[key])}" for key in ("throughput_tok_s", "goodput", "duration_s")]
                + [f"{key[:-2]} p50 {ratio(r[key]['p50'])}" for key in LATENCY_KEYS]))
            if not report.get("prompt_tokens_match", True):
                lines.append(f"  note: the two systems counted different prompt tokens for the same first turns "
                             f"({report['prompt_tokens_total']} and {base['prompt_tokens_total']} in all)")
    return "\n".join(lines)
