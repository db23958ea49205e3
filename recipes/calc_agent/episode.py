"""The calculator task written as an agent against the OpenAI API: the official ``openai``
client, a function-calling ``calculator`` tool, the conversation sent whole each turn. The
instance's endpoint writes the model's call ``<347+58+906>`` as a ``tool_calls`` entry and the
tool's answer back as ``1311#`` (the plain chat format), so the model sees the calc_tool
episode's text token for token. Scored 1 when the final answer is the sum."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, cast

from asyncflow.agents.tools import call_tool

if TYPE_CHECKING:
    import openai
    from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

CALCULATOR: ChatCompletionFunctionToolParam = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


_CLIENTS: dict[str, openai.AsyncOpenAI] = {}  # one client per endpoint: its connection pool, shared by the episodes


async def calc_agent(row: dict, base_url: str, api_key: str) -> float:
    import openai  # here, not at the top: the driver loads this module to check the recipe, and needs no client
    if base_url not in _CLIENTS:  # a client costs an HTTP pool and an SSL context: made once, not per episode
        _CLIENTS[base_url] = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60)
    client = _CLIENTS[base_url].with_options(api_key=api_key)  # this episode's key, the pool shared
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": row["prompt"]}]
    while True:
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages,
                                                         tools=[CALCULATOR])
        except openai.BadRequestError as e:  # the episode's turn or token budget is spent
            if e.code in ("episode_request_limit", "episode_token_limit"):
                return 0.0
            raise
        message = reply.choices[0].message
        if not message.tool_calls:
            return float((message.content or "").strip() == str(row["answer"]))
        # the assistant's message as sent back: its own fields (role, content, tool_calls)
        messages.append(cast("ChatCompletionMessageParam", message.model_dump(exclude_none=True)))
        for call in message.tool_calls:
            if call.type != "function":  # the endpoint writes the model's calls as function calls only
                raise ValueError(f"calc_agent: a {call.type!r} tool call; the episode defines one function tool")
            expression = json.loads(call.function.arguments).get("expression", "")
            result = await call_tool("calculator", expression)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.text})
