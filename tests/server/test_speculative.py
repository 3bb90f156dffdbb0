"""Speculative decoding through the server with the official clients: at temperature 0 a speculating server gives
the same text and usage as a plain one, streamed or not, on chat, completions, messages and responses;
`"speculative": false` drafts nothing; /metrics counts
drafts; a rendered request refuses the opt-out it cannot carry; a draft model's server answers as a plain one."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.engine.speculative import SpeculativeConfig
from hafiza.models import LoadedModel
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread, served_name
from tests.server.conftest import Server

CODE = "def area(r):\n    return 3.14159 * r * r\n\n\ndef volume(r, h):\n    return area(r) * h\n"
ECHO = [{"role": "user", "content": f"Repeat this code exactly:\n```python\n{CODE}```"}]


@pytest.fixture(scope="module")
def spec_server(default_model: LoadedModel) -> Iterator[Server]:
    """The shared server's engine settings (fp32 KV) plus prompt-lookup speculation."""
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    aengine = AsyncEngine(LLMEngine(default_model, EngineConfig(kv_memory="256MiB", kv_dtype="model",
                                                                 speculative=spec))).start()
    name = served_name(default_model)
    thread = ServerThread(create_app(aengine, ServerSettings(model_name=name))).start()
    yield Server(thread.url, name, aengine)
    thread.stop()
    aengine.shutdown()


def clients(*servers: Server):
    import openai

    return [openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=300) for s in servers]


def accepted(server: Server) -> tuple[int, int]:
    spec = server.engine_stats().spec
    assert spec is not None
    return spec.num_drafts, spec.num_accepted_tokens


def test_chat_same_text_streamed_or_not(server: Server, spec_server: Server) -> None:
    plain, spec = clients(server, spec_server)
    before = accepted(spec_server)
    bodies = [c.chat.completions.create(model=server.model, messages=ECHO, max_tokens=40, temperature=0)
              for c in (plain, spec)]
    assert bodies[0].choices[0].message.content == bodies[1].choices[0].message.content
    assert bodies[0].usage.completion_tokens == bodies[1].usage.completion_tokens
    assert bodies[0].choices[0].finish_reason == bodies[1].choices[0].finish_reason
    streamed = []
    for c in (plain, spec):
        chunks = c.chat.completions.create(model=server.model, messages=ECHO, max_tokens=40, temperature=0,
                                           stream=True)
        streamed.append("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
    assert streamed[0] == streamed[1] == bodies[0].choices[0].message.content
    after = accepted(spec_server)
    assert after[1] > before[1]  # drafts were accepted, so the identical text came partly from verified rows


def test_legacy_completions_same_text(server: Server, spec_server: Server) -> None:
    prompt = "one two three four five, one two three four five, one two three"
    texts = []
    for c in clients(server, spec_server):
        texts.append(c.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0,
                                          logprobs=2).choices[0])
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model=server.model, prompt=prompt, max_tokens=24, temperature=0, stream=True))
        assert streamed == texts[-1].text
    assert texts[0].text == texts[1].text
    assert texts[0].logprobs.token_logprobs == texts[1].logprobs.token_logprobs


def test_opt_out_drafts_nothing(server: Server, spec_server: Server) -> None:
    plain, spec = clients(server, spec_server)
    want = plain.chat.completions.create(model=server.model, messages=ECHO, max_tokens=24, temperature=0)
    before = accepted(spec_server)
    got = spec.chat.completions.create(model=server.model, messages=ECHO, max_tokens=24, temperature=0,
                                       extra_body={"speculative": False})
    assert got.choices[0].message.content == want.choices[0].message.content
    assert accepted(spec_server) == before


def test_anthropic_opt_out_and_same_text(server: Server, spec_server: Server) -> None:
    import anthropic

    texts = []
    for s, opt_out in ((server, False), (spec_server, False), (spec_server, True)):
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=300)
        before = accepted(spec_server)
        extra = {"temperature": 0, **({"speculative": False} if opt_out else {})}
        with client.messages.stream(model=s.model, max_tokens=32, messages=ECHO, extra_body=extra) as stream:
            texts.append("".join(stream.text_stream))
        if opt_out:
            assert accepted(spec_server) == before
    assert texts[0] == texts[1] == texts[2]


def test_responses_same_text_and_opt_out(server: Server, spec_server: Server) -> None:
    plain, spec = clients(server, spec_server)
    want = plain.responses.create(model=server.model, input=ECHO, max_output_tokens=32, temperature=0)
    got = spec.responses.create(model=server.model, input=ECHO, max_output_tokens=32, temperature=0)
    assert got.output_text == want.output_text and got.usage.output_tokens == want.usage.output_tokens
    before = accepted(spec_server)
    out = spec.responses.create(model=server.model, input=ECHO, max_output_tokens=32, temperature=0,
                                extra_body={"speculative": False})
    assert out.output_text == want.output_text
    assert accepted(spec_server) == before


def test_metrics_count_drafts(spec_server: Server) -> None:
    clients(spec_server)[0].chat.completions.create(model=spec_server.model, messages=ECHO, max_tokens=24,
                                                    temperature=0)
    text = httpx.get(f"{spec_server.url}/metrics").text
    drafts, accepted_tokens = accepted(spec_server)
    assert f'hafiza:spec_decode_num_drafts_total{{model_name="{spec_server.model}"}} {float(drafts)}' in text
    assert f'hafiza:spec_decode_num_accepted_tokens_total{{model_name="{spec_server.model}"}} ' \
           f'{float(accepted_tokens)}' in text
    assert "hafiza:spec_decode_num_draft_tokens_total" in text
    assert f'hafiza:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{spec_server.model}",position="0"}}' \
           in text


def test_plain_server_exports_no_spec_metrics(server: Server) -> None:
    assert "spec_decode" not in httpx.get(f"{server.url}/metrics").text


def test_render_refuses_the_opt_out(spec_server: Server) -> None:
    r = httpx.post(f"{spec_server.url}/v1/completions/render", json={
        "model": spec_server.model, "prompt": "hello", "max_tokens": 4, "speculative": False})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "speculative"


@pytest.fixture(scope="module")
def draft_server(default_model: LoadedModel, tiny_llama: LoadedModel) -> Iterator[Server]:
    """The shared server's engine settings drafted by a random-weight model of the same tokenizer."""
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=3, speculative_model="tiny")
    aengine = AsyncEngine(LLMEngine(default_model, EngineConfig(kv_memory="256MiB", kv_dtype="model",
                                                                 speculative=spec, draft_model=tiny_llama))).start()
    name = served_name(default_model)
    thread = ServerThread(create_app(aengine, ServerSettings(model_name=name))).start()
    yield Server(thread.url, name, aengine)
    thread.stop()
    aengine.shutdown()


def test_draft_model_same_text_streamed_or_not(server: Server, draft_server: Server) -> None:
    """A draft that is mostly wrong still leaves the text as plain decoding's, streamed and not."""
    plain, drafted = clients(server, draft_server)
    before = draft_server.engine_stats().spec
    assert before is not None
    texts = []
    for c in (plain, drafted):
        body = c.chat.completions.create(model=server.model, messages=ECHO, max_tokens=32, temperature=0)
        chunks = c.chat.completions.create(model=server.model, messages=ECHO, max_tokens=32, temperature=0,
                                           stream=True)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert streamed == body.choices[0].message.content
        texts.append((body.choices[0].message.content, body.usage.completion_tokens))
    assert texts[0] == texts[1]
    after = draft_server.engine_stats().spec
    assert after is not None and after.num_draft_tokens > before.num_draft_tokens
