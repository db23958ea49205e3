"""Agents written against the OpenAI API, trained unchanged: each rollout instance can serve its
policy behind an OpenAI-compatible HTTP endpoint (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``), and an agent episode ``agent(row, base_url, api_key) -> reward`` runs any code
that talks to it. Every request made with the episode's key is generated on the instance's
rollout service (under the row's staleness bound, with in-flight weight updates) and recorded;
the episode's trajectory is rebuilt from the recorded turns (docs/agents_openai.md).

This package's import is light: the HTTP server (aiohttp, the ``serve`` extra) is imported only
when an instance starts its endpoint.
"""
from asyncflow.agents.serving.spec import EndpointSpec, endpoint_spec, is_agent

__all__ = ["EndpointSpec", "endpoint_spec", "is_agent"]
