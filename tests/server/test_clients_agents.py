"""openai-agents and instructor over real HTTP. openai-agents: a required tool is called, through the
chat-completions model and through the default Responses model. instructor: JSON and TOOLS modes return a
validated object."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import Server

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agent_calls_the_required_tool(server: Server, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=24)]) -> str:
        """Current weather in a city."""
        calls.append(city)
        return "18 C and sunny"

    model = (OpenAIChatCompletionsModel(model=server.model, openai_client=client) if api == "chat_completions"
             else OpenAIResponsesModel(model=server.model, openai_client=client))
    agent = Agent(name="weather", instructions="Answer weather questions with the tool.", tools=[get_weather],
                  model=model, tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(calls) == 1 and result.final_output == "18 C and sunny"


class Pet(BaseModel):
    name: str = Field(max_length=16)
    species: str = Field(max_length=16)
    age: int = Field(ge=0, le=30)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON"])
def test_instructor_returns_a_validated_object(server: Server, mode: str) -> None:
    import instructor
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    pet = client.chat.completions.create(model=server.model, response_model=Pet, max_tokens=64, temperature=0,
                                         max_retries=2,
                                         messages=[{"role": "user", "content": "Invent a pet: name, species, age."}])
    assert isinstance(pet, Pet)
