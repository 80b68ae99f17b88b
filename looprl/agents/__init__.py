"""Bring your own agent: agents written with the official OpenAI client, trained unchanged.

- `runner.py`: `run_agents` plays a rollout of agent episodes, batching their model calls
  (`AgentResult` is what an agent's `run_agent` returns);
- `proxy.py`: `AgentSession`, the in-process OpenAI endpoint of one episode, which serves
  its calls and stitches them into one token trajectory, and the async client on it;
- `sync_proxy.py`: the same for agents written without asyncio;
- `routes.py`: one HTTP request of an agent's client → its response.

The wire format (request and response models, streaming, the Responses API) is
looprl/openai/'s, shared with `looprl serve`.
"""

from looprl.agents.runner import AgentResult, is_agent_env, run_agents

__all__ = ["AgentResult", "is_agent_env", "run_agents"]
