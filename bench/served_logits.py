"""Half-precision serving checked against transformers in the same dtype, by logprobs.

A bfloat16 run cannot be held to token identity (argmax flips where two logits are close, and the
two implementations add in different orders), so this checks distributions along the answer the
served stack gave: a real local stack (``control.local.LocalStack``: Ray, embedded Redis, gRPC,
every role in ``--dtype``) answers each case greedily with ``logprobs`` (its top-20 per step); the
stack stops; transformers' ``Qwen3_5ForConditionalGeneration`` in the same dtype then scores the
same prompt + answer in one teacher-forced forward. Per step it compares the served token's
logprob with transformers' (drift), whether transformers' own argmax is the served token, and the
overlap of the two top-5 sets; it also runs transformers' greedy ``generate`` and counts how many
leading tokens the two answers share. It exits 1 when a case's drift is past ``LIMITS``.
``--yardstick`` also scores the answers with transformers in float32, so the served drift can be
read beside transformers' own half-precision drift from float32.

    python -m bench.served_logits --model /tmp/m2b-bf16 --dtype bfloat16 --tokens 32 --json out.json

One model in memory at a time: the stack's (prefill and decode each hold the language model) and then
transformers'. The stack runs small (4 decode slots, a 256 MiB K/V pool, a 256 MiB store): the cases
run one after the other, and the 4b's three roles then fit beside the rest of a 24 GiB machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

CASES = [("Describe a busy harbour at dawn in four sentences.", []),
         ("What is in this picture? Answer in detail.", [(448, 448, 1)])]
TOP = 20
LIMITS = {"logprob_drift_mean": 0.15, "logprob_drift_max": 1.0}
"""The bfloat16 tolerance tests/test_dtype.py holds the tiny preset to (there against float32)."""


def _images(specs):
    from bench.synthetic import make_image

    return [make_image(w, h, seed=seed) for w, h, seed in specs]


def served(model_dir: str, dtype: str, num_tokens: int) -> list[dict]:
    """Each case's greedy answer and per-step logprobs from a local stack in ``dtype``."""
    from control import flags
    from control.local import LocalStack
    from epd import client

    config = flags.deploy_config(argparse.Namespace(), (), None, serve__model_dir=model_dir,
                                 serve__encode__dtype=dtype, serve__prefill__dtype=dtype,
                                 serve__decode__dtype=dtype, serve__decode__max_batch_size=4,
                                 serve__decode__kv_cache_bytes=256 << 20, serve__store__max_memory_mb=256)
    stack = LocalStack(config)
    out = []
    try:
        address = stack.start()
        for prompt, specs in CASES:
            started = time.monotonic()
            result = client.generate(address, client.user_request(
                prompt, _images(specs), max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP),
                timeout_s=1800)
            out.append({"prompt": prompt, "images": specs, "tokens": list(result.token_ids),
                        "logprobs": [entry.logprob for entry in result.logprobs],
                        "top": [[(alt.token_id, alt.logprob) for alt in entry.top] for entry in result.logprobs],
                        "seconds": round(time.monotonic() - started, 2)})
    finally:
        stack.stop()
    return out


def _teacher_forced(oracle, answer: dict):
    """transformers' log-softmax at every step of the served answer (one forward), and the inputs."""
    import torch

    inputs = oracle.inputs(answer["prompt"], _images(answer["images"]))
    prompt_len = inputs["input_ids"].shape[1]
    with torch.no_grad():
        full = torch.cat([inputs["input_ids"], torch.tensor([answer["tokens"][:-1]])], dim=1)
        logits = oracle.model(**{**inputs, "input_ids": full,
                                 "mm_token_type_ids": (full == oracle.image_token_id).int()}).logits
    return torch.log_softmax(logits[0, prompt_len - 1:].float(), dim=-1), inputs


