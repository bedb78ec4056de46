"""What a structured output's token mask costs per decode step.

``python -m bench.grammar_mask --model /tmp/m08b [--json PATH]`` builds, for batch sizes 1, 8 and
16, one ``epd.grammar.GrammarState`` per row on a nested JSON schema (the checkpoint's tokenizer
and its full logits width: 248,320 for Qwen3.5), walks every row greedily through seeded random logits, and
times decode's per-step sampling work (``epd.sampling.sample`` for every row, as
``DecodeEngine._publish`` runs it) with the grammar and without it on the same logits, side by
side in one loop. The difference is the mask's cost per step (computing it, unpacking it, applying
it, and feeding the sampled token back). Also: the one-off costs (the tokenizer, once per process;
a grammar's compilation, once per request) and, when installed, outlines-core's index build for the
same schema (the alternative engine whose per-request cost decided against it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.decode_step import machine_info
from epd import grammar
from epd.modelinfo import ModelInfo
from epd.sampling import SamplingConfig, sample
from epd.v1 import epd_pb2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                  "required": ["id", "ok"]},
    },
    "required": ["name", "age", "score", "kind", "tags", "owner"],
}


def run(model_dir: str, batches=(1, 8, 16), steps: int = 40) -> dict:
    info = ModelInfo.load(model_dir)
    start = time.perf_counter()
    tokenizer = grammar.tokenizer_for(info)
    tokenizer_s = time.perf_counter() - start
    spec = epd_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    start = time.perf_counter()
    compiled = grammar.compile_structured(spec, tokenizer)
    compile_s = time.perf_counter() - start
    vocab = info.vocab_size
    report = {"model": model_dir, "vocab": vocab, "tokenizer_build_s": tokenizer_s, "grammar_compile_s": compile_s,
              "machine": machine_info(), "load_average": os.getloadavg(), "batches": {}}
    plain = SamplingConfig(max_tokens=1000)  # greedy: what decode runs by default
    guided = SamplingConfig(max_tokens=1000, grammar=compiled)
    eos = info.eos_token_ids
    for batch in batches:
        start = time.perf_counter()
        states = [grammar.GrammarState(tokenizer, compiled) for _ in range(batch)]
        matcher_s = (time.perf_counter() - start) / batch
        generator = torch.Generator().manual_seed(batch)
        with_mask, without = [], []
        for step in range(steps):
            logits = torch.randn(batch, vocab, generator=generator) * 3
            for row, state in enumerate(states):  # a finished row starts over (untimed): every row mid-answer
                if state.is_complete():
                    states[row] = grammar.GrammarState(tokenizer, compiled)
            t0 = time.perf_counter()
            for row in range(batch):
                sample(logits[row], plain, step, eos_token_ids=eos)
            t1 = time.perf_counter()
            for row, state in enumerate(states):
                sample(logits[row], guided, step, eos_token_ids=eos, grammar=state)
            t2 = time.perf_counter()
            without.append(t1 - t0)
            with_mask.append(t2 - t1)
        plain_ms, guided_ms = statistics.median(without) * 1e3, statistics.median(with_mask) * 1e3
        report["batches"][batch] = {"sampling_ms": plain_ms, "sampling_with_mask_ms": guided_ms,
                                    "mask_ms_per_step": guided_ms - plain_ms,
                                    "mask_ms_per_row": (guided_ms - plain_ms) / batch,
                                    "matcher_build_ms": matcher_s * 1e3}
        print(f"batch {batch:2d}: sampling {plain_ms:7.2f} ms/step, with the mask {guided_ms:7.2f} ms/step: mask "
              f"{guided_ms - plain_ms:6.2f} ms/step ({(guided_ms - plain_ms) / batch:.2f} ms a row); a matcher "
              f"{matcher_s * 1e3:.2f} ms", flush=True)
    try:
        import outlines_core
    except ImportError:
        outlines_core = None
    if outlines_core is not None:
        start = time.perf_counter()
        from tokenizers import Tokenizer

        vocab_map: dict[str, list[int]] = {}
        for token, token_id in Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).get_vocab().items():
            if token_id not in info.eos_token_ids:
                vocab_map.setdefault(token, []).append(token_id)
        vocabulary = outlines_core.Vocabulary(min(info.eos_token_ids), vocab_map)
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
        outlines_core.Index(regex, vocabulary)
        report["outlines_core_index_s"] = time.perf_counter() - start
        print(f"outlines-core: index for the same schema {report['outlines_core_index_s']:.2f} s", flush=True)
    print(f"tokenizer {tokenizer_s:.2f} s (once per process), grammar compile {compile_s * 1e3:.1f} ms "
          f"(once per request); load average {report['load_average']}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    report = run(args.model, steps=args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
