"""The HTTP front as a drop-in for vLLM's, through a real `epd serve` (one router with an HTTP
front, no API key: the default) and the `openai` client, checked against transformers: stop strings
end the completion at the token that completed them, reproducibly; only JSON bodies are read; a
conversation the chat template refuses is the client's error on both fronts; thinking tokens in
the history are prompted as transformers renders them; the tokenizer endpoints."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from bench.synthetic import make_image
from epd import client
from epd.dataurl import encode_data_url
from epd.v1 import epd_pb2

MODEL = "epd-tiny"


@pytest.fixture(scope="module")
def stack(openai_stack):
    return openai_stack


def _post(stack, path: str, data: bytes, content_type: str | None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{stack.http}{path}", data=data, method="POST")
    if content_type is not None:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _stop_completed_at(oracle, tokens: list[int], at_least: int) -> tuple[int, str] | None:
    """The first n >= at_least where the greedy text gains whole characters, and a stop string
    whose first occurrence in the text ends exactly there (so the n-th token completes it)."""
    for n in range(at_least, len(tokens)):
        text, before = oracle.decode(tokens[:n]), oracle.decode(tokens[:n - 1])
        if len(text) <= len(before.rstrip("\ufffd")) or text.endswith("\ufffd"):
            continue
        for size in (3, 2, 4, 5, 6, 1):
            stop = text[-size:]
            if len(stop) == size and text.find(stop) == len(text) - size:
                return n, stop
    return None


def test_a_stop_string_gives_the_same_usage_token_ids_and_logprobs_every_time(stack, oracle):
    """20 runs of one greedy request, streamed and not: the completion ends with the token whose
    text completes the stop string (transformers' greedy tokens say which), every run alike."""
    for prompt in ("Tell me a story.", "Describe the weather.", "Count to ten.", "Say something."):
        tokens = oracle.generate(prompt, [], max_new_tokens=40)[0]
        found = _stop_completed_at(oracle, tokens, 8)
        if found:
            break
    assert found, "no prompt whose greedy answer completes a stop string at token 8 or later"
    n, stop = found
    text = oracle.decode(tokens[:n])
    runs = []
    for run in range(20):
        request = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=40, temperature=0,
                       stop=[stop], logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
        if run % 2:
            reply = stack.openai.chat.completions.create(**request)
            choice = reply.choices[0]
            runs.append((reply.usage.prompt_tokens, reply.usage.completion_tokens, choice.finish_reason,
                         choice.message.content, choice.model_extra["token_ids"],
                         [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in choice.logprobs.content]))
            continue
        content, token_ids, logprobs, finish, usage = "", [], [], None, None
        for chunk in stack.openai.chat.completions.create(**request, stream=True,
                                                          stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                token_ids += (choice.model_extra or {}).get("token_ids") or []
                logprobs += [(e.token, e.logprob, [t.logprob for t in e.top_logprobs])
                             for e in (choice.logprobs.content if choice.logprobs else None) or []]
                finish = choice.finish_reason or finish
        runs.append((usage.prompt_tokens, usage.completion_tokens, finish, content, token_ids, logprobs))
    prompt_tokens = runs[0][0]
    assert prompt_tokens < 64, "a cached prefix block would make the first token's logprob round differently"
    assert all(run == runs[0] for run in runs), [run[1] for run in runs]
    _, completion_tokens, finish, content, token_ids, logprobs = runs[0]
    assert token_ids == tokens[:n] and completion_tokens == n == len(logprobs)
    assert finish == "stop" and content == text[:-len(stop)]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_not_declared_json_is_refused_with_415(stack, content_type):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    status, reply = _post(stack, "/v1/chat/completions", body, content_type)
    assert status == 415 and "Content-Type: application/json" in reply["error"]["message"]
    assert _post(stack, "/v1/chat/completions", body, "application/json; charset=utf-8")[0] == 200


def test_a_conversation_the_template_refuses_is_invalid_argument_on_both_fronts(stack):
    no_user = [epd_pb2.ChatMessage(role="system", content=[epd_pb2.ContentPart(text="Be brief.")])]
    with pytest.raises(grpc.RpcError) as raised:
        client.generate(stack.address, client.chat_request(no_user, max_tokens=2), timeout_s=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat template refuses this conversation: No user query found in messages." in raised.value.details()
    image = encode_data_url(make_image(64, 64, seed=5))
    with pytest.raises(openai.BadRequestError) as refused:
        stack.openai.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": image}}]},
            {"role": "user", "content": "What?"}])
    assert refused.value.status_code == 400
    assert "System message cannot contain images." in refused.value.body["message"]
    deadline = time.monotonic() + 30  # Ray forwards the router's lines to serve's stderr
    while time.monotonic() < deadline:
        log = open(stack.log.name).read()
        if log.count("chat template refused the conversation") >= 2:
            break
        time.sleep(0.5)
    lines = [line for line in log.splitlines() if "chat template refused the conversation" in line]
    assert len(lines) == 2 and all(" INFO " in line for line in lines), lines
    assert "Traceback" not in log


def test_a_second_turn_with_thinking_in_its_history_is_prompted_as_transformers_does(stack, oracle):
    conversation = [{"role": "user", "content": "What is it?"},
                    {"role": "assistant", "content": "<think>\nIt is red and round.\n</think>\n\nAn apple."},
                    {"role": "user", "content": "And its colour?"}]
    expected, _, prompt_len = oracle.generate_chat(conversation, max_new_tokens=8)
    reply = stack.openai.chat.completions.create(model=MODEL, messages=conversation, max_tokens=8, temperature=0,
                                                 extra_body={"return_token_ids": True})
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.choices[0].model_extra["token_ids"] == expected
    status, tokenized = _post(stack, "/tokenize", json.dumps({"messages": conversation}).encode(), "application/json")
    assert (status, tokenized["count"]) == (200, prompt_len)


def test_version_tokenize_and_detokenize(stack):
    status, version = _post(stack, "/tokenize", json.dumps({"prompt": "Hello there"}).encode(), "application/json")
    assert status == 200 and version["count"] == len(version["tokens"]) > 0
    status, text = _post(stack, "/detokenize", json.dumps({"tokens": version["tokens"]}).encode(), "application/json")
    assert (status, text) == (200, {"prompt": "Hello there"})
    with urllib.request.urlopen(f"http://{stack.http}/version", timeout=10) as response:
        assert json.loads(response.read()) == {"version": "0.1.0"}
