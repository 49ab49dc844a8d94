"""The official `openai` Python client against `lantern serve` (run by tests/serve.rs).

    python3 tests/clients/openai_client.py BASE_URL MODEL

Chat, completions, streaming with usage, json_schema structured output, json_object,
n = 2, logprobs and a forced tool call with the tool's answer sent back, and the Responses API
(whole, streamed, a function tool continued through previous_response_id, json_schema,
store: false), each through the client's own types, unchanged. Exits non-zero on the first
failure.
"""

import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)

# Chat, whole answer.
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
assert r.object == "chat.completion", r
assert r.choices[0].message.role == "assistant" and r.choices[0].message.content, r
assert r.choices[0].finish_reason in ("stop", "length"), r
assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage
whole = r.choices[0].message.content

# The same, streamed with usage: the deltas concatenate to the same text.
parts, usage = [], None
for chunk in client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Say hello."}],
    max_tokens=8,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
assert "".join(parts) == whole, ("".join(parts), whole)
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage

# Completions.
c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
assert c.object == "text_completion" and c.choices[0].text, c

# json_schema: parses and fits.
schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}
r = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "A person as JSON."}],
    max_tokens=80,
    temperature=0.7,
    seed=1,
    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
)
person = json.loads(r.choices[0].message.content)
assert set(person) == {"name", "age", "colors"}, person
assert isinstance(person["name"], str) and len(person["name"]) <= 20, person
assert isinstance(person["age"], int) and 0 <= person["age"] <= 120, person
assert all(c in ("red", "green", "blue") for c in person["colors"]) and len(person["colors"]) <= 3, person

# json_object.
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "A cat as JSON."}], max_tokens=60, temperature=0, response_format={"type": "json_object"}
)
assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content

# n = 2: two choices, indexed; the prompt counted once.
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, temperature=1.0, seed=3, n=2)
assert [c.index for c in r.choices] == [0, 1], r.choices
assert all(c.message.content for c in r.choices), r.choices
assert r.usage.completion_tokens >= 2 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage

# logprobs with top_logprobs (greedy: the chosen token is the best alternative), whole and
# streamed; completions' legacy logprobs.
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Count to three."}], max_tokens=6, temperature=0, logprobs=True, top_logprobs=5
)
content = r.choices[0].logprobs.content
assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
for t in content:
    assert t.logprob <= 0 and len(t.top_logprobs) == 5, t
    assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6, t
    assert all(a.logprob >= b.logprob for a, b in zip(t.top_logprobs, t.top_logprobs[1:])), t
assert "".join(t.token for t in content) == r.choices[0].message.content, (content, r.choices[0].message.content)
streamed = []
for chunk in client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Count to three."}], max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True
):
    for c in chunk.choices:
        if c.logprobs and c.logprobs.content:
            streamed.extend(c.logprobs.content)
assert [t.token for t in streamed] == [t.token for t in content], (streamed, content)
assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))
c = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3)
lp = c.choices[0].logprobs
assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4, lp
assert all(len(t) == 3 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs), lp

# Penalties and logit_bias go through the client's own types (tests/serve.rs checks their
# effect token by token against `lantern run`).
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0,
    presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"0": -100},
)
assert r.choices[0].message.content, r

# A forced tool call: tool_calls whose arguments fit the parameters; then the tool's answer
# goes back in the conversation.
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
r = client.chat.completions.create(
    model=model, messages=ask, max_tokens=60, temperature=0, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}
)
assert r.choices[0].finish_reason == "tool_calls", r
call = r.choices[0].message.tool_calls[0]
assert call.type == "function" and call.function.name == "get_weather", call
args = json.loads(call.function.arguments)
assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit"), args
# The same call streamed: the SDK's deltas put it together (name first, then the arguments
# in fragments); it is the same call.
name, streamed_args, fragments, finish = None, "", 0, None
for chunk in client.chat.completions.create(
    model=model, messages=ask, max_tokens=60, temperature=0, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True
):
    for c in chunk.choices:
        for d in c.delta.tool_calls or []:
            assert d.index == 0, d
            name = name or d.function.name
            streamed_args += d.function.arguments or ""
            fragments += 1
        finish = c.finish_reason or finish
assert name == "get_weather" and finish == "tool_calls" and fragments > 2, (name, finish, fragments)
assert json.loads(streamed_args) == args, (streamed_args, args)
follow = ask + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": args["unit"]})},
]
r = client.chat.completions.create(model=model, messages=follow, max_tokens=20, temperature=0, tools=tools, tool_choice="none")
assert r.choices[0].message.content and not r.choices[0].message.tool_calls, r

