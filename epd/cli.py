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
    serve.add_argument("--router-metrics-port", type=int, default=0, help="router Prometheus /metrics port (0: off)")
    serve.add_argument("--prefill-metrics-port", type=int, default=0, help="prefill Prometheus /metrics port (0: off)")
    serve.add_argument("--log-level", default="WARNING")
    serve.set_defaults(func=_cmd_serve)

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
    from epd.config import ConfigError, DecodeConfig, EncodeConfig, PrefillConfig, RouterConfig, ServeConfig, StoreConfig
    from epd.serve import LocalStack, wait_forever

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = ServeConfig(
            model_dir=args.model,
            store=StoreConfig(redis_url=args.redis, ttl_s=args.store_ttl_s, max_memory_mb=args.store_max_memory_mb),
            encode=EncodeConfig(num_replicas=args.encoders),
            prefill=PrefillConfig(
                dtype=args.dtype, chunk_tokens=args.prefill_chunk_tokens, embedding_cache_mb=args.embedding_cache_mb,
                prefix_cache_mb=args.prefix_cache_mb, prefix_block_size=args.prefix_block_size,
                snapshot_every_blocks=args.snapshot_every_blocks, metrics_port=args.prefill_metrics_port),
            decode=DecodeConfig(dtype=args.dtype),
            router=RouterConfig(host=args.host, port=args.port, max_model_len=args.max_model_len,
                                metrics_port=args.router_metrics_port),
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
