"""langchain-openai and langchain-anthropic over real HTTP: bind_tools with a tool_choice gives a valid call, and
with_structured_output returns a validated object, through both chat classes."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import Server

pytestmark = pytest.mark.slow


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=24, description="the city")


class Pet(BaseModel):
    """A pet (bounded fields, so the small model's reply ends inside max_tokens)."""

    name: str = Field(max_length=16)
    species: str = Field(max_length=16)
    age: int = Field(ge=0, le=30)


def chat_models(server: Server) -> list[object]:
    from langchain_anthropic import ChatAnthropic
    from langchain_openai import ChatOpenAI

    return [ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=server.model, temperature=0,
                       max_tokens=64, max_retries=0),
            ChatAnthropic(base_url=server.url, api_key="unused", model=server.model, temperature=0, max_tokens=64,
                          max_retries=0)]


@pytest.mark.parametrize("which", [0, 1], ids=["openai", "anthropic"])
def test_bind_tools_with_tool_choice(server: Server, which: int) -> None:
    model = chat_models(server)[which]
    msg = model.bind_tools([GetWeather], tool_choice="GetWeather").invoke("What is the weather in Lyon?")
    (call,) = msg.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])


@pytest.mark.parametrize("which", [0, 1], ids=["openai", "anthropic"])
def test_with_structured_output(server: Server, which: int) -> None:
    model = chat_models(server)[which]
    pet = model.with_structured_output(Pet).invoke("Invent a pet.")
    assert isinstance(pet, Pet)
