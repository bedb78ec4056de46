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
    serve.add_argument("--log-level", default="WARNING")
    serve.set_defaults(func=_cmd_serve)

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
    from epd.config import ConfigError, DecodeConfig, EncodeConfig, LMConfig, RouterConfig, ServeConfig, StoreConfig
    from epd.serve import LocalStack, wait_forever

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = ServeConfig(
            model_dir=args.model,
            store=StoreConfig(redis_url=args.redis),
            encode=EncodeConfig(num_replicas=args.encoders, dtype=args.dtype),
            prefill=LMConfig(dtype=args.dtype),
            decode=DecodeConfig(dtype=args.dtype),
            router=RouterConfig(host=args.host, port=args.port, max_model_len=args.max_model_len),
        )
    except ConfigError as error:
        print(f"epd serve: {error}", file=sys.stderr)
        return 2
    _raise_on_sigterm()
    stack = LocalStack(config)
    try:
        address = stack.start()
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
