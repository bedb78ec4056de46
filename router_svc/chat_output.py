"""An answer's text split as vLLM's parsers for Qwen3.5 split it: reasoning (``--reasoning-parser
qwen3``: what comes before ``</think>``) into ``reasoning_content``, and tool calls (the
``qwen3_coder`` format that Qwen3.5's chat template asks for) into OpenAI ``tool_calls``::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each parameter's text becomes a JSON value by the type the tool's schema gives it (string as it
is; integer, number, boolean, object, array parsed; otherwise JSON if it parses, else the text),
as vLLM's ``qwen3_coder`` parser does. A block that does not parse stays content.

``AnswerParser`` is fed the text as it streams (``feed``, then ``finish``) and returns deltas;
the whole answer is the same parser fed once, so a streamed answer and a plain one split alike.
Text that may be the start of a marker is held back until the next piece says what it is.
"""

from __future__ import annotations

import json
import re
import uuid

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>\n?(.*?)</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _value(raw: str, schema: dict | None):
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return raw
    if raw.strip().lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(raw.strip())
        if kind == "number":
            number = float(raw.strip())
            return int(number) if number.is_integer() and "." not in raw and "e" not in raw.lower() else number
        if kind == "boolean":
            if raw.strip().lower() in ("true", "false"):
                return raw.strip().lower() == "true"
            return raw
        return json.loads(raw)
    except ValueError:
        return raw


def parse_call(block: str, tools: dict[str, dict]) -> dict | None:
    """One ``<tool_call>`` block's inside as ``{"name", "arguments"}`` (arguments as JSON text),
    or None when it is not a call of the format."""
    match = _FUNCTION.match(block)
    if match is None:
        return None
    name = match.group(1).strip()
    parameters = tools.get(name)
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    arguments = {key.strip(): _value(value, properties.get(key.strip()))
                 for key, value in _PARAMETER.findall(match.group(2))}
    return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


class AnswerParser:
    """Splits one answer into reasoning, content and tool calls, piece by piece."""

    def __init__(self, reasoning: bool = False, in_reasoning: bool = False, tools: list | None = None,
                 max_calls: int | None = None) -> None:
        """``reasoning``: split off what precedes ``</think>``; ``in_reasoning``: the prompt left a
        think block open (thinking on: the template ends with ``<think>``), so the answer starts
        in it. ``tools``: the request's tools (their parameter schemas type the arguments); None:
        no tool parsing. ``max_calls``: keep only the first (``parallel_tool_calls: false``)."""
        self.reasoning = reasoning
        self.mode = "reasoning" if reasoning and in_reasoning else "content"
        self.tools = None if tools is None else {
            t["function"]["name"]: t["function"].get("parameters") or {} for t in tools
            if isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)}
        self.max_calls = max_calls
        self.buffer = ""
        self.started = False  # any content has gone out (a think block only opens at the start)
        self.calls: list[dict] = []

    def feed(self, text: str) -> list[dict]:
        """Deltas for this piece: ``{"reasoning_content": s}``, ``{"content": s}`` or
        ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}``."""
        self.buffer += text
        out: list[dict] = []
        while True:
            if self.mode == "reasoning":
                at = self.buffer.find(THINK_END)
                if at < 0:
                    self._emit(out, "reasoning_content", len(self.buffer) - _held(self.buffer, THINK_END))
                    return out
                self._emit(out, "reasoning_content", at)
                self.buffer = self.buffer[len(THINK_END):]
                self.mode = "content"
            elif self.mode == "content":
                if self.reasoning and not self.started:
                    stripped = self.buffer.lstrip()
                    if stripped.startswith(THINK_START):  # the model opened a think block itself
                        self.buffer = stripped[len(THINK_START):]
                        self.mode = "reasoning"
                        continue
                    if THINK_START.startswith(stripped):  # may still become one
                        return out
                if self.tools is None:
                    self._emit(out, "content", len(self.buffer))
                    return out
                at = self.buffer.find(CALL_START)
                if at < 0:
                    self._emit(out, "content", len(self.buffer) - _held(self.buffer, CALL_START))
                    return out
                self._emit(out, "content", at)
                self.mode = "call"
            else:  # inside <tool_call>: wait for its end
                end = self.buffer.find(CALL_END)
                if end < 0:
                    return out
                block = self.buffer[len(CALL_START):end]
                call = parse_call(block, self.tools)
                if call is None:  # not the format: it stays text
                    self._emit(out, "content", end + len(CALL_END))
                elif self.max_calls is None or len(self.calls) < self.max_calls:
                    entry = {"index": len(self.calls), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                             "function": call}
                    self.calls.append(entry)
                    out.append({"tool_calls": [entry]})
                    self.buffer = self.buffer[end + len(CALL_END):]
                else:
                    self.buffer = self.buffer[end + len(CALL_END):]
                self.mode = "content"

    def finish(self) -> list[dict]:
        """What was held back, at the end of the answer (an unfinished call stays content)."""
        out: list[dict] = []
        if self.buffer:
            kind = "reasoning_content" if self.mode == "reasoning" else "content"
            self._emit(out, kind, len(self.buffer))
        return out

    def _emit(self, out: list[dict], kind: str, size: int) -> None:
        if size <= 0:
            return
        piece, self.buffer = self.buffer[:size], self.buffer[size:]
        if kind == "content":
            if self.calls and not piece.strip():
                return  # the blank between or after calls
            self.started = True
        if out and kind in out[-1]:
            out[-1][kind] += piece
        else:
            out.append({kind: piece})


