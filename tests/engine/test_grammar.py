"""Constrained decoding: whatever a random-weight model prefers, sampled output matches the grammar every time."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.grammar import GrammarSpec, ToolSpec, tool_call_grammar
from hafiza.errors import RequestError
from hafiza.models import LoadedModel
from tests.support.examples import examples

WEATHER = ToolSpec("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
})
SEARCH = ToolSpec("search", {"type": "object", "properties": {"q": {"type": "string", "maxLength": 12}},
                             "required": ["q"], "additionalProperties": False})


@pytest.fixture(scope="module")
def engine(tiny_llama: LoadedModel) -> LLMEngine:
    return LLMEngine(tiny_llama, EngineConfig(kv_memory="16MiB", kv_dtype="model"))


def _leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.just({"type": "string", "maxLength": 6}),
        st.just({"type": "integer", "minimum": -50, "maximum": 50}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(st.sampled_from(["red", "green", "blue", "x y", "ü"]), min_size=1, max_size=4, unique=True)
        .map(lambda v: {"enum": v}),
    )


def _extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    names = st.sampled_from(["a", "b", "name", "tags", "nested", "k_1"])
    obj = st.dictionaries(names, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})
    arr = children.map(lambda item: {"type": "array", "items": item, "maxItems": 3})
    any_of = st.lists(children, min_size=2, max_size=3).map(lambda alts: {"anyOf": alts})
    return st.one_of(obj, arr, any_of)


schemas = st.recursive(_leaf(), _extend, max_leaves=6).map(
    lambda s: s if s.get("type") == "object" else {
        "type": "object", "properties": {"value": s}, "required": ["value"], "additionalProperties": False})


@settings(max_examples=examples(0.25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 2**31))
def test_sampled_output_validates_against_the_schema(engine: LLMEngine, schema: dict, seed: int) -> None:
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=seed,
                            grammar=GrammarSpec("json_schema", json.dumps(schema)))
    [r] = engine.generate(["Reply in JSON:"], params)
    assert r.finish_reason == "stop", (r.finish_reason, r.text)
    jsonschema.validate(json.loads(r.text), schema)
    engine.check_integrity()


@pytest.mark.slow
def test_json_object_from_the_default_model(default_model: LoadedModel) -> None:
    """Any JSON object has unbounded strings (a random model never closes one), so this uses the real model."""
    engine = LLMEngine(default_model, EngineConfig(kv_memory="64MiB"))
    ask = "Give a JSON object with the keys name and age."
    prompt = default_model.tokenizer.apply_chat_template([{"role": "user", "content": ask}])
    [r] = engine.generate([prompt], SamplingParams(max_tokens=120, temperature=0, grammar=GrammarSpec("json_object")))
    assert r.finish_reason == "stop", r.text
    assert isinstance(json.loads(r.text), dict)


def test_json_object_prefix_is_an_object(engine: LLMEngine) -> None:
    [r] = engine.generate(["Any JSON object:"], SamplingParams(max_tokens=20, temperature=0,
                                                               grammar=GrammarSpec("json_object")))
    assert r.text.startswith("{") and r.finish_reason in ("stop", "length")


@pytest.mark.parametrize(("begin", "end", "key"), [("<tool_call>\n", "\n</tool_call>", "arguments"),
                                                   ("", "", "parameters")])
def test_forced_tool_call_is_well_formed(engine: LLMEngine, begin: str, end: str, key: str) -> None:
    spec = tool_call_grammar([WEATHER, SEARCH], begin=begin, end=end, arguments_key=key)
    for seed in range(6):
        [r] = engine.generate(["Call a tool."], SamplingParams(max_tokens=200, temperature=1.0, seed=seed,
                                                               grammar=spec))
        assert r.finish_reason == "stop", r.text
        assert r.text.startswith(begin) and r.text.endswith(end)
        call = json.loads(r.text[len(begin) : len(r.text) - len(end)])
        assert set(call) == {"name", key}
        tool = {t.name: t for t in (WEATHER, SEARCH)}[call["name"]]
        jsonschema.validate(call[key], dict(tool.parameters or {}))


def test_named_tool_is_the_only_choice(engine: LLMEngine) -> None:
    spec = tool_call_grammar([SEARCH], begin="<tool_call>\n", end="\n</tool_call>")
    [r] = engine.generate(["x"], SamplingParams(max_tokens=100, temperature=1.0, seed=7, grammar=spec))
    assert json.loads(r.text.split("\n")[1])["name"] == "search"


@pytest.mark.parametrize(("spec", "check"), [
    (GrammarSpec("ebnf", 'root ::= ("yes" | "no") "!"'), lambda t: t in ("yes!", "no!")),
    (GrammarSpec("regex", r"[0-9]{3}-[a-c]{2}"), lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-"),
])
def test_ebnf_and_regex(engine: LLMEngine, spec: GrammarSpec, check) -> None:
    for seed in range(4):
        [r] = engine.generate(["go"], SamplingParams(max_tokens=40, temperature=1.0, seed=seed, grammar=spec))
        assert r.finish_reason == "stop" and check(r.text), r.text


def test_grammar_finishes_even_with_ignore_eos(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, grammar=GrammarSpec("ebnf", 'root ::= "ok"'))
    [r] = engine.generate(["go"], params)
    assert (r.finish_reason, r.text) == ("stop", "ok")


def test_each_of_n_choices_matches(engine: LLMEngine) -> None:
    spec = tool_call_grammar([WEATHER])
    results = engine.generate(["Weather?"], SamplingParams(max_tokens=120, temperature=1.0, seed=3, n=3,
                                                           grammar=spec))
    assert [r.index for r in results] == [0, 1, 2]
    for r in results:
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text)["arguments"], dict(WEATHER.parameters or {}))
    engine.check_integrity()


def test_only_allowed_tokens_are_unmasked(engine: LLMEngine) -> None:
    state = engine.grammars.state(GrammarSpec("json_object"))
    allowed = state.allowed().nonzero().flatten().tolist()
    assert allowed and all(engine.tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)
    brace = engine.tokenizer.encode("{", add_special=False)[0]
    assert state.accept(brace) and not state.accept(engine.tokenizer.encode("]", add_special=False)[0])


def test_compiled_grammars_are_cached(engine: LLMEngine) -> None:
    spec = tool_call_grammar([WEATHER], begin="<tool_call>\n", end="\n</tool_call>")
    assert engine.grammars.compile(spec) is engine.grammars.compile(spec)


@pytest.mark.parametrize(("spec", "needle"), [
    (GrammarSpec("json_schema", "{"), "json_schema is not valid JSON"),
    (GrammarSpec("json_schema", '{"type": "frobnicate"}'), "frobnicate"),
    (GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object"),
    (GrammarSpec("ebnf", "root ::= ("), "ebnf"),
    (GrammarSpec("regex", "(ab"), "regex"),
    (GrammarSpec("json_object", "{}"), "takes no text"),
    (GrammarSpec("yaml", "a: 1"), "grammar kind must be one of"),  # type: ignore[arg-type]
])
def test_bad_grammars_are_request_errors(engine: LLMEngine, spec: GrammarSpec, needle: str) -> None:
    with pytest.raises(RequestError, match=needle):
        engine.check_request([1, 2, 3], SamplingParams(grammar=spec))


def test_tool_call_grammar_needs_a_tool() -> None:
    with pytest.raises(RequestError, match="at least one tool"):
        tool_call_grammar([])
