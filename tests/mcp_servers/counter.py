"""A stateful MCP server for tests/test_mcp_env.py: a counter, plus tools that misbehave.

    python tests/mcp_servers/counter.py                # stdio
    python tests/mcp_servers/counter.py --http PORT    # streamable HTTP at /mcp
    python tests/mcp_servers/counter.py --fail-start   # writes to stderr and exits
    python tests/mcp_servers/counter.py --bad-schema   # one tool's input schema is invalid
    python tests/mcp_servers/counter.py --lookbehind   # a valid schema no grammar compiles

Every call is appended to the file named by $MCP_TEST_LOG (if set) as JSON lines
{"pid", "tool", "arguments"}, so that a test sees which process served what."""

from __future__ import annotations

import json
import os
import sys
import time

if "--fail-start" in sys.argv:
    print("counter: cannot open the inventory database (on purpose)", file=sys.stderr)
    sys.exit(3)

try:  # mcp 2 renamed FastMCP to MCPServer
    from mcp.server.mcpserver import MCPServer
except ImportError:  # mcp 1
    from mcp.server.fastmcp import FastMCP as MCPServer

server = MCPServer("counter")
state = {"count": 0}


def log(tool: str, **arguments) -> None:
    path = os.environ.get("MCP_TEST_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "tool": tool, "arguments": arguments}) + "\n")


@server.tool()
def increment(by: int = 1) -> int:
    """Add `by` to the counter; returns the new count."""
    log("increment", by=by)
    state["count"] += by
    return state["count"]


@server.tool()
def read() -> str:
    """The counter and the server's process id."""
    log("read")
    return json.dumps({"count": state["count"], "pid": os.getpid()})


@server.tool()
def reset() -> str:
    """Set the counter to 0."""
    log("reset")
    state["count"] = 0
    return "ok"


@server.tool()
def grade(answer: str, info: dict) -> float:
    """1 if the counter reached info['target'] and the answer says so, else 0.5 or 0."""
    log("grade", answer=answer, info=info)
    reached = state["count"] == info.get("target")
    return (0.5 if reached else 0.0) + (0.5 if answer.strip() == str(info.get("target")) else 0.0)


@server.tool()
def fail(reason: str) -> str:
    """Always fails (an isError result)."""
    log("fail", reason=reason)
    raise ValueError(f"refused: {reason}")


@server.tool()
def slow(seconds: float) -> str:
    """Sleeps, then answers."""
    log("slow", seconds=seconds)
    time.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """Kills the server process."""
    log("crash")
    os._exit(1)


if "--bad-schema" in sys.argv:

    @server.tool()
    def odd(x: str) -> str:
        """A tool whose advertised schema is not a JSON schema."""
        return x

    server._tool_manager.get_tool("odd").parameters = {
        "type": "object", "properties": {"x": {"type": "nonsense"}},
    }  # fmt: skip

if "--lookbehind" in sys.argv:

    @server.tool()
    def tag(x: str) -> str:
        """A tool whose schema is valid JSON schema with a pattern xgrammar cannot compile."""
        return x

    server._tool_manager.get_tool("tag").parameters = {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}},
        "required": ["x"],
    }  # fmt: skip

if __name__ == "__main__":
    if "--http" in sys.argv:
        port = int(sys.argv[sys.argv.index("--http") + 1])
        server.run("streamable-http", host="127.0.0.1", port=port)
    else:
        server.run()