def whole(text: str, parser: AnswerParser) -> dict:
    """The whole answer through ``parser``: ``{"content", "reasoning_content", "tool_calls"}``
    (content None when the answer was only calls, as OpenAI's)."""
    parts = {"content": [], "reasoning_content": []}
    for delta in parser.feed(text) + parser.finish():
        for kind in ("content", "reasoning_content"):
            if kind in delta:
                parts[kind].append(delta[kind])
    content = "".join(parts["content"])
    return {"content": None if parser.calls and not content.strip() else content,
            "reasoning_content": "".join(parts["reasoning_content"]) if parts["reasoning_content"] else None,
            "tool_calls": parser.calls}


def forced_calls_grammar(tools: list, name: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for ``tool_choice`` ``required`` (``name`` None: any of
    the tools) or a named function: the answer is one call in Qwen3.5's format (or several, one per
    line, when ``parallel``): the schema's required parameters once each, in order, then any of its
    optional ones; a value is one line of up to 100 characters without ``<`` (the parser types it
    by the schema as any other call's)."""
    rules, alternatives = [], []
    for index, tool in enumerate(tools):
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
        properties = parameters.get("properties")
        keys = [key for key in properties if isinstance(key, str)] if isinstance(properties, dict) else []
        listed = parameters.get("required") if isinstance(parameters.get("required"), list) else []
        required = [key for key in listed if key in keys]
        optional = [key for key in keys if key not in required]
        head = json.dumps(f"<tool_call>\n<function={function['name']}>\n")
        tail = json.dumps("</function>\n</tool_call>")
        body = [head]
        for key in required:  # each required parameter once, in the schema's order
            body.append(json.dumps(f"<parameter={key}>\n") + ' VALUE "\\n</parameter>\\n"')
        if optional:
            body.append(f"opt_{index}*")
            rules.append(f'opt_{index}: "<parameter=" KEY_{index} ">\\n" VALUE "\\n</parameter>\\n"')
            rules.append(f"KEY_{index}: " + " | ".join(json.dumps(key) for key in optional))
        rules.append(f"call_{index}: " + " ".join(body + [tail]))
        alternatives.append(f"call_{index}")
    if not alternatives:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")
    start = "start: call (\"\\n\" call)*" if parallel else "start: call"
    return "\n".join([start, "call: " + " | ".join(alternatives), *rules, 'VALUE: /[^<\\n]{1,100}/'])
