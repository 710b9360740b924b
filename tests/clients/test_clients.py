"""The client libraries people drive the three APIs through, unchanged, against a live server: a forced
tool call, a structured answer (alone and beside tools) and a tool round trip each. SmolLM2-135M chooses
poorly; the grammar keeps every call and answer well formed, and these tests check that each library
gets back what it parses."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

ASK = "What is the weather in Paris?"


class Weather(BaseModel):
    city: str = Field(max_length=16)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def get_weather(city: str, unit: str) -> str:
    """Weather in a city."""
    return f"18 degrees {unit} and sunny in {city}"


def test_instructor_tools_and_json_modes(live):
    idle, model = live
    import instructor
    import openai

    client = openai.OpenAI(base_url=f"{idle.url}/v1", api_key=idle.api_key, max_retries=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        answer = patched.chat.completions.create(model=model, response_model=Weather, max_retries=0,
                                                 messages=[{"role": "user", "content": ASK}], max_tokens=120,
                                                 temperature=0)
        assert isinstance(answer, Weather)
    partials = list(instructor.from_openai(client,
                                           mode=instructor.Mode.TOOLS).chat.completions.create_partial(
        model=model, response_model=Weather, max_retries=0, messages=[{"role": "user", "content": ASK}],
        max_tokens=120, temperature=0))
    # a streamed call comes whole in one delta (the server holds a call until it ends): one partial, complete
    assert partials and Weather.model_validate(partials[-1].model_dump())


def test_langchain_openai(live):
    idle, model = live
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    weather = tool(get_weather)  # @tool: a schema without additionalProperties
    llm = ChatOpenAI(base_url=f"{idle.url}/v1", api_key=idle.api_key, model=model, temperature=0,
                     max_tokens=120, max_retries=0)
    for streamed in (False, True):
        bound = llm.bind_tools([weather], tool_choice="get_weather")
        if streamed:
            message = None
            for chunk in bound.stream(ASK):
                message = chunk if message is None else message + chunk
        else:
            message = bound.invoke(ASK)
        [call] = message.tool_calls
        assert call["name"] == "get_weather" and set(call["args"]) <= {"city", "unit"}
    result = weather.invoke(call["args"] | {"unit": call["args"].get("unit", "celsius")})
    reply = llm.invoke([HumanMessage(ASK), message, ToolMessage(result, tool_call_id=call["id"])])
    assert reply.content
    for method in ("json_schema", "function_calling"):
        assert isinstance(llm.with_structured_output(Weather, method=method).invoke(ASK), Weather)


def test_langchain_ollama(live):
    idle, model = live
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama

    llm = ChatOllama(base_url=idle.url, model=model, temperature=0, num_predict=120,
                     client_kwargs={"headers": idle.headers})
    message = llm.bind_tools([tool(get_weather)]).invoke(ASK)
    assert message.content or message.tool_calls
    streamed = None
    for chunk in llm.bind_tools([tool(get_weather)]).stream(ASK):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["args"] for c in streamed.tool_calls] == [c["args"] for c in message.tool_calls]
    for call in message.tool_calls:
        assert call["name"] == "get_weather"
    assert isinstance(llm.with_structured_output(Weather, method="json_schema").invoke(ASK), Weather)


def test_langchain_anthropic(live):
    idle, model = live
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool

    llm = ChatAnthropic(base_url=idle.url, api_key=idle.api_key, model=model, temperature=0, max_tokens=120,
                        max_retries=0)
    bound = llm.bind_tools([tool(get_weather)], tool_choice="get_weather")
    message = bound.invoke(ASK)
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    streamed = None
    for chunk in bound.stream(ASK):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["args"] for c in streamed.tool_calls] == [call["args"]]
    from langchain_core.messages import HumanMessage, ToolMessage

    result = get_weather(call["args"].get("city", "Paris"), call["args"].get("unit", "celsius"))
    reply = llm.invoke([HumanMessage(ASK), message, ToolMessage(result, tool_call_id=call["id"])])
    assert reply.content
    assert isinstance(llm.with_structured_output(Weather).invoke(ASK), Weather)


def test_pydantic_ai_structured_output_and_tools(live):
    idle, model = live
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    model = OpenAIChatModel(model, provider=OpenAIProvider(base_url=f"{idle.url}/v1", api_key=idle.api_key))
    settings = ModelSettings(temperature=0, max_tokens=120)
    agent = Agent(model, output_type=Weather, model_settings=settings, retries=0)
    assert isinstance(agent.run_sync(ASK).output, Weather)
    # a function tool beside the output type as response_format (tools and a JSON answer in one grammar):
    # these small models call the tool again after each result, so the run may end at its request limit,
    # but every call must have reached the tool with valid arguments (retries=0: one bad call fails it)
    called = []

    def forecast(city: str, unit: str) -> str:
        """Weather in a city."""
        called.append((city, unit))
        return get_weather(city, unit)

    with_tool = Agent(model, output_type=NativeOutput(Weather), tools=[forecast], model_settings=settings,
                      retries=0)
    try:
        assert isinstance(with_tool.run_sync(ASK, usage_limits=UsageLimits(request_limit=3)).output, Weather)
    except UsageLimitExceeded:
        assert len(called) >= 2  # a round trip and another call


def test_openai_agents_with_a_tool_and_an_output_type(live):
    idle, model = live
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.model_settings import ModelSettings
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{idle.url}/v1", api_key=idle.api_key, max_retries=0)
    model = OpenAIChatCompletionsModel(model=model, openai_client=client)
    settings = ModelSettings(temperature=0, max_tokens=120)
    plain = Agent(name="weather", instructions="Answer with the weather.", model=model, output_type=Weather,
                  model_settings=settings)
    # tools and an output_type in one request (a 400 before); SmolLM2 calls the tool again after every
    # result, so the run stops at the first tool's answer
    agent = Agent(name="weather", instructions="Answer with the weather.", model=model, output_type=Weather,
                  tools=[function_tool(get_weather)], model_settings=settings,
                  tool_use_behavior="stop_on_first_tool")

    async def both():  # one event loop: the client's connections belong to it
        return [(await Runner.run(a, ASK, max_turns=2)).final_output for a in (plain, agent)]

    alone, output = asyncio.run(both())
    assert isinstance(alone, Weather)
    assert isinstance(output, Weather) or output.startswith("18 degrees")


def test_litellm_openai_and_ollama_chat(live):
    idle, model = live
    import litellm

    tools = [{"type": "function",
              "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}}]
    messages = [{"role": "user", "content": ASK}]
    r = litellm.completion(model=f"openai/{model}", api_base=f"{idle.url}/v1", api_key=idle.api_key,
                           messages=messages, tools=tools, tool_choice="required", temperature=0,
                           max_tokens=120)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    chunks = list(litellm.completion(model=f"openai/{model}", api_base=f"{idle.url}/v1", api_key=idle.api_key,
                                     messages=messages, tools=tools, tool_choice="required", temperature=0,
                                     max_tokens=120, stream=True))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=messages)
    assert rebuilt.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    # tools beside a structured answer: a call or the schema's JSON
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": Weather.model_json_schema()}}
    both = litellm.completion(model=f"openai/{model}", api_base=f"{idle.url}/v1", api_key=idle.api_key,
                              messages=messages, tools=tools, response_format=fmt, temperature=0,
                              max_tokens=120)
    answer = both.choices[0].message
    assert answer.tool_calls or Weather.model_validate_json(answer.content)
    # the round trip through ollama_chat/: it sends back the call's id and type and a tool_call_id
    follow = [*messages, r.choices[0].message.model_dump(),
              {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    again = litellm.completion(model=f"ollama_chat/{model}", api_base=idle.url, messages=follow, tools=tools,
                               temperature=0, max_tokens=40, extra_headers=idle.headers)
    assert again.choices[0].message.content or again.choices[0].message.tool_calls


def test_embeddings_through_litellm_langchain_and_llama_index(idle):
    """The clients RAG pipelines embed through: litellm's openai/ and ollama/ providers, langchain's
    OpenAIEmbeddings and OllamaEmbeddings, llama-index's OpenAIEmbedding and OllamaEmbedding: the same
    vectors for the same texts."""
    import litellm
    import numpy as np
    from langchain_ollama import OllamaEmbeddings
    from langchain_openai import OpenAIEmbeddings
    from llama_index.embeddings.ollama import OllamaEmbedding
    from llama_index.embeddings.openai import OpenAIEmbedding

    texts = ["a red apple", "the first snow of winter"]
    via_openai = litellm.embedding(model="openai/all-minilm", api_base=f"{idle.url}/v1", api_key=idle.api_key,
                                   input=texts)
    via_ollama = litellm.embedding(model="ollama/all-minilm", api_base=idle.url, input=texts,
                                   extra_headers=idle.headers)
    vectors = [np.array([d["embedding"] for d in r.data]) for r in (via_openai, via_ollama)]
    chain_openai = OpenAIEmbeddings(model="all-minilm", base_url=f"{idle.url}/v1", api_key=idle.api_key,
                                    check_embedding_ctx_length=False)  # no tiktoken: the texts go as text
    chain_ollama = OllamaEmbeddings(model="all-minilm", base_url=idle.url,
                                    client_kwargs={"headers": idle.headers})
    vectors += [np.array(chain_openai.embed_documents(texts)), np.array(chain_ollama.embed_documents(texts))]
    vectors.append(np.array([chain_ollama.embed_query(texts[0])]))
    index_openai = OpenAIEmbedding(model_name="all-minilm", api_base=f"{idle.url}/v1", api_key=idle.api_key)
    index_ollama = OllamaEmbedding(model_name="all-minilm", base_url=idle.url,
                                   client_kwargs={"headers": idle.headers})
    vectors += [np.array(index_openai.get_text_embedding_batch(texts)),
                np.array(index_ollama.get_text_embedding_batch(texts))]
    vectors.append(np.array([index_ollama.get_query_embedding(texts[0])]))
    for v in vectors:
        assert v.shape[1] == 384
        assert np.allclose(v, vectors[0][: len(v)], atol=1e-5)
