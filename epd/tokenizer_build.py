"""Deterministic construction of a small Qwen-style tokenizer and chat template.

This module owns the tokenizer that ships with the project's random-weight
checkpoints: a byte-level BPE (Qwen's pre-tokenizer regex, NFC normalizer)
trained on a small corpus embedded below, followed by Qwen's special tokens in
Qwen's order, plus the Jinja chat template saved as ``chat_template.jinja``.
Same code, same corpus -> byte-identical tokenizer files on every run.
"""

from __future__ import annotations

import functools
import json

from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

# Qwen's special tokens, in Qwen's id order (relative order is what matters).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Reasoning markers are ordinary (non-special) added tokens, as in Qwen3, so
# decode(skip_special_tokens=True) keeps them visible.
THINK_TOKENS = ("<think>", "</think>")
# Tool-call markers, ordinary added tokens too (after the reasoning markers: earlier ids unchanged).
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
DEFAULT_NUM_MERGES = 512

# Qwen3.5's rules, written for this checkpoint: a conversation needs a user turn, a system message
# comes first and holds no images, each message's content is trimmed, and an assistant turn's
# reasoning (its ``reasoning_content``, or what its content has before ``</think>``) is kept only
# for turns after the last user query: earlier turns keep their answers alone. Thinking is off
# unless ``enable_thinking`` is true. With ``tools`` (OpenAI's function list), Qwen3.5's layout: the
# tools as JSON lines in a first system turn (which also holds the system message), an assistant
# turn's ``tool_calls`` as ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>
# </tool_call>`` blocks after its content, and consecutive ``tool`` messages as one user turn of
# ``<tool_response>`` blocks.
CHAT_TEMPLATE = (
    "{%- set thinking = enable_thinking if enable_thinking is defined else false -%}\n"
    "{%- macro render(content, system) -%}\n"
    "{%- if content is string -%}\n"
    "{{- content -}}\n"
    "{%- elif content is not none -%}\n"
    "{%- for part in content -%}\n"
    "{%- if part['type'] in ('image', 'video') -%}\n"
    "{%- if system -%}\n"
    "{{- raise_exception('System message cannot contain images.') -}}\n"
    "{%- endif -%}\n"
    "{{- '<|vision_start|><|' + part['type'] + '_pad|><|vision_end|>' -}}\n"
    "{%- elif part['type'] == 'text' -%}\n"
    "{{- part['text'] -}}\n"
    "{%- else -%}\n"
    "{{- raise_exception('Unexpected item type in content.') -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- set ns = namespace(last_query=-1) -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'user' -%}\n"
    "{%- set ns.last_query = loop.index0 -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if ns.last_query < 0 -%}\n"
    "{{- raise_exception('No user query found in messages.') -}}\n"
    "{%- endif -%}\n"
    "{%- if tools -%}\n"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}\n"
    "{%- for tool in tools -%}\n"
    "{{- '\\n' + (tool | tojson) -}}\n"
    "{%- endfor -%}\n"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:"
    "\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n"
    "</parameter>\\n</function>\\n</tool_call>' -}}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "{{- '\\n\\n' + render(messages[0]['content'], true) | trim -}}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- set content = render(message['content'], message['role'] == 'system') | trim -%}\n"
    "{%- if message['role'] == 'system' and not loop.first -%}\n"
    "{{- raise_exception('System message must be at the beginning.') -}}\n"
    "{%- elif message['role'] == 'system' and tools -%}\n"
    "{%- elif message['role'] == 'tool' -%}\n"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}\n"
    "{{- '<|im_start|>user' -}}\n"
    "{%- endif -%}\n"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}\n"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- elif message['role'] == 'assistant' -%}\n"
    "{%- set reasoning = '' -%}\n"
    "{%- if message['reasoning_content'] is string -%}\n"
    "{%- set reasoning = message['reasoning_content'] -%}\n"
    "{%- elif '</think>' in content -%}\n"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}\n"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if loop.index0 > ns.last_query -%}\n"
    "{{- '<think>\\n' + reasoning | trim + '\\n</think>\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- content -}}\n"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}\n"
    "{%- for call in message['tool_calls'] -%}\n"
    "{%- set call = call['function'] if call['function'] is defined else call -%}\n"
    "{%- if not loop.first -%}\n"
    "{{- '\\n' -}}\n"
    "{%- elif content -%}\n"
    "{{- '\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- '<tool_call>\\n<function=' + call['name'] + '>\\n' -}}\n"
    "{%- if call['arguments'] is mapping -%}\n"
    "{%- for key, value in call['arguments'].items() -%}\n"
    "{{- '<parameter=' + key + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '</function>\\n</tool_call>' -}}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- else -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if thinking -%}\n"
    "{{- '<think>\\n' -}}\n"
    "{%- else -%}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endif -%}\n"
)

