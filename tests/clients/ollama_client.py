"""The official `ollama` Python client against `lantern serve` (run by tests/serve.rs).

    python3 tests/clients/ollama_client.py HOST MODEL

list, show, chat (whole and streamed, greedy), chat with `format` as a JSON schema (whole
and streamed), generate (templated and raw), embed (and the older embeddings) and an
unknown model's error, each through the client's own types, unchanged. Prints one JSON line of the greedy answers for the caller to
compare with the OpenAI routes; exits non-zero on the first failure.
"""

import json
import sys

import ollama

host, model = sys.argv[1], sys.argv[2]
client = ollama.Client(host=host, timeout=120)

# The model list and its details.
tags = client.list()
assert [m.model for m in tags.models] == [model], tags
assert tags.models[0].size > 0 and tags.models[0].details.family, tags
info = client.show(model)
assert info.modelinfo["general.architecture"] == tags.models[0].details.family, info
assert info.template and "completion" in info.capabilities, info
assert client.show(model + ":latest").details.family == info.details.family

greedy = {"temperature": 0, "num_predict": 12}
messages = [{"role": "user", "content": "What is the capital of France?"}]

# Chat, whole answer.
r = client.chat(model=model, messages=messages, options=greedy, stream=False)
assert r.done and r.done_reason in ("stop", "length"), r
assert r.message.role == "assistant" and r.message.content, r
assert r.eval_count > 0 and r.prompt_eval_count > 0 and r.total_duration > 0, r
chat = r.message.content

# Streamed: the pieces concatenate to the same text; only the last line is done.
parts = list(client.chat(model=model, messages=messages, options=greedy, stream=True))
assert all(not p.done for p in parts[:-1]) and parts[-1].done, parts
assert "".join(p.message.content or "" for p in parts) == chat, ("".join(p.message.content for p in parts), chat)
assert parts[-1].eval_count == r.eval_count, parts[-1]

# `format` as a JSON schema: the answer parses and fits, whole and streamed.
schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}


def fits(text):
    v = json.loads(text)
    assert set(v) == {"city", "population"}, v
    assert isinstance(v["city"], str) and len(v["city"]) <= 30, v
    assert isinstance(v["population"], int) and v["population"] >= 0, v
    return v


ask = [{"role": "user", "content": "The largest city of Japan and its population, as JSON."}]
r = client.chat(model=model, messages=ask, format=schema, options={"temperature": 0, "num_predict": 60}, stream=False)
structured = fits(r.message.content)
text = "".join(p.message.content or "" for p in client.chat(model=model, messages=ask, format=schema, options={"temperature": 0, "num_predict": 60}, stream=True))
assert fits(text) == structured, (text, structured)
# `format: "json"`: any JSON object.
r = client.chat(model=model, messages=ask, format="json", options={"temperature": 0.7, "seed": 3, "num_predict": 60}, stream=False)
assert isinstance(json.loads(r.message.content), dict), r.message.content

# Generate: through the chat template, then raw.
g = client.generate(model=model, prompt="What is the capital of France?", options=greedy, stream=False)
assert g.done and g.response == chat, (g.response, chat)
raw = client.generate(model=model, prompt="The capital of France is", raw=True, options={"temperature": 0, "num_predict": 4}, stream=False)
assert raw.response, raw
streamed = "".join(p.response for p in client.generate(model=model, prompt="The capital of France is", raw=True, options={"temperature": 0, "num_predict": 4}, stream=True))
assert streamed == raw.response, (streamed, raw.response)

# An unknown model: the client's ResponseError with the 404.
try:
    client.chat(model="no-such-model", messages=messages)
    raise AssertionError("an unknown model was accepted")
except ollama.ResponseError as e:
    assert e.status_code == 404 and "no-such-model" in e.error, e

# Embeddings: one unit vector per input, the older route's for its prompt the same.
emb = client.embed(model=model, input=["The cat sat on the mat.", "Quarterly revenue rose by 4%."])
assert len(emb.embeddings) == 2 and len(emb.embeddings[0]) > 0 and emb.prompt_eval_count > 0, emb
assert abs(sum(x * x for x in emb.embeddings[0]) - 1.0) < 1e-4
old = client.embeddings(model=model, prompt="The cat sat on the mat.")
assert max(abs(a - b) for a, b in zip(old.embedding, emb.embeddings[0])) < 1e-6

print(json.dumps({"chat": chat, "raw": raw.response, "structured": structured}))
