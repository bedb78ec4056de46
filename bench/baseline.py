"""The transformers baseline: the same workload through ``Qwen3_5ForConditionalGeneration.generate``,
one request at a time in this process, on the same weights and dtype (via ``bench.oracle.Oracle``).

Each request is timed like an epd request: from before its inputs are built (chat template,
tokenization, image preprocessing: the work epd's router and encoders do inside TTFT) to each
token, recorded by a streamer. Multi-turn conversations carry the baseline's own answers.
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from bench.metrics import RequestRecord
from bench.workload import Turn, Workload


class TokenClock(BaseStreamer):
    """Records when ``generate`` hands over tokens: the first ``put`` is the prompt, then one per step."""

    def __init__(self) -> None:
        self.put_times_s: list[float] = []

    def put(self, value) -> None:
        self.put_times_s.append(time.perf_counter())

    def end(self) -> None:
        pass

    @property
    def token_times_s(self) -> list[float]:
        return self.put_times_s[1:]


def user_message(turn: Turn) -> dict:
    content = [{"type": "image", "image": image.data} for image in turn.images]
    return {"role": "user", "content": [*content, {"type": "text", "text": turn.text}]}


def run_transformers(model_dir: str, dtype: str, workload: Workload, output_tokens: int,
                     num_threads: int = 0) -> tuple[list[RequestRecord], float]:
    """Every request's record and the wall time of the whole sequential run.

    ``num_threads`` sets torch's intra-op threads for the run (0: torch's default, one per core).
    """
    import torch

    from bench.oracle import Oracle

    if num_threads:
        torch.set_num_threads(num_threads)
    oracle = Oracle(model_dir, dtype=dtype)
    for turn in workload.warmup:  # untimed, as for epd
        _request(oracle, [user_message(turn)], output_tokens, RequestRecord(conversation=-1, turn=0))
    records: list[RequestRecord] = []
    with tqdm(total=workload.num_requests, desc="transformers", unit="req", leave=False) as bar:
        start = time.perf_counter()
        for conversation in workload.conversations:
            history: list[dict] | None = []  # None once a turn failed
            for index, turn in enumerate(conversation.turns):
                record = RequestRecord(conversation=conversation.index, turn=index)
                if history is None:
                    record.error = "not sent: an earlier turn of this conversation failed"
                else:
                    message = user_message(turn)
                    answer = _request(oracle, [*history, message], output_tokens, record)
                    history = None if answer is None else [*history, message, _assistant(answer)]
                records.append(record)
                bar.update(1)
        duration = time.perf_counter() - start
    return records, duration


def _request(oracle, messages: list[dict], output_tokens: int, record: RequestRecord) -> str | None:
    """Run one request, filling ``record``; returns the answer's text, or None when it failed."""
    clock = TokenClock()
    record.sent_s = time.perf_counter()
    try:
        inputs = oracle.chat_inputs(messages)
        token_ids = oracle.generate_exact(inputs, output_tokens, streamer=clock)
    except Exception as error:  # noqa: BLE001 - a failed request is reported, not fatal
        record.done_s = time.perf_counter()
        record.error = f"{type(error).__name__}: {error}"
        return None
    record.done_s = time.perf_counter()
    record.token_times_s = clock.token_times_s
    record.output_tokens = len(token_ids)
    record.prompt_tokens = int(inputs["input_ids"].shape[1])
    return oracle.decode(token_ids)


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}
