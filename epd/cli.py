"""The ``epd`` command: create checkpoints, serve them, and send requests."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `epd bench decode-step` has its own options; `epd bench --addr ...` must not need a subcommand.
    parser = _decode_step_parser() if argv[:2] == ["bench", "decode-step"] else _parser()
    args = parser.parse_args(argv[2:] if argv[:2] == ["bench", "decode-step"] else argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return args.func(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated Encode/Prefill/Decode serving for Qwen3.5")
    sub = parser.add_subparsers()

    model = sub.add_parser("model", help="checkpoints").add_subparsers()
    create = model.add_parser("create", help="write a checkpoint with random weights in the real architecture")
    create.add_argument("--preset", required=True, choices=["tiny", "qwen3.5-0.8b"])
    create.add_argument("--out", required=True, help="directory to write")
    create.add_argument("--seed", type=int, default=0)
    create.set_defaults(func=_cmd_model_create)

    serve = sub.add_parser("serve", help="start every role on a local Ray instance")
    serve.add_argument("--model", required=True, help="Qwen3.5 checkpoint directory")
    serve.add_argument("--host", default="127.0.0.1", help="router bind address")
    serve.add_argument("--port", type=int, default=0, help="router port (0: pick a free one)")
    serve.add_argument("--redis", default=None, metavar="URL", help="external Redis (default: embedded)")
    serve.add_argument("--encoders", type=int, default=1, help="encoder replicas")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--max-model-len", type=int, default=0, help="context window (0: the model's)")
    serve.add_argument("--store-ttl-s", type=int, default=3600, help="seconds an embedding stays in Redis")
    serve.add_argument("--store-max-memory-mb", type=int, default=1024,
                       help="memory cap of the embedded Redis, LRU eviction past it (an external Redis keeps its own)")
    serve.add_argument("--embedding-cache-mb", type=int, default=256,
                       help="prefill worker's in-process embedding LRU, MiB (0: off)")
    serve.add_argument("--prefix-cache-mb", type=int, default=512, help="prefill worker's prefix cache, MiB (0: off)")
    serve.add_argument("--prefix-block-size", type=int, default=64, help="tokens per prefix-cache block")
    serve.add_argument("--snapshot-every-blocks", type=int, default=8,
                       help="prefix snapshot every N blocks, besides each prompt's last ones (0: those only)")
    serve.add_argument("--prefill-chunk-tokens", type=int, default=512,
                       help="most prompt tokens one prefill forward runs before waiting prompts take turns")
    serve.add_argument("--max-batch-size", type=int, default=32,
                       help="requests decoded together per step; more wait for a slot")
    serve.add_argument("--encoder-batch-patches", type=int, default=16384,
                       help="patch budget of one vision forward (queued images are batched up to it)")
    serve.add_argument("--router-metrics-port", type=int, default=0, help="router Prometheus /metrics port (0: off)")
    serve.add_argument("--prefill-metrics-port", type=int, default=0, help="prefill Prometheus /metrics port (0: off)")
    serve.add_argument("--config", default=None, metavar="TOML", help="role resources and encoder autoscaling")
    serve.add_argument("--log-level", default="WARNING")
    serve.set_defaults(func=_cmd_serve)

    deploy = sub.add_parser("deploy", help="place every role on a running Ray cluster by Ray resources")
    deploy.add_argument("--address", required=True, help="Ray cluster address (HEAD_IP:6379)")
    deploy.add_argument("--model", required=True, help="checkpoint directory, at this path on every node")
    deploy.add_argument("--redis", required=True, metavar="URL", help="Redis every node can reach (redis://HOST:PORT/0)")
    deploy.add_argument("--encoders", type=int, default=1, help="encoder replicas (the start count when autoscaling)")
    deploy.add_argument("--prefill", type=int, default=1, help="prefill replicas")
    deploy.add_argument("--decode", type=int, default=1, help="decode replicas")
    deploy.add_argument("--routers", type=int, default=1, help="router replicas")
    deploy.add_argument("--config", default=None, metavar="TOML",
                        help="role resources and autoscaling (see deploy/roles.toml)")
    deploy.add_argument("--namespace", default="epd", help="Ray namespace of this deployment")
    deploy.add_argument("--router-port", type=int, default=0, help="router port (0: pick a free one)")
    deploy.add_argument("--metrics-port", type=int, default=0, help="controller's Prometheus port (0: pick)")
    deploy.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    deploy.add_argument("--max-model-len", type=int, default=0, help="context window (0: the model's)")
    deploy.add_argument("--encoder-threads", type=int, default=0, help="torch threads per encoder replica")
    deploy.add_argument("--json", action="store_true", help="print the deployment's status as JSON")
    deploy.set_defaults(func=_cmd_deploy)

    scale = sub.add_parser("scale", help="change a role's replica count on a running deployment")
    scale.add_argument("--address", required=True, help="Ray cluster address")
    scale.add_argument("--namespace", default="epd")
    scale.add_argument("role", choices=["encoders", "prefill", "decode", "routers"])
    scale.add_argument("count", type=int)
    scale.set_defaults(func=_cmd_scale)

    status = sub.add_parser("status", help="a deployment's replicas and where Ray placed them")
    status.add_argument("--address", required=True, help="Ray cluster address")
    status.add_argument("--namespace", default="epd")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_cmd_status)

    down = sub.add_parser("down", help="stop a deployment (the cluster keeps running)")
    down.add_argument("--address", required=True, help="Ray cluster address")
    down.add_argument("--namespace", default="epd")
    down.set_defaults(func=_cmd_down)

    demo = sub.add_parser("demo", help="serve a checkpoint, send one image request, compare with transformers")
    demo.add_argument("--model", required=True)
    demo.set_defaults(func=_cmd_demo)

    gen = sub.add_parser("generate", help="send one request to a running router and stream the answer")
    gen.add_argument("--addr", required=True, help="router HOST:PORT")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one user turn (with --image files)")
    what.add_argument("--messages", metavar="FILE.json",
                      help='a conversation: [{"role": ..., "content": str | [{"type": "text", "text": ...}, '
                           '{"type": "image", "image": PATH}]}], image paths relative to the file')
    gen.add_argument("--image", action="append", default=[], metavar="PATH", help="image file (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--max-pixels", type=int, default=None)
    gen.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the result as the last line")
    gen.set_defaults(func=_cmd_generate)

    _add_bench_parser(sub)
    return parser


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="load-test a router (or a local stack) and compare with transformers",
        description="Send a seeded synthetic workload (images, prompts, multi-turn conversations) to epd and "
                    "report TTFT, TPOT, ITL, end-to-end latency, throughput and goodput.",
        epilog="Also: `epd bench decode-step --model DIR --batch-sizes 1,4,16` times the decode step alone "
               "(see `epd bench decode-step --help`).",
    )
    target = bench.add_mutually_exclusive_group(required=True)
    target.add_argument("--addr", help="a running router's HOST:PORT")
    target.add_argument("--model", metavar="DIR", help="checkpoint: start a local stack for the run, stop it after")
    bench.add_argument("--num-requests", type=_positive_int, required=True, metavar="N",
                       help="requests in all (a conversation of --turns T counts T)")
    mode = bench.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=_positive_int, metavar="C", help="closed loop: C conversations in flight")
    mode.add_argument("--request-rate", type=_positive_float, metavar="R",
                      help="open loop: R conversations per second, Poisson arrivals")
    bench.add_argument("--image-sizes", type=_image_sizes, default=(), metavar="WxH[:P],...",
                       help="image sizes with relative weights P (default 1), e.g. 448x448,1280x720:3")
    bench.add_argument("--images-per-request", type=_non_negative_int, required=True, metavar="K",
                       help="images per request (0: text only)")
    bench.add_argument("--prompt-tokens", type=_positive_int, required=True, metavar="T",
                       help="about T tokens of text per user turn")
    bench.add_argument("--output-tokens", type=_positive_int, required=True, metavar="O",
                       help="exactly O generated tokens per request (greedy, EOS ignored)")
    bench.add_argument("--repeat-ratio", type=_ratio, default=0.0, metavar="F",
                       help="probability an image reuses an earlier image's bytes (default 0)")
    bench.add_argument("--turns", type=_positive_int, default=1, metavar="N",
                       help="turns per conversation; later turns resend the earlier ones with their answers")
    bench.add_argument("--seed", type=int, default=0, help="fixes images, prompts, repeats and arrivals")
    bench.add_argument("--baseline", choices=["transformers"], default=None,
                       help="also run the workload through transformers' generate (needs --model)")
    bench.add_argument("--json", dest="json_path", metavar="PATH", help="write the report as one JSON object")
    bench.add_argument("--plot", dest="plot_path", metavar="PATH", help="write latency CDFs and throughput as a PNG")
    bench.add_argument("--slo-ttft", type=_positive_float, metavar="S", help="goodput: TTFT at most S seconds")
    bench.add_argument("--slo-tpot", type=_positive_float, metavar="S", help="goodput: TPOT at most S seconds")
    bench.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                       help="local stack and baseline dtype (default float32; needs --model)")
    bench.add_argument("--encoders", type=_positive_int, default=None, metavar="N",
                       help="local stack encoder replicas (default 1; needs --model)")
    bench.add_argument("--baseline-threads", type=_non_negative_int, default=0, metavar="N",
                       help="torch threads for the baseline (default 0: torch's default, one per core)")
    bench.add_argument("--timeout", type=_positive_float, default=600.0, metavar="S", help="per-request deadline")
    bench.add_argument("--warmup", type=_non_negative_int, default=1, metavar="N",
                       help="untimed requests sent to each system before its run (default 1)")
    bench.set_defaults(func=_cmd_bench, parser=bench)


def _decode_step_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd bench decode-step",
                                     description="Time one decode step of the language model at each batch size.")
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    parser.add_argument("--batch-sizes", type=_batch_sizes, required=True, metavar="B,B,...", help="e.g. 1,4,16")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write the results as JSON")
    parser.set_defaults(func=_cmd_bench_decode_step)
    return parser


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _image_sizes(text: str):
    from epd.bench.workload import parse_image_sizes

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


def _cmd_bench(args) -> int:
    from epd.bench.run import BenchConfig, format_report, run_bench
    from epd.config import ConfigError

    if args.addr and (args.dtype or args.encoders):
        args.parser.error("--dtype and --encoders configure the local stack: use them with --model, not --addr")
    if args.baseline_threads and not args.baseline:
        args.parser.error("--baseline-threads applies to --baseline transformers")
    if args.baseline and not args.model:
        args.parser.error("--baseline transformers runs on local weights: give --model DIR, not --addr")
    try:
        config = BenchConfig(
            addr=args.addr, model_dir=args.model, num_requests=args.num_requests, concurrency=args.concurrency,
            request_rate=args.request_rate, image_sizes=args.image_sizes, images_per_request=args.images_per_request,
            prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, repeat_ratio=args.repeat_ratio,
            turns=args.turns, seed=args.seed, baseline=args.baseline, json_path=args.json_path,
            plot_path=args.plot_path, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
            dtype=args.dtype or "float32", encoders=args.encoders or 1, timeout_s=args.timeout, warmup=args.warmup,
            baseline_threads=args.baseline_threads,
        )
    except ConfigError as error:
        args.parser.error(str(error))
    if args.model:
        _raise_on_sigterm()  # so the local stack is stopped on SIGTERM too
    try:
        report = run_bench(config)
    except KeyboardInterrupt:
        print("epd bench: interrupted", file=sys.stderr)
        return 130
    print(format_report(report))
    if config.json_path:
        print(f"wrote {config.json_path}")
    if config.plot_path:
        print(f"wrote {config.plot_path}")
    return 1 if report["failed"] == report["num_requests"] else 0


def _cmd_bench_decode_step(args) -> int:
    from epd.decode_step import run_decode_step_bench

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"epd bench decode-step: {args.model!r} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    run_decode_step_bench(args.model, args.batch_sizes, args.dtype, args.json_path)  # prints its table
    return 0


def _cmd_model_create(args) -> int:
    from epd.checkpoint import create_checkpoint

    path = create_checkpoint(args.preset, args.out, seed=args.seed, progress=True)
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0


def _cmd_demo(args) -> int:
    from epd.demo import run_demo

    return run_demo(args.model)


def _cmd_serve(args) -> int:
    from epd.config import (ConfigError, DecodeConfig, DeployConfig, EncodeConfig, PrefillConfig, RouterConfig,
                            ServeConfig, StoreConfig, load_deploy_file)
    from epd.serve import LocalStack, wait_forever

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        resources, autoscale = load_deploy_file(args.config) if args.config else ({}, None)
        config = DeployConfig(
            serve=ServeConfig(
                model_dir=args.model,
                store=StoreConfig(redis_url=args.redis, ttl_s=args.store_ttl_s,
                                  max_memory_mb=args.store_max_memory_mb),
                encode=EncodeConfig(num_replicas=args.encoders, dtype=args.dtype,
                                    max_batch_patches=args.encoder_batch_patches),
                prefill=PrefillConfig(
                    dtype=args.dtype, chunk_tokens=args.prefill_chunk_tokens,
                    embedding_cache_mb=args.embedding_cache_mb, prefix_cache_mb=args.prefix_cache_mb,
                    prefix_block_size=args.prefix_block_size, snapshot_every_blocks=args.snapshot_every_blocks,
                    metrics_port=args.prefill_metrics_port),
                decode=DecodeConfig(dtype=args.dtype, max_batch_size=args.max_batch_size),
                router=RouterConfig(host=args.host, port=args.port, max_model_len=args.max_model_len,
                                    metrics_port=args.router_metrics_port),
            ),
            **({"resources": resources} if resources else {}), **({"autoscale": autoscale} if autoscale else {}),
        )
    except ConfigError as error:
        print(f"epd serve: {error}", file=sys.stderr)
        return 2
    _raise_on_sigterm()
    stack = LocalStack(config)
    try:
        address = stack.start()
        print(f"ray at {stack.ray_address} namespace {config.namespace}", flush=True)
        print(f"epd ready at {address}", flush=True)
        wait_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        started = time.monotonic()
        print("epd stopping", file=sys.stderr, flush=True)
        stack.stop()
        print(f"epd stopped in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        print("epd stopped", flush=True)
    return 0


def _ray_env(address: str) -> None:
    """Before ray is imported: a driver joining a Ray on loopback (``epd serve``'s) must stay on
    loopback too, or it looks for its node at the machine's interface address."""
    import os
    from pathlib import Path

    if address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's own rule for `ray start` and a local ray.init: with a token in ~/.ray/auth_token the
    # cluster requires it, and a driver sends it only in token mode. RAY_AUTH_MODE set by the
    # user wins (e.g. RAY_AUTH_MODE=disabled for a cluster started without auth).
    if (Path.home() / ".ray" / "auth_token").is_file() or os.environ.get("RAY_AUTH_TOKEN"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")


_ROLE_NAMES = {"encoders": "encoder", "prefill": "prefill", "decode": "decode", "routers": "router"}


def _cmd_deploy(args) -> int:
    _ray_env(args.address)
    from epd import cluster
    from epd.config import (ConfigError, DecodeConfig, DeployConfig, EncodeConfig, PrefillConfig, RouterConfig,
                            ServeConfig, StoreConfig, load_deploy_file)

    try:
        resources, autoscale = load_deploy_file(args.config) if args.config else ({}, None)
        config = DeployConfig(
            serve=ServeConfig(
                model_dir=args.model,
                store=StoreConfig(redis_url=args.redis),
                encode=EncodeConfig(num_replicas=args.encoders, num_threads=args.encoder_threads, dtype=args.dtype),
                prefill=PrefillConfig(dtype=args.dtype),
                decode=DecodeConfig(dtype=args.dtype),
                router=RouterConfig(port=args.router_port, max_model_len=args.max_model_len),
            ),
            num_prefill=args.prefill, num_decode=args.decode, num_routers=args.routers, bind="node",
            namespace=args.namespace, metrics_port=args.metrics_port, **({"resources": resources} if resources else {}),
            **({"autoscale": autoscale} if autoscale else {}),
        )
    except ConfigError as error:
        print(f"epd deploy: {error}", file=sys.stderr)
        return 2
    import ray

    ray.init(address=args.address, namespace=config.namespace, logging_level=logging.WARNING,
             configure_logging=False, log_to_driver=False)
    try:
        try:
            ray.get_actor(cluster.CONTROLLER_NAME, namespace=config.namespace)
            print(f"epd deploy: namespace {config.namespace!r} already has a deployment; "
                  "`epd down` it or pick another --namespace", file=sys.stderr)
            return 1
        except ValueError:
            pass
        controller = cluster.create_controller(config, detached=True)
        status = ray.get(controller.status.remote())
        for address in ray.get(controller.router_addresses.remote()):
            print(f"epd ready at {address}", flush=True)
        print(json.dumps(status) if args.json else f"metrics at http://{status['metrics']}/metrics", flush=True)
    finally:
        ray.shutdown()
    return 0


def _cmd_scale(args) -> int:
    _ray_env(args.address)
    import ray

    from epd import cluster

    controller = cluster.connect(args.address, args.namespace)
    try:
        count = ray.get(controller.scale.remote(_ROLE_NAMES[args.role], args.count))
    except ray.exceptions.RayTaskError as error:
        print(f"epd scale: {error.cause if hasattr(error, 'cause') else error}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"{args.role}: {count}")
    return 0


def _cmd_status(args) -> int:
    _ray_env(args.address)
    import ray

    from epd import cluster

    controller = cluster.connect(args.address, args.namespace)
    try:
        status = ray.get(controller.status.remote())
        try:
            status["placements"] = cluster.placements(args.namespace, args.address)
        except Exception as error:  # noqa: BLE001 - a Ray without its dashboard has no state API
            status["placements"] = []
            print(f"epd status: no placements from Ray's state API ({type(error).__name__}: {error}); "
                  "start the head with its dashboard to see them", file=sys.stderr)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(status))
        return 0
    where = {row["name"]: row["node_ip"] for row in status["placements"]}
    for role, replicas in status["roles"].items():
        for replica in replicas:
            state = " (draining)" if replica["draining"] else ""
            print(f"{role:8} {replica['name']:12} node {where.get(replica['name'], '?'):15} {replica['address']}{state}")
    print(f"metrics  http://{status['metrics']}/metrics")
    return 0


def _cmd_down(args) -> int:
    _ray_env(args.address)
    import ray

    from epd import cluster

    controller = cluster.connect(args.address, args.namespace)
    try:
        cluster.stop_controller(controller)
    finally:
        ray.shutdown()
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
        print(f"epd generate: {error}", file=sys.stderr)
        return 2
    request = client.chat_request(
        messages, max_pixels=args.max_pixels, max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    on_text = lambda text: print(text, end="", flush=True)  # noqa: E731
    try:
        result = client.generate(args.addr, request, on_text=on_text, timeout_s=args.timeout)
    except grpc.RpcError as error:
        print(f"{error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print()
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
    return 0


def _generate_messages(args) -> list:
    """``--prompt`` with ``--image`` files, or the conversation in ``--messages``."""
    import os

    from epd import client

    if args.messages is None:
        images = []
        for path in args.image:
            try:
                with open(path, "rb") as f:
                    images.append(f.read())
            except OSError as error:
                raise ValueError(f"cannot read image {path}: {error.strerror}") from None
        return list(client.user_request(args.prompt, images).messages)
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


if __name__ == "__main__":
    sys.exit(main())
