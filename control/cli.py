"""The ``epd`` command: create checkpoints, serve them, deploy them on a Ray cluster, send requests,
benchmark.

Every user error ends in one line (``epd <command>: error: ...`` or the service's
``STATUS_NAME: message``) and a non-zero exit, never a traceback. Serving flags come from the
config dataclasses (``control.flags``), so their defaults and help have one source.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import time

from control import flags

# epd.checkpoint.PRESETS' names, kept here so that argparse needs no torch import
# (tests/test_checkpoint.py checks the two agree).
PRESET_NAMES = ("tiny", "tiny-32k", "tiny-hd64", "tiny-moe", "qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b",
                "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b")


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at the interpreter's exit: a closed pipe is caught below
        return code
    except BrokenPipeError:
        # The reader went away (`epd status | head -4`): stop quietly, with the shell's status for
        # SIGPIPE; stdout points at /dev/null so the interpreter's last flush finds no pipe either.
        quiet_closed_pipe()
        return 141


def quiet_closed_pipe() -> None:
    """After a reader closed our stdout: stdout and stderr to /dev/null, so that nothing more (the
    interpreter's last flush included) fails on the pipe. Every command-line entry point's way out."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass
    os.close(devnull)


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `epd bench decode-step` has its own options; `epd bench --addr ...` must not need a subcommand.
    sub = argv[:2] in (["bench", "decode-step"], ["bench", "simulate"])
    parser = (_decode_step_parser() if argv[1] == "decode-step" else _simulate_parser()) if sub else _parser()
    args = parser.parse_args(argv[2:] if sub else argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: quietly, with the shell's status for SIGINT
        print(file=sys.stderr)
        return 130


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default (flags whose default lives in a config dataclass say it in their help)."""

    def _get_help_string(self, action):
        if action.default is argparse.SUPPRESS or "(default:" in (action.help or "") or action.required:
            return action.help
        if action.default in (None, []):
            return f"{action.help or ''} (default: none)".strip()
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated Encode/Prefill/Decode serving for Qwen3.5")
    sub = parser.add_subparsers()

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, formatter_class=_Formatter, **kwargs)

    model = sub.add_parser("model", help="checkpoints").add_subparsers()
    create = model.add_parser("create", formatter_class=_Formatter,
                              help="write a checkpoint with random weights in the real architecture")
    create.add_argument("--preset", required=True, choices=sorted(PRESET_NAMES))
    create.add_argument("--out", required=True, help="directory to write")
    create.add_argument("--seed", type=_int_in(0, 2**32 - 1), default=0, help="seed of the random weights")
    create.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    create.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype the weights are stored in; bfloat16 (as Qwen publishes them) needs half the "
                             "memory and disk (default: float32)")
    create.add_argument("--config-only", action="store_true",
                        help="write config.json, tokenizer and processor config but no weights (any size: for "
                             "memory planning and placement); without it a preset this host's RAM or disk "
                             "cannot hold is refused before anything is allocated")
    create.set_defaults(func=_cmd_model_create, parser=create)

    serve = command("serve", help="start every role on a local Ray instance", epilog=(
        "Model sizes: every published Qwen3.5 size is an `epd model create` preset (qwen3.5-0.8b, -2b, -4b, -9b, "
        "-27b, -35b-a3b, -122b-a10b, -397b-a17b). Before Ray starts, serve adds up what every model replica "
        "needs (weights in --dtype, --kv-cache-bytes, linear-attention slots, activations) and refuses in one "
        "line what this host cannot hold; each role checks its own device again before loading. One replica "
        "of each role needs 8.8 GiB for 2b, 18.4 GiB for 4b with --dtype bfloat16 (17.0 and 35.3 GiB in "
        "float32; docs/ARCHITECTURE.md has every size). Give replicas GPUs with "
        "--num-gpus or a --config roles file (num_gpus per role; docs/DEPLOY.md, 'Model sizes'). A prefill or "
        "decode replica spans several processes with --prefill-tensor-parallel N / --decode-tensor-parallel N."))
    flags.add_flags(serve, flags.SERVE)
    flags.add_secret_files(serve)
    serve.add_argument("--config", default=None, metavar="TOML", help="role resources and encoder autoscaling")
    _add_log_flags(serve)
    serve.set_defaults(func=_cmd_serve, parser=serve)

    deploy = command("deploy", help="place every role on a running Ray cluster by Ray resources")
    deploy.add_argument("--address", required=True, type=_address, help="Ray cluster address (HEAD_IP:6379)")
    flags.add_flags(deploy, flags.DEPLOY)
    flags.add_secret_files(deploy)
    deploy.add_argument("--config", default=None, metavar="TOML",
                        help="role resources and autoscaling (see deploy/roles.toml)")
    deploy.add_argument("--json", action="store_true", help="print the deployment's status as JSON")
    deploy.add_argument("--allow-plaintext-internal", action="store_true",
                        help="send the internal token between nodes without TLS (without this, epd deploy needs "
                             "--internal-tls-ca/--internal-tls-cert/--internal-tls-key: a private network only)")
    _add_log_flags(deploy)
    deploy.set_defaults(func=_cmd_deploy, parser=deploy)

    scale = command("scale", help="change a role's replica count on a running deployment")
    scale.add_argument("--address", required=True, type=_address, help="Ray cluster address")
    _add_connect_flags(scale)
    scale.add_argument("role", choices=list(_ROLE_NAMES), help="the role to scale")
    scale.add_argument("count", type=_int_in(1, 256),
                       help="replicas the role should have, in [1, 256]; scaling down drains the newest first")
    scale.set_defaults(func=_cmd_scale, parser=scale)

    status = command("status", help="a deployment's replicas and where Ray placed them")
    status.add_argument("--address", required=True, type=_address, help="Ray cluster address")
    _add_connect_flags(status)
    status.add_argument("--json", action="store_true", help="one JSON object per look (with Ray's placements "
                        "unless --watch)")
    status.add_argument("--watch", type=_float_in(0.1, 3600), default=None, metavar="S",
                        help="look again every S seconds until interrupted, over one connection")
    status.set_defaults(func=_cmd_status, parser=status)

    down = command("down", help="stop a deployment (the cluster keeps running)")
    down.add_argument("--address", required=True, type=_address, help="Ray cluster address")
    _add_connect_flags(down)
    down.set_defaults(func=_cmd_down, parser=down)

    demo = command("demo", help="serve a checkpoint, send one image request, compare with transformers")
    demo.add_argument("--model", required=True)
    demo.set_defaults(func=_cmd_demo, parser=demo)

    _add_generate_parser(command)
    _add_bench_parser(command)
    return parser


CONNECT_TIMEOUT_S = 10.0
"""How long `epd status`, `scale` and `down` try to reach a deployment before giving up."""


def _add_connect_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default="epd",
                        help="Ray namespace of the deployment (`epd serve` and `epd deploy` use epd unless told)")
    parser.add_argument("--connect-timeout", type=_float_in(0, 3600, low_open=True), default=CONNECT_TIMEOUT_S,
                        metavar="S", help="seconds to reach the deployment before giving up")


def _add_log_flags(parser: argparse.ArgumentParser) -> None:
    from epd import logs

    parser.add_argument("--log-level", default="INFO", choices=list(logs.LEVELS),
                        help="least severe events logged, by this command and by every role")
    parser.add_argument("--log-format", default="text", choices=list(logs.FORMATS),
                        help="text: one line per event naming the role and request; json: one JSON object per "
                             "line (ts, level, role, request_id, logger, message) for log shippers")


def _setup_logging(args) -> None:
    """This process's logging, and (through the environment Ray passes on) every role's."""
    from epd import logs

    os.environ[logs.FORMAT_ENV], os.environ[logs.LEVEL_ENV] = args.log_format, args.log_level
    logs.configure(args.log_level, args.log_format, role="epd")


def _add_generate_parser(command) -> None:
    from epd import limits
    from epd.config import RouterConfig

    gen = command("generate", help="send one request to a running router and stream the answer")
    gen.add_argument("--addr", required=True, type=_address, help="router HOST:PORT")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="one user turn (with --image files)")
    what.add_argument("--prompt-file", metavar="FILE",
                      help="the user turn read from FILE (UTF-8; - for stdin), for prompts too long for a command "
                           "line (with --image files)")
    what.add_argument("--messages", metavar="FILE.json",
                      help='a conversation: [{"role": ..., "content": str | [{"type": "text", "text": ...}, '
                           '{"type": "image", "image"|"path": PATH}, {"type": "image_url", "image_url": {"url": '
                           '"data:image/png;base64,..." | PATH}}]}], paths relative to the file')
    gen.add_argument("--image", action="append", default=[], metavar="PATH", help="image file (repeatable)")
    router = RouterConfig()
    gen.add_argument("--max-tokens", type=_int_in(1, 2**31 - 1), default=None, metavar="N",
                     help=f"tokens to generate at most (default: the server's, {router.default_max_tokens} unless it "
                          f"was started with --default-max-tokens; at most {router.max_tokens_limit})")
    gen.add_argument("--temperature", type=_float_in(0, limits.MAX_TEMPERATURE), default=None, metavar="X",
                     help="sampling temperature; 0: greedy (default: 0)")
    gen.add_argument("--top-p", type=_float_in(0, 1), default=None, metavar="X",
                     help="nucleus sampling mass, (0, 1] (default: 1, off)")
    gen.add_argument("--top-k", type=_int_in(0, limits.MAX_TOP_K), default=None, metavar="N",
                     help="sample from the N most likely tokens; 0: off (default: 0)")
    gen.add_argument("--seed", type=_int_in(0, limits.MAX_SEED), default=None, metavar="N",
                     help="sampling seed (default: with --temperature > 0 the server picks one and reports it)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop string, repeatable; the answer ends before it (default: none)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="keep generating past the end-of-sequence token (default: off)")
    gen.add_argument("--logprobs", type=_int_in(0, limits.MAX_LOGPROBS), default=0, metavar="N",
                     help="also return the N most likely tokens at each step with their log-probabilities, in the "
                          "--json line; 0: none (default: 0)")
    gen.add_argument("--prompt-logprobs", type=_int_in(0, limits.MAX_PROMPT_LOGPROBS), default=None, metavar="N",
                     help="also return every prompt token's log-probability and rank, with the N most likely tokens "
                          "there, in the --json line (vLLM's prompt_logprobs; the prompt then skips the prefix "
                          "cache) (default: none)")
    gen.add_argument("--enable-thinking", action="store_true",
                     help="render the chat template with thinking on (default: off)")
    gen.add_argument("--max-pixels", type=_int_in(0, limits.MAX_PIXELS), default=None, metavar="N",
                     help="lower the per-image pixel cap for this request; 0: the model's, as the server takes it "
                          "(default: the model's, from its preprocessor_config.json)")
    gen.add_argument("--timeout", type=_float_in(0, 1e9), default=None, metavar="S",
                     help="seconds before giving up (default: no limit)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object with the result as the last line (default: off)")
    gen.add_argument("--api-key", default=None, metavar="KEY",
                     help="sent as `authorization: Bearer KEY` (default: EPD_API_KEY when set)")
    gen.add_argument("--tls-ca", default=None, metavar="PEM",
                     help="connect with TLS, trusting this CA (or the server's self-signed certificate) (default: "
                          "plaintext)")
    gen.set_defaults(func=_cmd_generate, parser=gen)


def _add_bench_parser(command) -> None:
    bench = command(
        "bench", help="load-test a router (or a local stack) and compare with transformers or vLLM",
        description="Send a seeded synthetic workload (images, prompts, multi-turn conversations) to epd and "
                    "report TTFT, TPOT, ITL, end-to-end latency, throughput and goodput.",
        epilog="Also: `epd bench decode-step --model DIR --batch-sizes 1,4,16` times the decode step alone "
               "(see `epd bench decode-step --help`); `epd bench simulate --replicas 8,64,256` simulates prefill "
               "routing at scale (see `epd bench simulate --help`).",
    )
    target = bench.add_mutually_exclusive_group(required=True)
    target.add_argument("--addr", type=_address, help="a running router's HOST:PORT")
    target.add_argument("--model", metavar="DIR", help="checkpoint: start a local stack for the run, stop it after")
    bench.add_argument("--num-requests", type=_int_in(1, 10**6), required=True, metavar="N",
                       help="requests in all (a conversation of --turns T counts T)")
    mode = bench.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=_int_in(1, 4096), metavar="C", help="closed loop: C conversations in flight")
    mode.add_argument("--request-rate", type=_float_in(0, 1e6, low_open=True), metavar="R",
                      help="open loop: R conversations per second, Poisson arrivals")
    bench.add_argument("--image-sizes", type=_image_sizes, default=(), metavar="WxH[:P],...",
                       help="image sizes with relative weights P (default 1), e.g. 448x448,1280x720:3")
    bench.add_argument("--images-per-request", type=_int_in(0, 64), required=True, metavar="K",
                       help="images per request (0: text only)")
    bench.add_argument("--videos-per-request", type=_int_in(0, 16), default=0, metavar="V",
                       help="synthetic clips (MP4, made with PyAV) per request, after its images (default 0)")
    bench.add_argument("--video-sizes", type=_image_sizes, default=(), metavar="WxH[:P],...",
                       help="clip frame sizes with relative weights P, e.g. 224x224,320x240:2")
    bench.add_argument("--video-seconds", type=_float_in(0, 3600, low_open=True), default=4.0, metavar="S",
                       help="each clip's length in seconds")
    bench.add_argument("--video-fps", type=_float_in(0, 240, low_open=True), default=8.0, metavar="F",
                       help="the clips' frame rate in the file (the server samples at its own fps, 2 by default)")
    bench.add_argument("--prompt-tokens", type=_int_in(1, 10**6), required=True, metavar="T",
                       help="about T tokens of text per user turn")
    bench.add_argument("--tokenizer", metavar="DIR", default=None,
                       help="size the prompts with this checkpoint's tokenizer (default: --model's; with --addr, "
                            "one token a word, which a tokenizer that splits words makes longer)")
    bench.add_argument("--output-tokens", type=_int_in(1, 10**6), required=True, metavar="O",
                       help="exactly O generated tokens per request (greedy, EOS ignored)")
    bench.add_argument("--repeat-ratio", type=_float_in(0, 1), default=0.0, metavar="F",
                       help="probability an image (or clip) reuses an earlier one's bytes")
    bench.add_argument("--turns", type=_int_in(1, 1000), default=1, metavar="N",
                       help="turns per conversation; later turns resend the earlier ones with their answers")
    bench.add_argument("--seed", type=int, default=0, help="fixes images, prompts, repeats and arrivals")
    bench.add_argument("--baseline", choices=["transformers", "vllm"], default=None,
                       help="also run the workload, after epd, through transformers' generate in this process, or "
                            "through a vLLM CPU server it starts on the same checkpoint (needs --model; vllm needs "
                            "--dtype bfloat16 and `make vllm-env`)")
    bench.add_argument("--vllm-env", default=None, metavar="DIR",
                       help="vLLM's own virtual environment for --baseline vllm (default: $EPD_VLLM_ENV, else the "
                            "repo's .venv-vllm, made by `make vllm-env`)")
    bench.add_argument("--vllm-args", default="", metavar="ARGS",
                       help="more arguments for the vLLM baseline's `vllm serve`, one shell-quoted string, after "
                            "the bench's own (the last of a repeated flag wins), e.g. \"--mamba-ssm-cache-dtype "
                            "float32\" for Gated DeltaNet states in float32 as epd keeps them")
    bench.add_argument("--json", dest="json_path", metavar="PATH", help="write the report as one JSON object")
    bench.add_argument("--plot", dest="plot_path", metavar="PATH", help="write latency CDFs and throughput as a PNG")
    bench.add_argument("--slo-ttft", type=_float_in(0, 1e6, low_open=True), metavar="S",
                       help="goodput: TTFT at most S seconds")
    bench.add_argument("--slo-tpot", type=_float_in(0, 1e6, low_open=True), metavar="S",
                       help="goodput: TPOT at most S seconds")
    bench.add_argument("--baseline-threads", type=_int_in(0, 1024), default=0, metavar="N",
                       help="torch threads for the baseline (0: torch's default, one per core)")
    bench.add_argument("--timeout", type=_float_in(0, 1e6, low_open=True), default=600.0, metavar="S",
                       help="per-request deadline")
    bench.add_argument("--warmup", type=_int_in(0, 1000), default=1, metavar="N",
                       help="untimed requests sent to each system before its run")
    bench.add_argument("--api", choices=["grpc", "openai"], default="grpc",
                       help="the front to load: grpc (epd.v1.Router) or openai (the HTTP front's /v1/chat/completions; "
                            "with --addr give its HOST:PORT, with --model the stack gets one)")
    stack = bench.add_argument_group("the local stack (with --model)")
    flags.add_flags(stack, flags.BENCH_STACK)
    flags.add_secret_files(stack)  # and EPD_API_KEY, as epd serve reads it; the load sends the same key
    stack.add_argument("--config", default=None, metavar="TOML", help="role resources and encoder autoscaling")
    bench.set_defaults(func=_cmd_bench, parser=bench)


def _decode_step_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd bench decode-step", formatter_class=_Formatter,
                                     description="Time one decode step of the language model at each batch size.")
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    parser.add_argument("--batch-sizes", type=_batch_sizes, required=True, metavar="B,B,...", help="e.g. 1,4,16")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write the results as JSON")
    parser.set_defaults(func=_cmd_bench_decode_step, parser=parser)
    return parser


# ---------------------------------------------------------------- argument types


def _int_in(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {text}")
        return value

    return parse


def _float_in(low: float, high: float, low_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {text}")
        return value

    return parse


def _address(text: str) -> str:
    """HOST:PORT, the port required (a bare host would silently mean another port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in [1, 65535], got {text!r}")
    return text


def _image_sizes(text: str):
    from bench.workload import parse_image_sizes

    try:
        return parse_image_sizes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16, got {text!r}") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be at least 1, got {text!r}")
    return sizes


# ---------------------------------------------------------------- commands


def _cmd_bench(args) -> int:
    from bench.run import BenchConfig, format_report, run_bench
    from epd.config import ConfigError

    stack_flags = [f.option for f in flags.BENCH_STACK if hasattr(args, f.dest)] + (["--config"] if args.config else []) \
        + [option for option, value in (("--api-key-file", args.api_key_file),
                                        ("--internal-token-file", args.internal_token_file)) if value]
    if args.addr and stack_flags:
        args.parser.error(f"{', '.join(stack_flags)} configure the local stack: use them with --model, not --addr")
    if args.baseline_threads and args.baseline != "transformers":
        args.parser.error("--baseline-threads applies to --baseline transformers")
    if args.vllm_env and args.baseline != "vllm":
        args.parser.error("--vllm-env applies to --baseline vllm")
    if args.vllm_args and args.baseline != "vllm":
        args.parser.error("--vllm-args applies to --baseline vllm")
    try:
        vllm_args = tuple(shlex.split(args.vllm_args))
    except ValueError as error:
        args.parser.error(f"--vllm-args {args.vllm_args!r}: {error}")
    if args.baseline and not args.model:
        args.parser.error(f"--baseline {args.baseline} runs on local weights: give --model DIR, not --addr")
    try:
        stack = None
        if args.model:
            http = {"serve__http__port": 0} if args.api == "openai" else {}
            # The stack takes the key epd serve would (EPD_API_KEY, --api-key-file), and the load sends it.
            aggregate, _ = flags.one_machine_mode(args, args.config)
            stack = flags.with_secrets(flags.deploy_config(args, flags.BENCH_STACK, args.config,
                                                           serve__model_dir=args.model, aggregate=aggregate, **http),
                                       args, os.environ)
        config = BenchConfig(
            addr=args.addr, stack=stack, num_requests=args.num_requests, concurrency=args.concurrency,
            request_rate=args.request_rate, image_sizes=args.image_sizes, images_per_request=args.images_per_request,
            prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, repeat_ratio=args.repeat_ratio,
            turns=args.turns, seed=args.seed, baseline=args.baseline, json_path=args.json_path,
            plot_path=args.plot_path, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, timeout_s=args.timeout,
            warmup=args.warmup, baseline_threads=args.baseline_threads, api=args.api,
            api_key=(stack.serve.security.api_key if stack else os.environ.get("EPD_API_KEY")) or None,
            vllm_env=args.vllm_env, vllm_args=vllm_args, videos_per_request=args.videos_per_request,
            video_sizes=args.video_sizes,
            video_seconds=args.video_seconds, video_fps=args.video_fps, tokenizer_dir=args.tokenizer,
        )
    except ConfigError as error:
        args.parser.error(str(error))
    if args.model:
        _check_checkpoint(args, args.model)
    prompts = None
    if args.tokenizer:  # before anything starts: a tokenizer that does not load is one line
        from bench.run import prompt_maker

        if not os.path.isdir(args.tokenizer):  # never a hub name: this machine may have no network
            print(f"epd bench: error: --tokenizer {args.tokenizer}: not a directory", file=sys.stderr)
            return 2
        try:
            prompts = prompt_maker(config)
        except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError, ...
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            print(f"epd bench: error: --tokenizer {args.tokenizer}: no tokenizer loads from it ({first})",
                  file=sys.stderr)
            return 2
    if args.baseline == "vllm":  # before anything starts: say in one line how to make it
        from bench.peers.vllm import VllmUnavailable, find_env

        try:
            find_env(args.vllm_env)
        except VllmUnavailable as error:
            print(f"epd bench: error: {error}", file=sys.stderr)
            return 2
    if args.model:
        _raise_on_sigterm()  # so the local stack is stopped on SIGTERM too
    from control.fleet import DeploymentFailed
    from control.local import StartError

    try:
        report = run_bench(config, prompts)
    except (DeploymentFailed, StartError) as error:  # the stack it started could not serve: one line, as epd serve says it
        print(f"epd bench: error: {_cause(error)}", file=sys.stderr)
        return 1
    print(format_report(report))
    if config.json_path:
        print(f"wrote {config.json_path}")
    if config.plot_path:
        print(f"wrote {config.plot_path}")
    if "baseline_error" in report:  # a vLLM server that would not start: epd's figures are above
        print(f"epd bench: error: the baseline did not run: {report['baseline_error']}", file=sys.stderr)
        return 1
    return 1 if report["failed"] == report["num_requests"] else 0


def _simulate_parser() -> argparse.ArgumentParser:
    from bench.simulate import SimConfig

    d = SimConfig()
    parser = argparse.ArgumentParser(prog="epd bench simulate", formatter_class=_Formatter,
                                     description="Simulate prefill routing policies (round-robin, least-load, "
                                                 "affinity, epd) over many prefill replicas with the router's own "
                                                 "selection code and this machine's prefill rate.")
    parser.add_argument("--replicas", type=_batch_sizes, default=[8, 64, 256], metavar="N,N,...")
    parser.add_argument("--measure", metavar="DIR", default=None,
                        help="measure the prefill rate of this checkpoint first (else --rate-json or the defaults)")
    parser.add_argument("--rate-json", metavar="PATH", default=None, help="a rate measured before (--measure's JSON)")
    parser.add_argument("--conversations-per-replica", type=_int_in(1, 10**4), default=d.conversations_per_replica)
    parser.add_argument("--turns", type=_int_in(1, 100), default=d.turns)
    parser.add_argument("--utilization", type=_float_in(0, 10, low_open=True), default=d.utilization,
                        help="prefill work of the trace without any cache, as a fraction of the fleet")
    parser.add_argument("--routers", type=_int_in(1, 1024), default=d.routers)
    parser.add_argument("--prefix-cache-mb", type=_int_in(0, 1 << 20), default=d.prefix_cache_mb)
    parser.add_argument("--think-s", type=_float_in(0, 1e4), default=d.think_s)
    parser.add_argument("--tpot-s", type=_float_in(0, 10), default=d.tpot_s,
                        help="decode time per answer token (the next turn comes after the answer and the think time)")
    parser.add_argument("--system-tokens", type=_int_in(0, 10**5), default=d.system_tokens,
                        help="a system prompt every conversation starts with (a long one is a prefix all share)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write the rows (and the rate) as JSON")
    parser.add_argument("--plot", dest="plot_path", metavar="PATH", help="write the figures as a PNG")
    parser.set_defaults(func=_cmd_bench_simulate, parser=parser)
    return parser


def _cmd_bench_simulate(args) -> int:
    import json

    from bench import simulate

    rate = {}
    if args.measure:
        from bench.prefill_rate import measure

        rate = measure(args.measure)
        print(f"prefill rate of {args.measure}: {rate['fixed_s'] * 1000:.1f} ms + {rate['per_token_s'] * 1e6:.0f} us "
              f"per token")
    elif args.rate_json:
        with open(args.rate_json) as f:
            rate = json.load(f)
    config = simulate.SimConfig(
        conversations_per_replica=args.conversations_per_replica, turns=args.turns, utilization=args.utilization,
        routers=args.routers, prefix_cache_mb=args.prefix_cache_mb, think_s=args.think_s, seed=args.seed,
        system_tokens=args.system_tokens, tpot_s=args.tpot_s,
        **{k: rate[k] for k in ("per_token_s", "fixed_s", "kv_bytes_per_token", "linear_state_bytes") if k in rate})
    simulate.main(args.replicas, config, args.json_path, args.plot_path)
    return 0


def _cmd_bench_decode_step(args) -> int:
    from bench.decode_step import run_decode_step_bench

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        args.parser.error(f"{args.model!r} is not a checkpoint directory (no config.json)")
    run_decode_step_bench(args.model, args.batch_sizes, args.dtype, args.json_path)  # prints its table
    return 0


def _cmd_model_create(args) -> int:
    out = args.out
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not args.overwrite:
        args.parser.error(f"{out} exists and is not empty; pass --overwrite to replace it")
    from epd.checkpoint import create_checkpoint  # torch and transformers: seconds, only once it is a go
    from epd.memory_plan import DoesNotFit

    try:
        path = create_checkpoint(args.preset, out, seed=args.seed, progress=True, overwrite=args.overwrite,
                                 config_only=args.config_only, dtype=args.dtype)
    except DoesNotFit as error:
        args.parser.error(str(error))
    print(f"wrote {args.preset} {'config (no weights)' if args.config_only else 'checkpoint'} to {path}")
    return 0


def _cmd_demo(args) -> int:
    from control.demo import run_demo

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        args.parser.error(f"{args.model!r} is not a checkpoint directory (no config.json); "
                          "create one with `epd model create --preset tiny --out DIR`")
    _check_checkpoint(args, args.model)
    return run_demo(args.model)


def _cmd_serve(args) -> int:
    from control.local import LocalStack, StartError, StoppedElsewhere, wait_forever
    from epd import logs
    from epd.config import ConfigError

    _setup_logging(args)
    try:
        aggregate, why = flags.one_machine_mode(args, args.config)
        config = flags.with_secrets(flags.deploy_config(args, flags.SERVE, args.config, aggregate=aggregate), args,
                                    os.environ)
    except ConfigError as error:
        args.parser.error(str(error))
    _check_checkpoint(args, config.serve.model_dir)
    _check_memory(args, config)
    for option, port in (("--port", config.serve.router.port), ("--http-port", config.serve.http.port)):
        busy = _port_in_use(config.serve.router.host, port or 0)
        if busy:
            args.parser.error(f"{option} {port}: {busy}")
    _raise_on_sigterm()
    from control.fleet import DeploymentFailed

    stack = LocalStack(config)
    failed = ""
    try:
        shape = "one engine per replica (aggregated)" if config.aggregate else "separate replicas"
        logs.say(f"prefill and decode: {shape} ({why})")
        address = stack.start()
        say = logs.say  # the command's own lines: JSON too with --log-format json
        say(f"ray at {stack.ray_address} namespace {config.namespace}")
        scheme = "https" if config.serve.security.tls_cert else "http"
        for http in stack.http_addresses():
            say(f"epd http at {scheme}://{http}/v1")
        say(f"epd ready at {address}")
        from epd import sched

        with sched.control_plane():  # while it only waits, this process is control plane too
            wait_forever(stack)
    except KeyboardInterrupt:
        pass
    except (DeploymentFailed, StartError, TimeoutError) as error:  # stop everything, say why in one line
        failed = _cause(error)  # (a role cannot start, Redis cannot be reached, replicas not serving in time)
    except StoppedElsewhere as error:  # `epd down`: its roles are gone; Ray and Redis go too
        logs.say(f"epd serve: {error}", sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        started = time.monotonic()
        logs.say("epd stopping: draining the routers" if stack.controller is not None else "epd stopping", sys.stderr)
        drained = stack.stop()
        if drained.get("in_flight"):
            logs.say(f"epd drained {drained['in_flight']} request(s) in flight: {drained['finished']} finished, "
                     f"{drained['cut']} cut at the {config.drain_timeout_s:g} s drain timeout", sys.stderr)
        logs.say(f"epd stopped in {time.monotonic() - started:.1f} s", sys.stderr)
        logs.say("epd stopped")
        if failed:
            logs.say(f"epd serve: stopped: {failed}", sys.stderr, level="ERROR")
    return 1 if failed else 0


def _cause(error: BaseException) -> str:
    """The message of an exception raised in a Ray actor (Ray's error carries it as ``cause``,
    with the remote traceback in its own text), or of a local one."""
    return str(getattr(error, "cause", None) or error)


def _check_checkpoint(args, model_dir: str) -> None:
    """Refuse a checkpoint epd cannot serve before Ray starts, by the check every role's loading
    makes (else each role would fail in its constructor and be replaced in turn)."""
    from epd.model_check import UnsupportedCheckpoint, check_model_type

    try:
        check_model_type(model_dir)
    except UnsupportedCheckpoint as error:
        args.parser.error(str(error))


def _check_memory(args, config) -> None:
    """Refuse, before Ray starts, a deployment whose model replicas cannot all fit in this host's
    RAM (weights, K/V pools, linear-attention slots, activations: ``epd.memory_plan``), in one
    line with the numbers. Replicas given GPUs (``--num-gpus``, or a GPU Ray will find) are
    checked against their device by each role, before its load."""
    from epd import memory_plan

    # a GPU the local Ray node offers (--num-gpus N, or one Ray will detect) goes to the replicas
    gpus = flags.local_gpus_offered(config.local_gpus)
    on_host = {role: config.replicas(role) for role in memory_plan.MODEL_ROLES
               if not gpus and not config.role_resources(role).num_gpus}
    for role in ("prefill", "decode"):
        world = getattr(config.serve, role).tensor_parallel
        if world > 1:
            problem = memory_plan.tensor_parallel_problem(memory_plan.read_raw_config(config.serve.model_dir), world)
            if problem:
                args.parser.error(f"{role}.tensor_parallel = {world}: {problem}")
    try:
        memory_plan.check_deployment(config.serve.model_dir, config.serve, on_host,
                                     memory_plan.host_available(), "this host's RAM", aggregate=config.aggregate)
    except memory_plan.DoesNotFit as error:
        args.parser.error(str(error))


def _port_in_use(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound now ('' when it can, or when the port is 0).

    Bound the way the servers bind it: with SO_REUSEADDR (gRPC sets it, and so does the HTTP
    front), so connections of a stopped deployment still in TIME_WAIT do not block a restart on
    the same port for a minute, while a port another process listens on is still refused. (Not
    SO_REUSEPORT, which gRPC sets too: with it a second server would share a listening port.)"""
    import socket

    if not port:
        return ""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        return f"cannot listen on {host}:{port}: {error.strerror}"
    return ""


def _ray_env(address: str) -> None:
    """Before ray is imported: a driver joining a Ray on loopback (``epd serve``'s) must stay on
    loopback too, or it looks for its node at the machine's interface address."""
    from pathlib import Path

    if address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # A short-lived driver has no metrics worth exporting, and Ray 2.60's metrics reader thread can
    # race the process's exit (a SIGSEGV in opentelemetry's Collect, seen once in ~50 `epd status`
    # calls under load). Off for this process only: the cluster's own processes keep theirs.
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    # Ray's own rule for `ray start` and a local ray.init: with a token in ~/.ray/auth_token the
    # cluster requires it, and a driver sends it only in token mode. RAY_AUTH_MODE set by the
    # user wins (e.g. RAY_AUTH_MODE=disabled for a cluster started without auth).
    if (Path.home() / ".ray" / "auth_token").is_file() or os.environ.get("RAY_AUTH_TOKEN"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")


_ROLE_NAMES = {"encoders": "encoder", "encode-services": "encode", "prefill": "prefill", "decode": "decode",
               "routers": "router"}


def _cmd_deploy(args) -> int:
    from epd.config import ConfigError

    try:
        config = flags.with_secrets(flags.deploy_config(args, flags.DEPLOY, args.config, bind="node"), args,
                                    os.environ)
    except ConfigError as error:
        args.parser.error(str(error))
    if not config.serve.security.internal_tls_ca and not args.allow_plaintext_internal:
        # Every call between roles carries the internal token; across nodes without TLS anyone on
        # the path reads it (and with it may call every internal service).
        args.parser.error("calls between nodes would carry the internal token in clear: give --internal-tls-ca, "
                          "--internal-tls-cert and --internal-tls-key, or --allow-plaintext-internal on a "
                          "private network")
    _check_checkpoint(args, config.serve.model_dir)
    why = _tcp_probe(args.address, CONNECT_TIMEOUT_S)
    if why:  # else Ray's driver would retry for minutes
        print(f"epd deploy: no Ray cluster answers at {args.address} ({why})", file=sys.stderr)
        return 1
    _setup_logging(args)
    _ray_env(args.address)
    import ray

    from control import controller
    from epd import logs

    ray.init(address=args.address, namespace=config.namespace, logging_level=logging.WARNING,
             configure_logging=False, log_to_driver=False,
             runtime_env=logs.runtime_env(args.log_format, args.log_level))
    try:
        try:
            ray.get_actor(controller.CONTROLLER_NAME, namespace=config.namespace)
            print(f"epd deploy: namespace {config.namespace!r} already has a deployment; "
                  "`epd down` it or pick another --namespace", file=sys.stderr)
            return 1
        except ValueError:
            pass
        try:
            handle = controller.create_controller(config, detached=True)
        except controller.DeploymentFailed as error:  # a role cannot start; the controller is gone again
            print(f"epd deploy: stopped: {_cause(error)}", file=sys.stderr)
            return 1
        status = ray.get(handle.status.remote())
        scheme = "https" if config.serve.security.tls_cert else "http"
        for http in ray.get(handle.http_addresses.remote()):
            logs.say(f"epd http at {scheme}://{http}/v1")
        for address in ray.get(handle.router_addresses.remote()):
            logs.say(f"epd ready at {address}")
        if args.json:
            print(json.dumps(status), flush=True)
        else:
            logs.say(f"metrics at http://{status['metrics']}/metrics")
    finally:
        ray.shutdown()
    return 0


def _connect(args):
    """The deployment's controller, or exit with one line saying why there is none, within
    ``--connect-timeout`` seconds.

    A dead address would keep Ray's driver retrying for minutes (with its C++ warnings), so the
    GCS port is first probed with a plain TCP connect; then ray.init runs in a thread this one
    waits on, so that a GCS that accepts and never answers is given up on at the deadline and
    Ctrl-C works at once. A connection abandoned half-made cannot be shut down cleanly, so those
    two ends leave at once (``os._exit``) after saying why."""
    import threading

    deadline = time.monotonic() + args.connect_timeout
    why = _tcp_probe(args.address, args.connect_timeout)
    if why:
        _no_deployment(args, why)
    _ray_env(args.address)
    from control import controller

    found: dict = {}

    def join() -> None:
        try:
            found["handle"] = controller.connect(args.address, args.namespace)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            found["error"] = error

    thread = threading.Thread(target=join, name="ray-connect", daemon=True)
    # Ray's driver logs each failed try from C++ straight onto fd 2 (what it means is said below).
    sys.stderr.flush()
    saved, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)
    try:
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        os.dup2(saved, 2)
        print(file=sys.stderr, flush=True)
        os._exit(130)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(quiet)
    if thread.is_alive():
        _no_deployment(args, f"no answer within {args.connect_timeout:g} s", abandon=True)
    error = found.get("error")
    if isinstance(error, (RuntimeError, ConnectionError)):
        print(f"{args.parser.prog}: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    if error is not None:
        _no_deployment(args, f"{type(error).__name__}: {_last_line_of(error)}")
    return found["handle"]


def _tcp_probe(address: str, timeout_s: float) -> str:
    """Why nothing takes a TCP connection at ``address`` within ``timeout_s`` ('' when something does)."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 5.0)):
            return ""
    except socket.timeout:
        return f"no answer within {min(timeout_s, 5.0):g} s"
    except OSError as error:
        return (error.strerror or str(error)).lower()


def _no_deployment(args, why: str, abandon: bool = False) -> None:
    print(f"{args.parser.prog}: no epd deployment answers at {args.address} ({why})", file=sys.stderr, flush=True)
    if abandon:
        sys.stdout.flush()
        os._exit(1)
    raise SystemExit(1)


def _last_line_of(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else ""


def _ask(handle, method: str, *args, wait_s: float = 120.0):
    """A call to the controller. While Ray restarts it (its process died), wait for it rather than
    fail: status and scale are safe to send again (scale sets a count, it does not add)."""
    import ray

    deadline, told = time.monotonic() + wait_s, False
    while True:
        try:
            return ray.get(getattr(handle, method).remote(*args))
        except ray.exceptions.ActorDiedError:  # `epd down` (or a lost head) while this command ran
            print("epd: the deployment was stopped", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            if not told:
                print("epd: the controller is restarting; waiting for it", file=sys.stderr)
                told = True
            time.sleep(1.0)


def _cmd_scale(args) -> int:
    handle = _connect(args)  # first: it sets Ray's environment before ray is imported
    import ray

    try:
        count = _ask(handle, "scale", _ROLE_NAMES[args.role], args.count)
    except ray.exceptions.RayTaskError as error:
        print(f"epd scale: {error.cause if hasattr(error, 'cause') else error}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"{args.role}: {count}")
    return 0


def _cmd_status(args) -> int:
    handle = _connect(args)  # first: it sets Ray's environment before ray is imported
    import ray

    from control import controller

    if args.watch:
        _raise_on_sigterm()  # after Ray's own handlers: stopping a watch is not a crash
    try:
        while True:
            status = _ask(handle, "status")
            status["placements"] = []
            if args.json and not args.watch:  # every actor as Ray's state API sees it (needs the dashboard)
                try:
                    status["placements"] = controller.placements(args.namespace, args.address)
                except Exception as error:  # noqa: BLE001 - a Ray without its dashboard has no state API
                    print(f"epd status: no placements from Ray's state API ({type(error).__name__})",
                          file=sys.stderr)
            if args.json:
                print(json.dumps(status), flush=True)
            else:
                _print_status(status, header=bool(args.watch))
            if not args.watch:
                return 0
            time.sleep(args.watch)
    finally:
        ray.shutdown()


def _print_status(status: dict, header: bool) -> None:
    print("\n".join(status_lines(status, header)), flush=True)


_NOW = {"serving": "serving", "starting": "starting", "not_serving": "not serving", "unreachable": "not answering",
        "dead": "dead", "unplaced": "waiting for a node", "draining": "draining"}
"""How a replica's state reads in a role's header (what it does now)."""
_HISTORY = ("unhealthy", "recovered", "restarted", "died", "replaced")


def status_lines(status: dict, header: bool = False) -> list[str]:
    """`epd status` as text. A role's header says what its replicas do now (`router: 1 of 1
    serving`, `prefill: 0 of 1 serving, 1 not answering`); what happened to them since the
    deployment started (unhealthy, recovered, ..., across controller restarts) is counted apart,
    under "history", with the latest events after it."""
    lines = []
    if header:
        lines.append(f"--- {time.strftime('%H:%M:%S', time.localtime(status['time']))}")
    if status.get("failed"):
        lines.append(f"deployment stopped: {status['failed']}")
    where = {r["name"]: r["node_ip"] or "?" for replicas in status["roles"].values() for r in replicas}
    for role, replicas in status["roles"].items():
        now: dict[str, int] = {}
        for replica in replicas:
            state = "draining" if replica["draining"] else replica["state"]
            now[state] = now.get(state, 0) + 1
        serving = now.pop("serving", 0)
        others = "".join(f", {n} {_NOW.get(state, state.replace('_', ' '))}" for state, n in sorted(now.items()))
        if role == "decode" and status.get("aggregate") and not replicas:
            lines.append("decode: in the prefill replicas (aggregated: one engine each)")
            continue
        aggregated = " (aggregated: decodes too)" if role == "prefill" and status.get("aggregate") else ""
        lines.append(f"{role}: {serving} of {status['desired'][role]} serving{others}{aggregated}")
        for replica in replicas:
            state = replica["state"] + (", draining" if replica["draining"] else "")
            http = f"  http {replica['http_address']}" if replica.get("http_address") else ""
            work = "" if replica.get("in_flight") is None else f"  {replica['in_flight']} in flight"
            kv = replica.get("kv")
            if kv:
                work += (f"  K/V {kv['usage']:.0%} of {kv['capacity_tokens']} tokens, "
                         f"{kv['preemptions']} preempted")
            lines.append(f"  {replica['name']:12} {state:10} node {where.get(replica['name'], '?'):15} "
                         f"{replica['address']}{http}{work}")
    for role, why in status.get("not_replacing", {}).items():
        lines.append(f"{role}: not starting more replicas: {why} (`epd scale` tries again)")
    for entry in status.get("unplaced", []):
        lines.append(f"{'/'.join(entry['roles'])}: {entry['count']} replica(s) cannot be placed (of "
                     f"{', '.join(entry['replicas'])}, not serving): {entry['reason']}")
    history = []
    for role, counts in status["counts"].items():
        events = ", ".join(f"{counts[kind]} {kind}" for kind in _HISTORY if counts.get(kind))
        if events:
            history.append(f"{role} {events}")
    restarts = status.get("controller_starts", 1) - 1
    if restarts:
        history.append(f"controller restarted {restarts}x")
    if history or status["events"]:
        since = status.get("since")
        when = f"the deployment started at {time.strftime('%H:%M:%S', time.localtime(since))}" if since \
            else "the deployment started"
        lines.append(f"history (since {when}, not the state now): "
                     + ("; ".join(history) if history else "no failures"))
    for event in status["events"][-10:]:
        when = time.strftime("%H:%M:%S", time.localtime(event["time"]))
        took = f" ({event['seconds']:.1f} s)" if event["seconds"] else ""
        lines.append(f"  {when} {event['name']} {event['kind']}{took} {event['detail']}".rstrip())
    lines.append(f"metrics  http://{status['metrics']}/metrics")
    return lines


def _cmd_down(args) -> int:
    handle = _connect(args)  # first: it sets Ray's environment before ray is imported
    import ray

    from control import controller

    try:
        drained = controller.stop_controller(handle, drain=True)
    finally:
        ray.shutdown()
    if drained.get("in_flight"):
        print(f"drained {drained['in_flight']} request(s) in flight: {drained['finished']} finished, "
              f"{drained['cut']} cut at the drain timeout")
    print(f"epd deployment {args.namespace!r} stopped")
    return 0


def _raise_on_sigterm() -> None:
    """SIGTERM and SIGINT both raise KeyboardInterrupt, so the cleanup in ``finally`` runs. SIGINT
    is set explicitly: a process started with it ignored (a background job of a shell script, or
    a parent that ignores it) would otherwise never stop on Ctrl-C or ``kill -INT``."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _cmd_generate(args) -> int:
    import grpc

    from epd import client

    try:
        messages = _generate_messages(args)
    except ValueError as error:
        args.parser.error(str(error))
    request = client.chat_request(
        messages, max_pixels=args.max_pixels, max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
        logprobs=args.logprobs, enable_thinking=args.enable_thinking, prompt_logprobs=args.prompt_logprobs,
    )
    # On a terminal the answer's control characters are shown escaped, not obeyed; a pipe or a file
    # gets the text as it is (the --json line always carries it exactly).
    shown = _shown_on(sys.stdout)
    on_text = lambda text: print(shown(text), end="", flush=True)  # noqa: E731
    try:
        tls_ca = client.read_ca(args.tls_ca)
    except ValueError as error:
        args.parser.error(str(error))
    api_key = args.api_key or os.environ.get("EPD_API_KEY") or None
    try:
        result = client.generate(args.addr, request, on_text=on_text, timeout_s=args.timeout, api_key=api_key,
                                 tls_ca=tls_ca)
    except grpc.RpcError as error:
        print(f"{error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print()
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
    return 0


def _generate_messages(args) -> list:
    """``--prompt`` with ``--image`` files, or the conversation in ``--messages``."""
    from epd import client

    if args.messages is None:
        prompt = args.prompt if args.prompt_file is None else _read_prompt(args.prompt_file)
        images = []
        for path in args.image:
            try:
                with open(path, "rb") as f:
                    images.append(f.read())
            except OSError as error:
                raise ValueError(f"cannot read image {path}: {error.strerror}") from None
        return list(client.user_request(prompt, images).messages)
    if args.image:
        raise ValueError("--image goes with --prompt; put a conversation's images in its --messages file")
    try:
        with open(args.messages) as f:
            data = json.load(f)
    except OSError as error:
        raise ValueError(f"cannot read {args.messages}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{args.messages} is not valid JSON: {error}") from None
    return client.messages_from_json(data, os.path.dirname(os.path.abspath(args.messages)))


def _read_prompt(path: str) -> str:
    """``--prompt-file``: the file's text (``-``: stdin), UTF-8; ValueError in one line otherwise."""
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except OSError as error:
        raise ValueError(f"--prompt-file: cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"--prompt-file: {path} is not UTF-8 text (byte {error.start})") from None


def _shown_on(stream):
    """How the answer's text is written to ``stream``: escaped on a terminal, as it is elsewhere."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return terminal_text if tty else (lambda text: text)


_BIDI = {0x200E, 0x200F, 0x202A, 0x202B, 0x202C, 0x202D, 0x202E, 0x2066, 0x2067, 0x2068, 0x2069}


def terminal_text(text: str) -> str:
    """``text`` safe to print on a terminal: control characters (ESC and the rest of C0/C1, DEL)
    and bidirectional overrides written as escapes (``\x1b``, ``\u202e``), so a model's answer
    cannot move the cursor, recolour, retitle or reorder the terminal; newlines and tabs stay."""
    out = []
    for char in text:
        code = ord(char)
        if char in "\n\t" or not (code < 0x20 or 0x7F <= code < 0xA0 or code in _BIDI):
            out.append(char)
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        else:
            out.append(f"\\u{code:04x}")
    return "".join(out)


if __name__ == "__main__":
    sys.exit(main())
