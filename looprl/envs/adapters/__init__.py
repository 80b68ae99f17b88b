"""The ecosystem adapters: reasoning-gym (`reasoning_gym_env.py`), verifiers
(`verifiers_env.py`, whose worker `verifiers_worker/` runs in verifiers' own Python and
imports nothing from looprl) and an MCP server's tools (`mcp_env.py` with `mcp_client.py`
and its tasks `mcp_tasks.py`)."""
