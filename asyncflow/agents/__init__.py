"""Agents: multi-turn, tool-using episodes.

Tools (``asyncflow.agents.tools``): functions registered by name with ``register_tool`` and
awaited with ``call_tool``; built-ins "calculator" and "python" (sandboxed). This package's
import stays light (no torch): sandboxed tool modules import it in a fresh process per call.
"""

from asyncflow.agents.sandbox import SandboxOutcome, run_in_sandbox, run_python
from asyncflow.agents.tools import (
    TOOL_STATS,
    TOOLS,
    TRUNCATION_MARKER,
    ToolError,
    ToolResult,
    ToolSpec,
    ToolStats,
    UnknownToolError,
    calculate,
    call_tool,
    get_tool,
    num_hung_threads,
    register_tool,
    tool_names,
    unregister_tool,
)

__all__ = [
    "SandboxOutcome",
    "TOOLS",
    "TOOL_STATS",
    "TRUNCATION_MARKER",
    "ToolError",
    "ToolResult",
    "ToolSpec",
    "ToolStats",
    "UnknownToolError",
    "calculate",
    "call_tool",
    "get_tool",
    "num_hung_threads",
    "register_tool",
    "run_in_sandbox",
    "run_python",
    "tool_names",
    "unregister_tool",
]
