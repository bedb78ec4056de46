"""Prefill and decode as one engine on one device, in-process (tiny model, a real redis-server,
transformers as the oracle): the prefill engine has no thread of its own and its chunks ride the
decode engine's steps (``epd.mixed``), one forward for decode rows and prefill chunks under one
token budget. A text request decodes while an image prompt and a multi-turn conversation (the
image again, its prefix from the cache) are prefilled in 16-token chunks beside it; each prompt
joins the decode batch in the same process when its last chunk has run. Every answer must be
transformers' greedy answer, and the steps must really have mixed.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace

import pytest

from control import placement
from decode_svc.engine import DecodeEngine
from epd.config import ConfigError, DecodeConfig, DeployConfig, PrefillConfig, ServeConfig
from epd.lm import TextModelRunner
from epd.modelinfo import ModelInfo
from epd.sampling import SamplingConfig
from epd.store import EmbeddingStore
from epd.v1 import epd_pb2
from prefill_svc.engine import PrefillEngine
from tests.test_prefill_engine import SQUARE, WIDE, Case, user


@pytest.fixture(scope="module")
def engines(tiny_model_dir, redis_url):
    runner = TextModelRunner.load(tiny_model_dir, decode=True)  # as an aggregated replica loads it
    info = ModelInfo.load(tiny_model_dir)
    prefill = PrefillEngine(runner, info, EmbeddingStore(redis_url),
                            PrefillConfig(chunk_tokens=16, step_tokens=24, prefix_block_size=16,
                                          snapshot_every_blocks=4), own_loop=False)
    decode = DecodeEngine(runner, info.eos_token_ids, DecodeConfig(handoff_lease_s=60, max_batch_size=4),
                          chunk_source=prefill)
    yield info, prefill, decode
    decode.stop()
    prefill.stop()


def _generate(prefill: PrefillEngine, decode: DecodeEngine, request_id: str, case: Case,
              sampling: SamplingConfig) -> list[int]:
    """What an aggregated replica does with one request: prefill (its chunks ride decode's
    steps), sample the first token, join the decode batch locally, stream the rest."""
    request = epd_pb2.PrefillRequest(request_id=request_id, token_ids=case.token_ids, images=case.refs)
    result = prefill.run(request, sampling)
    tokens = [result.first_token]
    if result.finish_reason is not None:
        return tokens
    events: queue.Queue = queue.Queue()
    decode.submit(request_id, len(case.token_ids), result.rope_delta, result.first_token, sampling, result.state,
                  deadline_unix=0)
    decode.claim(request_id, events.put)
    deadline = time.monotonic() + 120
    while True:
        event = events.get(timeout=max(0.1, deadline - time.monotonic()))
        if event.token_id >= 0:
            tokens.append(event.token_id)
        if event.finish_reason is not None:
            return tokens


def test_decode_rows_ride_prefill_chunks_token_identical(engines, oracle, redis_url, monkeypatch):
    info, prefill, decode = engines
    long_text = user("Tell me a long story about a lighthouse keeper and the sea.")
    turn1 = user("What is in this picture?", SQUARE)
    turn2 = [*turn1, {"role": "assistant", "content": "A square."}, user("And this one, compared?", WIDE)[0]]
    conversations = {"text": (long_text, 100), "image": (turn1, 12), "turn2": (turn2, 12)}
    cases = {name: Case(oracle, info, redis_url, messages, max_new_tokens=1)
             for name, (messages, _) in conversations.items()}
    expected = {name: oracle.generate_through_eos(oracle.chat_inputs(messages), n)
                for name, (messages, n) in conversations.items()}
    results: dict[str, list[int]] = {}
    step_sizes: list[int] = []  # each step's decode rows + prompt tokens
    take_chunks = prefill.take_chunks

    def recording(num_decode_rows: int):
        planned = take_chunks(num_decode_rows)
        if planned is not None:
            step_sizes.append(num_decode_rows + planned.num_tokens)
        return planned

    monkeypatch.setattr(prefill, "take_chunks", recording)  # what decode's loop calls

    def run(name: str) -> threading.Thread:
        def target() -> None:
            sampling = SamplingConfig(max_tokens=conversations[name][1], ignore_eos=True)
            results[name] = _generate(prefill, decode, name, cases[name], sampling)
        thread = threading.Thread(target=target)
        thread.start()
        return thread

    # The text prompt (2 chunks) is done first and decodes while the image prompt's ~14 chunks run;
    # the second turn comes after the first has stored its prefix.
    text, image = run("text"), run("image")
    image.join(120)
    run("turn2").join(120)
    text.join(120)
    assert results == expected
    assert decode.mixed_steps > 0, "no step carried decode rows and prefill chunks together"
    screen = decode.runner.greedy_screen
    if screen is not None:  # a CPU with AMX-INT8 or AVX-512 VNNI: the greedy steps' heads went through the screen
        assert screen.screened > 0 and screen.full == 0
    # the step budget is prefill.step_tokens (24), not the prefill replica's batch_tokens (1024)
    assert step_sizes and max(step_sizes) <= 24, step_sizes
    assert prefill.work()["computed_tokens"] < sum(len(case.token_ids) for case in cases.values()), \
        "the second turn's prefix was not served from the prefix cache"
    assert decode.num_unfinished() == 0 and prefill.num_waiting() == 0


def test_a_prompt_decodes_in_the_step_after_its_last_chunk(engines, oracle, redis_url, monkeypatch):
    """A prompt whose last chunk ran in one step is a decode row of the next, while another prompt
    is still being prefilled: the loop waits for its handoff (submitted from the caller's thread,
    as the prefill servicer's local handoff does) before it plans that step, rather than start a
    prefill forward without it and leave its second token for the step after."""
    from decode_svc import engine as decode_engine

    info, prefill, decode = engines
    # a generous bound: the loop goes on as soon as the handoff arrives, however busy the machine
    monkeypatch.setattr(decode_engine, "JOIN_WAIT_S", 30.0)
    cases = {"short": Case(oracle, info, redis_url, user("Hi."), max_new_tokens=1),
             # a conversation no other test sends: none of its blocks are in the prefix cache
             "image": Case(oracle, info, redis_url, user("Which colours are in this one?", WIDE), max_new_tokens=1)}
    steps: list[tuple[int, bool]] = []  # per step that carried chunks: (decode rows, whether a prompt ended)
    take_chunks = prefill.take_chunks

    def recording(num_decode_rows: int):
        planned = take_chunks(num_decode_rows)
        if planned is not None:
            steps.append((num_decode_rows, bool(planned.sample_chunks)))
        return planned

    monkeypatch.setattr(prefill, "take_chunks", recording)
    threads = [threading.Thread(target=_generate, args=(prefill, decode, f"join-{name}", case,
                                                        SamplingConfig(max_tokens=64, ignore_eos=True)))
               for name, case in cases.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    ended = [i for i, (_, ends) in enumerate(steps) if ends]
    assert len(ended) == 2 and ended[0] < ended[1], steps  # the short prompt first, the image's chunks after
    # every step from the one after the short prompt's end to the image's last chunk carried its row
    assert all(rows >= 1 for rows, _ in steps[ended[0] + 1:ended[1] + 1]), steps
    assert ended[1] - ended[0] >= 2, steps  # the image had chunks left to ride
    assert decode.num_unfinished() == 0 and prefill.num_waiting() == 0


def test_an_aggregated_deployment_has_no_decode_replicas_and_one_model_setting(tiny_model_dir):
    serve = ServeConfig(tiny_model_dir)
    config = DeployConfig(serve, aggregate=True, num_decode=3)
    assert (config.replicas("prefill"), config.replicas("decode")) == (1, 0)
    assert placement.actor_class(config, "prefill") == placement.AGGREGATE_ACTOR
    assert placement.actor_class(DeployConfig(serve), "prefill") == placement.ROLE_ACTORS["prefill"]
    mixed = replace(serve, prefill=PrefillConfig(dtype="bfloat16"))
    with pytest.raises(ConfigError, match="prefill.dtype.*must equal decode.dtype"):
        DeployConfig(mixed, aggregate=True)
    with pytest.raises(ConfigError, match="decode.tensor_parallel"):
        DeployConfig(replace(serve, decode=DecodeConfig(tensor_parallel=2)), aggregate=True)