# Errors arrive as the client's typed exceptions.
try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.code == "model_not_found", e

# The Responses API: the same greedy answer as chat completions, whole and streamed (raw
# events, and the SDK's stream helper that checks item identities).
r = client.responses.create(model=model, input="Say hello.", max_output_tokens=8, temperature=0)
assert r.object == "response" and r.status in ("completed", "incomplete"), r
assert r.output_text == whole, (r.output_text, whole)
assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage
events = list(client.responses.create(model=model, input="Say hello.", max_output_tokens=8, temperature=0, stream=True))
assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete"), [e.type for e in events]
assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole
assert [e.sequence_number for e in events] == list(range(len(events)))
assert events[-1].response.output_text == whole, events[-1].response
# (The helper wants `response.completed`: an answer that ends before max_output_tokens.)
done = client.responses.create(model=model, input="Say hello.", max_output_tokens=80, temperature=0)
assert done.status == "completed" and done.incomplete_details is None, done
with client.responses.stream(model=model, input="Say hello.", max_output_tokens=80, temperature=0) as s:
    for _ in s:
        pass
    assert s.get_final_response().output_text == done.output_text

# A function tool (flat, Responses-style), forced: a function_call item whose arguments fit;
# streamed, the argument deltas make the same arguments; then the call's output continues the
# conversation through previous_response_id.
rtools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"], "parameters": t["function"]["parameters"]} for t in tools]
q = ask[0]["content"]
r = client.responses.create(model=model, input=q, max_output_tokens=60, temperature=0, tools=rtools, tool_choice={"type": "function", "name": "get_weather"})
calls = [o for o in r.output if o.type == "function_call"]
assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id, r.output
assert json.loads(calls[0].arguments) == args, (calls[0].arguments, args)
events = list(client.responses.create(model=model, input=q, max_output_tokens=60, temperature=0, tools=rtools, tool_choice={"type": "function", "name": "get_weather"}, stream=True))
assert json.loads("".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")) == args
r2 = client.responses.create(
    model=model, previous_response_id=r.id, max_output_tokens=20, temperature=0, tools=rtools, tool_choice="none",
    input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"temperature": 18, "unit": args["unit"]})}],
)
assert r2.output_text and r2.previous_response_id == r.id, r2

# text.format json_schema: the output parses and fits.
r = client.responses.create(model=model, input="A person as JSON.", max_output_tokens=80, temperature=0,
                            text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
p = json.loads(r.output_text)
assert set(p) == {"name", "age", "colors"} and isinstance(p["age"], int), p

# store: false leaves nothing to continue.
r = client.responses.create(model=model, input="Hi", max_output_tokens=2, temperature=0, store=False)
try:
    client.responses.create(model=model, input="Again", max_output_tokens=2, previous_response_id=r.id)
    raise AssertionError("a response created with store: false was continued")
except openai.NotFoundError as e:
    assert e.code == "previous_response_not_found", e

# Embeddings: the client asks for base64 unless told otherwise; both give the same unit
# vectors, one per input, in order; similar texts are closer than unrelated ones.
texts = ["The cat sat on the mat.", "A cat was sitting on the mat.", "Quarterly revenue rose by 4%."]
e = client.embeddings.create(model=model, input=texts)
vecs = [d.embedding for d in sorted(e.data, key=lambda d: d.index)]
assert len(vecs) == 3 and len({len(v) for v in vecs}) == 1 and len(vecs[0]) > 0, e
assert e.usage.prompt_tokens > 0 and e.usage.total_tokens == e.usage.prompt_tokens, e.usage
for v in vecs:
    assert abs(sum(x * x for x in v) - 1.0) < 1e-4, sum(x * x for x in v)
f = client.embeddings.create(model=model, input=texts[0], encoding_format="float")
assert max(abs(a - b) for a, b in zip(f.data[0].embedding, vecs[0])) < 1e-6
dot = lambda a, b: sum(x * y for x, y in zip(a, b))
assert dot(vecs[0], vecs[1]) > dot(vecs[0], vecs[2]), (dot(vecs[0], vecs[1]), dot(vecs[0], vecs[2]))
try:
    client.embeddings.create(model=model, input="x", dimensions=3)
    raise AssertionError("dimensions=3 was accepted")
except openai.BadRequestError as err:
    assert err.param == "dimensions", err

print(f"openai {openai.__version__}: chat, stream with usage, completions, json_schema, json_object, n=2, logprobs, a tool call (whole and streamed), errors, responses (whole, streamed, tools, previous_response_id, json_schema, store), embeddings (base64 and float): ok")
