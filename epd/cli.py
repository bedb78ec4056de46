"""The ``epd`` command: create checkpoints, serve them, and send requests."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
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
    gen.add_argument("--prompt", required=True)
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
    return parser


def _cmd_model_create(args) -> int:
    from epd.checkpoint import create_checkpoint

    path = create_checkpoint(args.preset, args.out, seed=args.seed, progress=True)
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0


def _cmd_demo(args) -> int:
    from epd.demo import run_demo

    return run_demo(args.model)


def _cmd_serve(args) -> int:
    from epd.config import (ConfigError, DecodeConfig, DeployConfig, EncodeConfig, LMConfig, RouterConfig,
                            ServeConfig, StoreConfig, load_deploy_file)
    from epd.serve import LocalStack, wait_forever

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        resources, autoscale = load_deploy_file(args.config) if args.config else ({}, None)
        config = DeployConfig(
            serve=ServeConfig(
                model_dir=args.model,
                store=StoreConfig(redis_url=args.redis),
                encode=EncodeConfig(num_replicas=args.encoders),
                prefill=LMConfig(dtype=args.dtype),
                decode=DecodeConfig(dtype=args.dtype),
                router=RouterConfig(host=args.host, port=args.port, max_model_len=args.max_model_len),
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
        stack.stop()
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
    from epd.config import (ConfigError, DecodeConfig, DeployConfig, EncodeConfig, LMConfig, RouterConfig,
                            ServeConfig, StoreConfig, load_deploy_file)

    try:
        resources, autoscale = load_deploy_file(args.config) if args.config else ({}, None)
        config = DeployConfig(
            serve=ServeConfig(
                model_dir=args.model,
                store=StoreConfig(redis_url=args.redis),
                encode=EncodeConfig(num_replicas=args.encoders, num_threads=args.encoder_threads),
                prefill=LMConfig(dtype=args.dtype),
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
            status["placements"] = cluster.placements(args.namespace)
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
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _cmd_generate(args) -> int:
    import grpc

    from epd import client

    images = []
    for path in args.image:
        try:
            with open(path, "rb") as f:
                images.append(f.read())
        except OSError as error:
            print(f"epd generate: cannot read image {path}: {error.strerror}", file=sys.stderr)
            return 2
    request = client.user_request(
        args.prompt, images, max_pixels=args.max_pixels, max_tokens=args.max_tokens, temperature=args.temperature,
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


if __name__ == "__main__":
    sys.exit(main())
