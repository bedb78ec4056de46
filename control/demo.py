"""`epd demo`: serve a checkpoint, send one image request, stream the answer, check it.

The check runs the same request through transformers' Qwen3_5ForConditionalGeneration.generate
on the same weights and reports whether the tokens are identical.
"""

from __future__ import annotations

import argparse
import sys

from bench.synthetic import make_image
from control.flags import one_machine_mode
from control.local import LocalStack
from epd import client
from epd.config import DeployConfig, ServeConfig

PROMPT = "What is in this picture?"
MAX_TOKENS = 32


def run_demo(model_dir: str) -> int:
    image = make_image(448, 448, seed=1)
    # the mode `epd serve` would pick with no flags (aggregated where no GPU is offered)
    aggregate, _ = one_machine_mode(argparse.Namespace())
    stack = LocalStack(DeployConfig(serve=ServeConfig(model_dir=model_dir), aggregate=aggregate))
    try:
        address = stack.start()
        print(f"epd ready at {address}")
        print(f"request: one 448x448 image + {PROMPT!r}, greedy, {MAX_TOKENS} tokens")
        print("answer: ", end="", flush=True)
        result = client.generate(
            address, client.user_request(PROMPT, [image], max_tokens=MAX_TOKENS, temperature=0.0),
            on_text=lambda text: print(text, end="", flush=True),
        )
        print()
        s = result.summary
        print(f"prompt {s.prompt_tokens} tokens ({s.image_tokens} image), {s.completion_tokens} generated, "
              f"finish {s.finish_reason}, ttft {s.ttft_s * 1000:.0f} ms, e2e {s.e2e_s * 1000:.0f} ms")
    finally:
        stack.stop()
    from bench.oracle import Oracle

    expected, _, _ = Oracle(model_dir).generate(PROMPT, [image], max_new_tokens=MAX_TOKENS)
    match = expected == result.token_ids
    print(f"token ids: {result.token_ids}")
    print(f"matches transformers generate: {'yes' if match else 'NO'}")
    if not match:
        print(f"transformers gave: {expected}", file=sys.stderr)
    return 0 if match else 1
