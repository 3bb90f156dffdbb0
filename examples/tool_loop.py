"""A real tool loop against `hafiza serve` with a model that can choose tools itself (tool_choice "auto"), through
the official openai and anthropic clients: the model asks for a tool, the tool runs here, its result goes back,
the model answers. Prints each step and the cache use of every turn.

    .venv/bin/python scripts/bench_models.py qwen2.5-coder-1.5b        # once: the GGUF into bench/models/
    .venv/bin/python examples/tool_loop.py --model bench/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import time

import anthropic
import openai

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.models import load_model
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread, served_name

WEATHER = {"Paris": "18 C, sunny", "Oslo": "-3 C, snow", "Cairo": "31 C, clear"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "city name, e.g. Paris"}},
          "required": ["city"]}
SYSTEM = "You are a weather assistant. Use the get_weather tool for any question about the weather."
QUESTION = "Is it colder in Oslo or in Paris right now?"


def get_weather(city: str) -> str:
    """The tool: a fixed table (the point is the protocol, not the weather)."""
    return WEATHER.get(city, "unknown city")


def openai_loop(url: str, model: str, max_turns: int) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": SCHEMA}}]
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for turn in range(max_turns):
        t0 = time.monotonic()
        r = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=200,
                                           temperature=0)
        msg, usage = r.choices[0].message, r.usage
        print(f"[openai turn {turn}] {time.monotonic() - t0:.1f} s, finish={r.choices[0].finish_reason}, "
              f"prompt={usage.prompt_tokens} cached={usage.prompt_tokens_details.cached_tokens}")
        if not msg.tool_calls:
            print(f"  answer: {msg.content}")
            return
        messages.append({"role": "assistant", "content": msg.content,
                         "tool_calls": [c.model_dump(include={"id", "type", "function"}) for c in msg.tool_calls]})
        for call in msg.tool_calls:
            result = get_weather(**json.loads(call.function.arguments))
            print(f"  tool call: {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print("  (no answer within the turn limit)")


def anthropic_loop(url: str, model: str, max_turns: int) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="unused")
    tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": SCHEMA,
              "cache_control": {"type": "ephemeral"}}]
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    for turn in range(max_turns):
        t0 = time.monotonic()
        with client.messages.stream(model=model, system=SYSTEM, messages=messages, tools=tools, max_tokens=200,
                                    extra_body={"temperature": 0}) as stream:
            msg = stream.get_final_message()
        u = msg.usage
        print(f"[anthropic turn {turn}] {time.monotonic() - t0:.1f} s, stop={msg.stop_reason}, "
              f"input={u.input_tokens} cache_read={u.cache_read_input_tokens} "
              f"cache_write={u.cache_creation_input_tokens}")
        uses = [b for b in msg.content if b.type == "tool_use"]
        if not uses:
            print(f"  answer: {''.join(b.text for b in msg.content if b.type == 'text')}")
            return
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        results = []
        for use in uses:
            result = get_weather(**use.input)
            print(f"  tool_use: {use.name}({json.dumps(use.input)}) -> {result}")
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
        messages.append({"role": "user", "content": results})
    print("  (no answer within the turn limit)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="GGUF file or Hugging Face directory of a tool-calling model")
    ap.add_argument("--max-turns", type=int, default=4)
    args = ap.parse_args()
    loaded = load_model(args.model)
    aengine = AsyncEngine(LLMEngine(loaded, EngineConfig(kv_memory="1GiB"))).start()
    name = served_name(loaded)
    thread = ServerThread(create_app(aengine, ServerSettings(model_name=name, min_cache_tokens=64))).start()
    try:
        openai_loop(thread.url, name, args.max_turns)
        anthropic_loop(thread.url, name, args.max_turns)
    finally:
        thread.stop()
        aengine.shutdown()


if __name__ == "__main__":
    main()