def yardstick(model_dir: str, dtype: str, answers: list[dict]) -> list[dict]:
    """How far transformers' own ``dtype`` run is from its float32 one along the same answers: the
    served token's logprob in each (the scale the served drift is to be read against)."""
    import gc

    from bench.oracle import Oracle

    out = []
    for name in (dtype, "float32"):
        oracle = Oracle(model_dir, dtype=name)
        out.append([_teacher_forced(oracle, answer)[0] for answer in answers])
        del oracle
        gc.collect()
    report = []
    for answer, half, full in zip(answers, *out):
        rows = range(len(answer["tokens"]))
        theirs = [abs(float(half[i, t]) - float(full[i, t])) for i, t in zip(rows, answer["tokens"])]
        ours = [abs(answer["logprobs"][i] - float(full[i, t])) for i, t in zip(rows, answer["tokens"])]
        report.append({"case": answer["prompt"],
                       f"transformers_{dtype}_vs_float32_drift_mean": round(statistics.fmean(theirs), 4),
                       f"transformers_{dtype}_vs_float32_drift_max": round(max(theirs), 4),
                       f"served_{dtype}_vs_float32_drift_mean": round(statistics.fmean(ours), 4),
                       f"served_{dtype}_vs_float32_drift_max": round(max(ours), 4)})
    return report


def compare(model_dir: str, dtype: str, answers: list[dict]) -> list[dict]:
    """transformers' teacher-forced logprobs along each served answer, against the served ones."""
    from bench.oracle import Oracle

    oracle = Oracle(model_dir, dtype=dtype)
    report = []
    for answer in answers:
        reference, inputs = _teacher_forced(oracle, answer)
        tokens = answer["tokens"]
        prompt_len = inputs["input_ids"].shape[1]
        greedy = oracle.generate_through_eos(inputs, len(tokens))
        drift, top1, overlap = [], 0, []
        for step, token in enumerate(tokens):
            drift.append(abs(float(reference[step, token]) - answer["logprobs"][step]))
            top1 += int(int(reference[step].argmax()) == token)
            theirs = set(reference[step].topk(5).indices.tolist())
            ours = {token_id for token_id, _ in answer["top"][step][:5]}
            overlap.append(len(theirs & ours) / 5)
        shared = next((i for i, (a, b) in enumerate(zip(tokens, greedy)) if a != b), len(tokens))
        report.append({"case": answer["prompt"], "images": len(answer["images"]), "prompt_tokens": prompt_len,
                       "tokens": len(tokens), "served_seconds": answer["seconds"],
                       "logprob_drift_mean": round(statistics.fmean(drift), 4),
                       "logprob_drift_max": round(max(drift), 4),
                       "argmax_agrees": f"{top1}/{len(tokens)}",
                       "top5_overlap_mean": round(statistics.fmean(overlap), 3),
                       "leading_tokens_equal_to_generate": f"{shared}/{len(tokens)}"})
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.served_logits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, metavar="DIR")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--tokens", type=int, default=32, help="answer length per case (default 32)")
    parser.add_argument("--json", dest="json_path", metavar="PATH")
    parser.add_argument("--from-json", metavar="PATH",
                        help="score the served answers an earlier --json report holds (no stack is started)")
    parser.add_argument("--yardstick", action="store_true",
                        help="also score the answers with transformers in float32 (its memory: 4 bytes a parameter)")
    args = parser.parse_args(argv)
    if not 1 <= args.tokens <= 4096:
        parser.error(f"--tokens must be in [1, 4096], got {args.tokens}")
    if args.from_json:
        with open(args.from_json) as f:
            answers = json.load(f)["answers"]
    else:
        answers = served(args.model, args.dtype, args.tokens)
    cases = compare(args.model, args.dtype, answers)
    within = all(case[key] <= limit for case in cases for key, limit in LIMITS.items())
    report = {"model": args.model, "dtype": args.dtype, "limits": LIMITS, "within_limits": within, "cases": cases,
              "answers": answers}
    if args.yardstick:
        report["yardstick"] = yardstick(args.model, args.dtype, answers)
    text = json.dumps(report, indent=2)
    print(json.dumps({key: value for key, value in report.items() if key != "answers"}, indent=2))
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
