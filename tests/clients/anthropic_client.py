"""The official `anthropic` Python client against `lantern serve` (run by tests/serve.rs).

    python3 tests/clients/anthropic_client.py BASE_URL MODEL

messages.create (whole and streamed, greedy), a forced tool call (whole and streamed, its
input fitting the tool's schema) answered with a tool_result, stop_sequences, and an unknown
model's error, each through the client's own types, unchanged. Prints one JSON line of the
greedy answer for the caller to compare with chat completions; exits non-zero on the first
failure.
"""

import json
import sys

import anthropic

base, model = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)

messages = [{"role": "user", "content": "What is the capital of France?"}]
# This client has no sampling parameters (Anthropic's newer models take none); the server
# reads `temperature` as the Messages API always had it.
GREEDY = {"temperature": 0}

# Whole answer.
m = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, messages=messages)
assert m.type == "message" and m.role == "assistant", m
assert m.content[0].type == "text" and m.content[0].text, m
assert m.stop_reason in ("end_turn", "max_tokens"), m
assert m.usage.output_tokens > 0 and m.usage.input_tokens > 0, m.usage
text = m.content[0].text

# Streamed: the text deltas concatenate to the same text; the final message agrees.
with client.messages.stream(model=model, max_tokens=12, extra_body=GREEDY, messages=messages) as s:
    streamed = "".join(s.text_stream)
    final = s.get_final_message()
assert streamed == text, (streamed, text)
assert final.content[0].text == text and final.stop_reason == m.stop_reason, final
assert final.usage.output_tokens == m.usage.output_tokens, final.usage

# A forced tool call: its input fits the schema, whole and streamed.
tools = [
    {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    }
]
ask = [{"role": "user", "content": "What will the weather be in Oslo for the next 3 days?"}]


def fits(block):
    assert block.type == "tool_use" and block.name == "get_weather" and block.id, block
    assert set(block.input) == {"city", "days"}, block.input
    assert isinstance(block.input["city"], str) and len(block.input["city"]) <= 30, block.input
    assert isinstance(block.input["days"], int) and 1 <= block.input["days"] <= 7, block.input
    return block


choice = {"type": "tool", "name": "get_weather"}
m = client.messages.create(model=model, max_tokens=60, extra_body=GREEDY, messages=ask, tools=tools, tool_choice=choice)
assert m.stop_reason == "tool_use", m
call = fits([b for b in m.content if b.type == "tool_use"][0])
with client.messages.stream(model=model, max_tokens=60, extra_body=GREEDY, messages=ask, tools=tools, tool_choice=choice) as s:
    final = s.get_final_message()
assert final.stop_reason == "tool_use", final
assert fits([b for b in final.content if b.type == "tool_use"][0]).input == call.input, (final.content, call)

# The tool's answer goes back as a tool_result; the model answers in text.
m = client.messages.create(
    model=model,
    max_tokens=16,
    extra_body=GREEDY,
    tools=tools,
    messages=ask
    + [
        {"role": "assistant", "content": [c.model_dump() for c in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 18 C."}]},
    ],
)
assert m.content and m.stop_reason in ("end_turn", "max_tokens", "tool_use"), m

# stop_sequences: the answer ends at one and says which.
m = client.messages.create(
    model=model, max_tokens=40, extra_body=GREEDY, stop_sequences=["3"], messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
)
assert m.stop_reason == "stop_sequence" and m.stop_sequence == "3", m
assert "3" not in m.content[0].text, m

# Structured output (`output_config.format`): the text parses and fits.
schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
m = client.messages.create(
    model=model, max_tokens=60, extra_body=GREEDY, output_config={"format": {"type": "json_schema", "schema": schema}},
    messages=[{"role": "user", "content": "The largest city of Japan and its population."}],
)
v = json.loads(m.content[0].text)
assert set(v) == {"city", "population"} and isinstance(v["population"], int) and len(v["city"]) <= 30, v

# An unknown model: the client's NotFoundError.
try:
    client.messages.create(model="no-such-model", max_tokens=4, messages=messages)
    raise AssertionError("an unknown model was accepted")
except anthropic.NotFoundError as e:
    assert "no-such-model" in str(e), e

print(json.dumps({"text": text}))
