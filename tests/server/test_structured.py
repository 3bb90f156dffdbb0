"""OpenAI response_format over real HTTP: every reply parses and validates against its schema (nested objects,
enums, arrays, anyOf, nullable fields), greedy and sampled; json_object gives an object. Bounded strings, arrays
and integers keep the 135M model's replies inside max_tokens (an unbounded string may run on to the limit:
still valid so far, but not finished)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from tests.server.conftest import Server

pytestmark = pytest.mark.slow

S = {"type": "string", "maxLength": 16}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": S, "address": {
            "type": "object", "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": -5, "maximum": 5}, {"type": "boolean"},
        {"type": "object", "properties": {"note": S}, "required": ["note"], "additionalProperties": False}]}},
        "required": ["value"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"title": S, "score": {"type": ["number", "null"],
                                                                         "minimum": 0, "maximum": 1}},
                 "required": ["title", "score"], "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {
            "type": "boolean"}}, "required": ["id", "ok"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "const_and_refs": {"type": "object", "$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"kind": {"const": "segment"}, "a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["kind", "a", "b"], "additionalProperties": False},
}


CASES = [(0.0, 0), (1.0, 11)]  # greedy, and sampled with a seed


def ask(http: httpx.Client, server: Server, response_format: dict, temperature: float, seed: int) -> dict:
    r = http.post("/v1/chat/completions", json={
        "model": server.model, "max_tokens": 96, "temperature": temperature, "seed": seed,
        "messages": [{"role": "user", "content": "Reply with the JSON for a small example."}],
        "response_format": response_format})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.fixture(scope="module")
def replies(http: httpx.Client, server: Server) -> dict[tuple[str, float, int], dict]:
    """Every schema's greedy and sampled reply, and the json_object reply, requested at once: the engine batches
    them (its output does not depend on the batch; a seeded request has its own generator), so the module pays
    for one batched decode instead of seventeen in a row."""
    asks = {(name, t, seed): schema_format(name) for name in SCHEMAS for t, seed in CASES}
    asks[("json_object", 1.0, 3)] = {"type": "json_object"}
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = {key: pool.submit(ask, http, server, fmt, key[1], key[2]) for key, fmt in asks.items()}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("temperature, seed", CASES)
def test_replies_validate_against_the_schema(replies: dict, name: str, temperature: float, seed: int) -> None:
    choice = replies[(name, temperature, seed)]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])


def test_json_object(replies: dict) -> None:
    choice = replies[("json_object", 1.0, 3)]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "json_schema"}, "response_format.json_schema: field required"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}}, "json_schema"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_bad_formats_are_refused(http: httpx.Client, server: Server, fmt: dict, needle: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 4, "response_format": fmt,
                                                "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