# A few KB of varied text: prose, dialogue, code, numbers, markup, non-ASCII.
# Changing it changes every tokenizer id downstream, so treat it as frozen.
CORPUS = r"""
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words,
and a model that can see should be able to describe what is in the picture.
Describe this image in one sentence. What color is the car? How many people are
standing near the window? The image shows a red bicycle leaning against a white
wall, with a small dog sitting beside it in the afternoon sun.
User: Can you summarize the following paragraph for me?
Assistant: Sure. The paragraph explains how the encoder turns an image into a
sequence of embeddings, the prefill stage processes the whole prompt at once, and
the decode stage generates one token at a time while reusing the cached state.
In the beginning of the nineteenth century, the city was small, quiet and poor.
Its streets were narrow; its houses were built of stone and wood. Merchants came
from the north and the south, bringing cloth, salt, iron, grain and news. By 1850
the population had grown to 42,000, and by 1900 it was more than 310,000 people.
Temperatures ranged from -12.5 to 38.7 degrees; rainfall averaged 640 mm a year.
Call 555-0142 before 9:30 am, or write to 221B Baker Street, London NW1 6XE.
Prices: $3.99, $12.50, $1,299.00 -- a 15% discount applies until 2024-12-31.
The ratio 3/4 equals 0.75, and 2^10 = 1024, 2^16 = 65536, 10^6 = 1000000.
def fibonacci(n: int) -> list[int]:
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]

class Cache:
    def __init__(self, capacity=128):
        self.capacity = capacity
        self.items = {}

    def get(self, key, default=None):
        return self.items.get(key, default)

for i in range(10):
    if i % 2 == 0:
        print(f"even: {i}")
    else:
        print("odd:", i)

import torch
x = torch.randn(4, 16, dtype=torch.float32)
y = torch.nn.functional.softmax(x @ x.T, dim=-1)
assert y.shape == (4, 4), "unexpected shape"

#include <stdio.h>
int main(void) { printf("hello, world\n"); return 0; }

SELECT name, COUNT(*) AS total FROM orders WHERE status = 'done' GROUP BY name;
{"id": 17, "name": "widget", "tags": ["red", "small"], "price": 4.25, "ok": true}
<html><body><h1>Title</h1><p>Some <b>bold</b> text and a <a href="#">link</a>.</p></body></html>
- item one
- item two
1. first step
2. second step
## Heading
**Note:** the results are preliminary and may change after further review.
She said, "I don't think it's going to rain today," but he'd already taken
his umbrella. They're sure we'll be late; you've seen the traffic, haven't you?
Numbers in words: one, two, three, four, five, six, seven, eight, nine, ten.
Days: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
Months: January, February, March, April, May, June, July, August, September,
October, November, December.
Café, naïve, résumé, Zürich, São Paulo, Kraków, Ångström, façade, jalapeño.
Γειά σου κόσμε. Привет, мир. こんにちは世界。你好，世界。안녕하세요 세계.
Emoji: 🙂 🚀 ✅ — and symbols: © ® ™ € £ ¥ ° ± × ÷ ≤ ≥ ≠ ∞ → ←.
The model answered the question correctly, and then it explained its reasoning
step by step: first it looked at the object on the left, then at the text on the
sign, and finally it compared both with the question that the user had asked.
There is a cat on the table. There are two cups of coffee and a plate of cookies.
The sky is blue and the grass is green; the mountains in the distance are covered
with snow. A train is crossing the bridge over the river near the old castle.
"""


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(num_merges: int) -> str:
    """Train the byte-level BPE once per process; returns the backend as JSON."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merges,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # One line per "document" keeps the training input order fixed.
    tok.train_from_iterator(CORPUS.strip().splitlines(), trainer)
    return tok.to_str()


def build_tokenizer(num_merges: int = DEFAULT_NUM_MERGES) -> Qwen3_5Tokenizer:
    """A fresh Qwen3.5 tokenizer: 256 byte symbols + BPE merges + Qwen special tokens."""
    model = json.loads(_trained_tokenizer_json(num_merges))["model"]
    merges = [tuple(m) for m in model["merges"]]
    # eos/pad are set only after the specials are added: passing them to the
    # constructor would register them first and break Qwen's id order.
    tokenizer = Qwen3_5Tokenizer(
        vocab=model["vocab"], merges=merges, unk_token=None, eos_token=None, pad_token=None
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS + TOOL_TOKENS])
    tokenizer.eos_token = EOS_TOKEN
    tokenizer.pad_token = PAD_TOKEN
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def special_token_ids(tokenizer=None) -> dict[str, int]:
    """Map of every special/think token to its id in ``tokenizer`` (default: a fresh build)."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    names = SPECIAL_TOKENS + THINK_TOKENS
    return dict(zip(names, tokenizer.convert_tokens_to_ids(list(names))))
