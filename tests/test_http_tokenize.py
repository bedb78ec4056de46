"""vLLM's utility endpoints on the HTTP front, in-process on the tiny model's real tokenizer and
prompt builder: ``GET /version``, ``POST /tokenize`` (text as it is, or a chat as a request's prompt,
checked against transformers' own rendering) and ``POST /detokenize``, with vLLM's shapes."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from bench.synthetic import make_image
from epd.config import HttpConfig
from epd.dataurl import encode_data_url
from epd.modelinfo import ModelInfo
from router_svc.http import VERSION, HttpFront
from router_svc.prompt import PromptBuilder
from router_svc.stats import RequestStats
from tests.test_http_request import post

KEY = "tokenize-test-key-0123"


@pytest.fixture(scope="module")
def front(tiny_model_dir):
    info = ModelInfo.load(tiny_model_dir)
    builder = PromptBuilder.load(tiny_model_dir, info, 64 * 1024 * 1024)
    # What the endpoints read of the router: its prompt builder (tokenizer, template) and window.
    core = SimpleNamespace(builder=builder, max_model_len=builder.max_model_len)
    return HttpFront(core, HttpConfig(), "tiny", KEY, lambda: True, RequestStats())


def call(front, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    return post(front, path, json.dumps(body).encode(), "application/json", key=key)


def get(front, path: str) -> tuple[int, dict]:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(front.app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def test_version_is_the_installed_package_version(front):
    import importlib.metadata

    assert get(front, "/version") == (200, {"version": importlib.metadata.version("epd")}) == (200, {"version": VERSION})


def test_tokenize_text_is_the_tokenizer_and_detokenize_inverts_it(front):
    tokenizer = front.core.builder.tokenizer
    text = "Hello, world! Zürich 🙂 <|im_start|>"
    status, reply = call(front, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    expected = tokenizer(text)["input_ids"]
    assert status == 200
    assert reply == {"count": len(expected), "max_model_len": front.core.max_model_len, "tokens": expected,
                     "token_strs": tokenizer.convert_ids_to_tokens(expected)}
    assert call(front, "/tokenize", {"prompt": text})[1]["token_strs"] is None
    assert call(front, "/detokenize", {"tokens": expected}) == (200, {"prompt": text})


@pytest.mark.parametrize("generation", [True, False])
def test_tokenize_messages_is_the_chat_prompt_transformers_renders(front, generation):
    tokenizer = front.core.builder.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is it?"},
                {"role": "assistant", "content": "<think>\nHm.\n</think>\n\nA box."}, {"role": "user", "content": "Sure?"}]
    status, reply = call(front, "/tokenize", {"messages": messages, "add_generation_prompt": generation,
                                              "chat_template_kwargs": {"enable_thinking": True}})
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation,
                                             enable_thinking=True)["input_ids"]
    assert (status, reply["tokens"], reply["count"]) == (200, expected, len(expected))


def test_tokenize_messages_counts_each_image_as_the_model_sees_it(front):
    image = make_image(128, 96, seed=4)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": encode_data_url(image)}},
                                             {"type": "text", "text": "What?"}]}]
    status, reply = call(front, "/tokenize", {"messages": messages})
    pad = front.core.builder.info.image_token_id
    text_only = call(front, "/tokenize", {"messages": [{"role": "user", "content": "What?"}]})[1]
    assert status == 200 and reply["tokens"].count(pad) > 1  # the placeholder expanded to the image's tokens
    from epd.imaging import probe_image

    assert reply["tokens"].count(pad) == probe_image(image, front.core.builder.settings).num_tokens
    assert reply["count"] == text_only["count"] + reply["tokens"].count(pad) + 2  # + vision start and end


@pytest.mark.parametrize("path,body,status,message", [
    ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools: not supported"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message is not supported"),
    ("/tokenize", {"messages": [{"role": "system", "content": "x"}]}, 400, "No user query found in messages."),
    ("/tokenize", {"prompt": 3}, 400, "prompt must be a string"),
    ("/tokenize", {}, 400, "send either prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "`gpt-4o` does not exist"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "1000000000 is not a token id"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens must be a list of token ids"),
    ("/detokenize", {"tokens": [1], "extra": 1}, 400, "extra: not supported"),
])
def test_tokenizer_endpoints_refuse_what_they_cannot_do_by_name(front, path, body, status, message):
    got, reply = call(front, path, body)
    assert got == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"} and message in reply["error"]["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenizer_endpoints_need_the_key_and_a_json_body(front, path):
    body = {"prompt": "x"} if path == "/tokenize" else {"tokens": [1]}
    assert call(front, path, body, key=None)[0] == 401
    assert call(front, path, body, key="wrong-key-00")[0] == 401
    assert post(front, path, json.dumps(body).encode(), "text/plain", key=KEY)[0] == 415
