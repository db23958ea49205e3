"""Agents the agent-process tests load by path in the child (stdlib only: the child imports
what its agents import, and nothing here should add to that)."""
from __future__ import annotations

import json
import sys
import urllib.request


def torch_in_its_process(row: dict, base_url: str, api_key: str) -> float:
    """One request (an episode must have one), then 1.0 if torch is imported where it runs."""
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": row["prompt"]}]}).encode()
    request = urllib.request.Request(base_url + "/chat/completions", data=body, headers={
        "Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        json.load(reply)
    return float("torch" in sys.modules)
