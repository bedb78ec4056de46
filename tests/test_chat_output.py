"""The answer parsers (router_svc/chat_output.py) on token streams built here: Qwen3.5's tool-call
format into OpenAI tool_calls, ``<think>`` blocks into reasoning_content, whole and streamed in
every split (one character at a time included) giving the same message."""

from __future__ import annotations

import json

import pytest

from router_svc.chat_output import AnswerParser, whole

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hourly": {"type": "boolean"}, "where": {"type": "object"},
                                     "zip": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
CALLS = ("Let me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\nFrance\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n<parameter=where>\n"
         '{"lat": 1.5}\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>\n'
         "<tool_call>\n<function=now>\n</function>\n</tool_call>")


def _streamed(text: str, parser: AnswerParser, step: int) -> dict:
    out = {"content": "", "reasoning_content": "", "tool_calls": []}
    deltas = []
    for start in range(0, len(text), step):
        deltas += parser.feed(text[start:start + step])
    for delta in deltas + parser.finish():
        for kind, value in delta.items():
            if kind == "tool_calls":
                out[kind] += value
            else:
                out[kind] += value
    return out


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_tool_calls_parse_typed_by_the_schema_whole_and_streamed(step):
    message = whole(CALLS, AnswerParser(tools=TOOLS))
    assert message["content"] == "Let me look.\n\n"
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris\nFrance", "days": 3, "hourly": True,
                                                             "where": {"lat": 1.5}, "zip": "75001"}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert [c["index"] for c in calls] == [0, 1] and all(c["id"].startswith("call_") for c in calls)
    streamed = _streamed(CALLS, AnswerParser(tools=TOOLS), step)
    assert streamed["content"] == message["content"]
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in calls]


def test_text_that_is_not_a_call_stays_content_and_no_tools_means_no_parsing():
    broken = "a <tool_call>\nnot a function\n</tool_call> b <tool_c"
    assert whole(broken, AnswerParser(tools=TOOLS)) == {"content": broken, "reasoning_content": None,
                                                        "tool_calls": []}
    assert whole(CALLS, AnswerParser())["content"] == CALLS
    unfinished = "<tool_call>\n<function=now>\n"  # cut by max_tokens: text, as it came
    assert whole(unfinished, AnswerParser(tools=TOOLS))["content"] == unfinished
    assert len(whole(CALLS, AnswerParser(tools=TOOLS, max_calls=1))["tool_calls"]) == 1


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_reasoning_is_split_at_think_end_whole_and_streamed(step):
    text = "The user wants <b>.\nSo: yes.</think>\n\nYes."
    for parser in (lambda: AnswerParser(reasoning=True, in_reasoning=True),):
        message = whole(text, parser())
        assert message["reasoning_content"] == "The user wants <b>.\nSo: yes."
        assert message["content"] == "\n\nYes."
        streamed = _streamed(text, parser(), step)
        assert (streamed["reasoning_content"], streamed["content"]) == (message["reasoning_content"],
                                                                        message["content"])
    # Thinking off: the answer is content, unless the model opens a think block itself.
    assert whole("Yes </think> no", AnswerParser(reasoning=True)) == {"content": "Yes </think> no",
                                                                      "reasoning_content": None, "tool_calls": []}
    opened = whole("<think>hmm</think>Yes", AnswerParser(reasoning=True))
    assert (opened["reasoning_content"], opened["content"]) == ("hmm", "Yes")
    assert _streamed("<think>hmm</think>Yes", AnswerParser(reasoning=True), 1)["reasoning_content"] == "hmm"
    # Never closed (max_tokens): all reasoning.
    assert whole("still thinking", AnswerParser(reasoning=True, in_reasoning=True))["reasoning_content"] == \
        "still thinking"
    # Reasoning, then a call.
    both = whole("plan</think>\n\n" + CALLS, AnswerParser(reasoning=True, in_reasoning=True, tools=TOOLS))
    assert both["reasoning_content"] == "plan" and len(both["tool_calls"]) == 2


def test_the_chat_response_carries_the_split_whole_and_streamed():
    """The HTTP front's response shapes with the parsers on: reasoning_content and content, the
    calls as tool_calls with finish_reason tool_calls; off, the text is content as it came."""
    from epd.v1 import epd_pb2
    from router_svc.http import ChatOptions, _ChatCall, _Collected

    eos = epd_pb2.Summary(finish_reason="eos")
    text = ["plan: weather", "</think>\n\n", CALLS[:40], CALLS[40:]]
    options = ChatOptions(reasoning=True, in_reasoning=True, tools=TOOLS)
    call = _ChatCall(None, epd_pb2.GenerateRequest(), options, "chatcmpl-1")
    choice = call._whole_choice(0, _Collected(text=list(text), summary=eos))
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["reasoning_content"] == "plan: weather"
    assert message["content"] == "\n\nLet me look.\n\n" and len(message["tool_calls"]) == 2
    state: dict = {}
    deltas = [call._delta_choice(0, epd_pb2.TokenChunk(text=piece, token_ids=[1]), state)["delta"] for piece in text]
    final = call._final_choice(0, eos, state)
    assert final["finish_reason"] == "tool_calls"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "plan: weather"
    assert [c["function"]["name"] for d in deltas + [final["delta"]] for c in d.get("tool_calls", [])] == \
        ["get_weather", "now"]
    plain = _ChatCall(None, epd_pb2.GenerateRequest(), ChatOptions(), "chatcmpl-2")
    whole_plain = plain._whole_choice(0, _Collected(text=list(text), summary=eos))
    assert whole_plain["message"] == {"role": "assistant", "content": "".join(text)}
    assert whole_plain["finish_reason"] == "stop"
