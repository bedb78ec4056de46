"""vLLM's response extras through a real `epd serve` and the `openai` client: ``n`` choices (n
requests run concurrently, choice i seeded seed + i), ``stop_reason``,
``stream_options.continuous_usage_stats``, ``return_token_ids`` with the prompt's ids, a message's
``name`` and ``cache_salt`` (which separates prefix-cache entries), on both fronts where gRPC has them."""

from __future__ import annotations

from collections import defaultdict

import grpc
import openai
import pytest

from epd import client
from epd.v1 import epd_pb2_grpc
from prefill_svc.caches import prefix_block_hashes

MODEL = "epd-tiny"


@pytest.fixture(scope="module")
def stack(openai_stack):
    openai_stack.chat, openai_stack.completions = openai_stack.openai.chat.completions, openai_stack.openai.completions
    return openai_stack


def _user(text: str, **extra) -> list[dict]:
    return [{"role": "user", "content": text, **extra}]


def test_n_choices_are_the_requests_seeded_seed_plus_i(stack):
    messages = _user("Tell me something.")
    extra = {"ignore_eos": True, "return_token_ids": True}
    reply = stack.chat.create(model=MODEL, messages=messages, max_tokens=12, n=3, temperature=1.0, seed=40,
                              extra_body=extra)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    singles = [stack.chat.create(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=40 + i,
                                 extra_body=extra).choices[0] for i in range(3)]
    assert [c.token_ids for c in reply.choices] == [s.token_ids for s in singles]
    assert [c.message.content for c in reply.choices] == [s.message.content for s in singles]
    assert len({tuple(c.token_ids) for c in reply.choices}) == 3  # seeds differ, so do the answers
    assert reply.usage.completion_tokens == 36 and reply.usage.prompt_tokens == len(reply.prompt_token_ids)
    # Streamed, with continuous usage: each index's pieces make its answer; usage grows to the total.
    chunks = list(stack.chat.create(model=MODEL, messages=messages, max_tokens=12, n=3, temperature=1.0, seed=40,
                                    stream=True, stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True},
                                    extra_body=extra))
    text, finish = defaultdict(str), {}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert [text[i] for i in range(3)] == [c.message.content for c in reply.choices]
    assert finish == {0: "length", 1: "length", 2: "length"}
    used = [chunk.usage.completion_tokens for chunk in chunks]
    assert all(chunk.usage is not None for chunk in chunks) and used == sorted(used) and used[-1] == 36
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == reply.usage.total_tokens
    # Completions too; greedy choices are all greedy's answer.
    greedy = stack.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2,
                                      extra_body=extra)
    assert [c.index for c in greedy.choices] == [0, 1] and greedy.choices[0].token_ids == greedy.choices[1].token_ids
    seeded = stack.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0,
                                      seed=9, extra_body=extra)
    alone = stack.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=10,
                                     extra_body=extra)
    assert seeded.choices[1].token_ids == alone.choices[0].token_ids


def test_stop_reason_says_which_stop_ended_it(stack):
    messages = _user("Count to ten.")
    plain = stack.chat.create(model=MODEL, messages=messages, max_tokens=24,
                              extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    assert plain.finish_reason == "length" and plain.stop_reason is None
    tokens = plain.token_ids
    at = next(i for i in range(2, 20) if tokens[i] not in tokens[:i])
    by_token = stack.chat.create(model=MODEL, messages=messages, max_tokens=24,
                                 extra_body={"stop_token_ids": [tokens[at]]}).choices[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", tokens[at])
    stop = plain.message.content[len(plain.message.content) // 2:][:3]
    by_string = stack.chat.create(model=MODEL, messages=messages, max_tokens=24, stop=[stop, "\x00never"],
                                  extra_body={"ignore_eos": True}).choices[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop)
    raw = stack.completions.create(model=MODEL, prompt="Count to ten.", max_tokens=24,
                                   extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
    raw_at = next(i for i in range(2, 20) if raw[i] not in raw[:i])
    streamed = list(stack.completions.create(model=MODEL, prompt="Count to ten.", max_tokens=24, stream=True,
                                             extra_body={"stop_token_ids": [raw[raw_at]]}))
    last = [c.choices[0] for c in streamed if c.choices and c.choices[0].finish_reason][-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", raw[raw_at])
    # gRPC: the Summary's oneof.
    result = client.generate(stack.address, client.user_request("Count to ten.", [], max_tokens=24,
                                                                stop_token_ids=[tokens[at]]), timeout_s=120)
    assert result.summary.WhichOneof("stop_reason") == "stop_token_id" and result.summary.stop_token_id == tokens[at]


def test_prompt_token_ids_and_a_message_name(stack, oracle):
    """return_token_ids gives the prompt's ids (top-level on a chat, the first chunk when streamed):
    exactly transformers' template with the message's name (which Qwen3.5's template leaves out)."""
    messages = _user("Hello there", name="bob")
    expected = oracle.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                    enable_thinking=False, return_dict=False)
    reply = stack.chat.create(model=MODEL, messages=messages, max_tokens=4, extra_body={"return_token_ids": True})
    assert reply.prompt_token_ids == list(expected) and reply.usage.prompt_tokens == len(expected)
    chunks = list(stack.chat.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                    extra_body={"return_token_ids": True}))
    with_prompt = [c for c in chunks if getattr(c, "prompt_token_ids", None)]
    assert len(with_prompt) == 1 and with_prompt[0].prompt_token_ids == list(expected)
    request = client.user_request("Hello there", [], max_tokens=2)
    request.messages[0].name = "bob"
    request.return_prompt_token_ids = True
    with grpc.insecure_channel(stack.address) as channel:
        events = list(epd_pb2_grpc.RouterStub(channel).Generate(request, timeout=120))
    first = next(e.chunk for e in events if e.WhichOneof("event") == "chunk")
    assert list(first.prompt_token_ids) == list(expected) and first.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError) as refused:
        stack.chat.create(model=MODEL, messages=_user("hi", name="x" * 300), max_tokens=2)
    assert "name is 300 characters" in refused.value.body["message"]


def test_cache_salt_changes_the_prefix_cache_key(stack):
    base = [1, 2, 3] * 50
    assert prefix_block_hashes(base, [], 16, "m") == prefix_block_hashes(base, [], 16, "m", "")
    assert prefix_block_hashes(base, [], 16, "m", "a")[0] != prefix_block_hashes(base, [], 16, "m")[0]
    assert prefix_block_hashes(base, [], 16, "m", "a") == prefix_block_hashes(base, [], 16, "m", "a")
    text = " ".join(f"salted prompt word{i}" for i in range(120))  # several prefix blocks of tokens

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        reply = stack.chat.create(model=MODEL, messages=_user(text), max_tokens=2, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same salt shares the cache
    assert cached("tenant-b") == 0  # another salt does not
    assert cached(None) == 0  # nor does the unsalted cache
    # gRPC: the same field.
    request = client.user_request(text, [], max_tokens=2)
    request.cache_salt = "tenant-b"
    assert client.generate(stack.address, request, timeout_s=120).summary.cached_tokens > 0
    request.cache_salt = "tenant-c"
    assert client.generate(stack.address, request, timeout_s=120).summary.cached_tokens == 0
    request.cache_salt = "x" * 1025
    with pytest.raises(grpc.RpcError) as raised:
        client.generate(stack.address, request, timeout_s=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in raised.value.details()
