#!/usr/bin/env python3
"""Drives a running `kiln serve` with the official `openai` client (pinned in
scripts/requirements-server.txt). Run by scripts/openai_client_check.sh, which starts the server
with `--api-key`, `--max-running 1 --max-queue 0` so that a two-prompt request is refused.

usage: openai_client_check.py BASE_URL MODEL API_KEY
"""
import json
import sys

import openai
from openai import OpenAI


def main() -> None:
    base, model, key = sys.argv[1:4]
    client = OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
    checks = 0

    # Chat, whole and streamed: the same greedy text.
    messages = [
        {"role": "system", "content": "You are a helpful assistant who answers in one sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0
    )
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert text, whole
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
    parts, usage = [], None
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
    assert "".join(parts) == text, ("".join(parts), text)
    # The same system prompt again: its blocks come from the prefix cache.
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0, usage
    checks += 2

    # Completions, whole and streamed; a stop string.
    prompt = "The capital of France is"
    c = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    full = c.choices[0].text
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        if ch.choices
    )
    assert streamed == full, (streamed, full)
    stop = full.strip().split()[1] if len(full.strip().split()) > 1 else None
    if stop:
        s = client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop]
        )
        assert stop not in s.choices[0].text and s.choices[0].finish_reason == "stop", s
    checks += 3

    # n = 3 and seeds.
    def three(seed: int) -> list:
        r = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3, seed=seed
        )
        assert [ch.index for ch in r.choices] == [0, 1, 2], r
        return [ch.text for ch in r.choices]

    a = three(7)
    assert a == three(7), "the same seed gives the same choices"
    assert a != three(8), "another seed gives other choices"
    checks += 1

    # Errors arrive as the client's exception types.
    def raises(exc, fn):
        try:
            fn()
        except exc:
            return
        raise AssertionError(f"{exc.__name__} expected")

    raises(
        openai.BadRequestError,
        lambda: client.completions.create(model=model, prompt="x", temperature=9),
    )
    raises(
        openai.BadRequestError,
        lambda: client.completions.create(model=model, prompt="x " * 100000, max_tokens=1),
    )
    raises(
        openai.NotFoundError,
        lambda: client.completions.create(model="no-such-model", prompt="x"),
    )
    raises(
        openai.AuthenticationError,
        lambda: OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list(),
    )
    raises(
        openai.RateLimitError,
        lambda: client.completions.create(model=model, prompt=["a", "b"], max_tokens=1),
    )
    try:
        client.completions.create(model=model, prompt="x" * (5 << 20), max_tokens=1)
        raise AssertionError("413 expected")
    except openai.APIStatusError as e:
        assert e.status_code == 413, e
    raises(
        openai.BadRequestError,
        lambda: client.completions.create(model=model, prompt="x", n=-1),
    )
    raises(
        openai.BadRequestError,
        lambda: client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
        ),
    )
    try:
        client.get("/completions", cast_to=object)
        raise AssertionError("405 expected")
    except openai.APIStatusError as e:
        assert e.status_code == 405, e
    assert [m.id for m in client.models.list().data] == [model]
    checks += 10

    # Log-probabilities and structured output, as the client reads them.
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content), r
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content), r
    c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset), lp
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
    )
    person = json.loads(r.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), person
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object describing a cat."}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict), r
    else:
        assert r.choices[0].message.content.lstrip().startswith("{"), r
    checks += 4
    print(f"openai client: {checks} checks passed")


if __name__ == "__main__":
    main()
