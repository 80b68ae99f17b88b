"""A synchronous `openai.OpenAI` for agents written without asyncio.

An agent env whose `run_agent` is a plain `def` is run in a thread of its own (see
looprl/agents/runner.py) and gets an `openai.OpenAI` whose transport hands each request
to the rollout's event loop, where the episode's `AgentSession` answers it exactly as it
answers the async client. The thread blocks until the reply is ready; meanwhile it counts
as waiting for the model, so the engine batching sees it like a waiting async agent. All
rendering, stitching and generation stay on the loop's thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from looprl.agents.proxy import PROXY_URL, AgentSession
from looprl.agents.routes import answer, httpx


class SyncProxyTransport(httpx.BaseTransport):
    """httpx transport answering an agent thread's requests on the rollout's event loop."""

    def __init__(self, session: AgentSession, loop: asyncio.AbstractEventLoop) -> None:
        self.session, self.loop = session, loop

    def handle_request(self, request: Any) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # it would wait for the loop it blocks: a deadlock
            raise RuntimeError(
                "looprl's sync OpenAI client was called from the rollout's event loop; an "
                "async def run_agent gets an openai.AsyncOpenAI: await its calls instead"
            )
        body = request.read()
        reply = answer(self.session, request.method, request.url.path, body)
        return asyncio.run_coroutine_threadsafe(reply, self.loop).result()


def sync_openai_client(session: AgentSession, loop: asyncio.AbstractEventLoop) -> Any:
    """An `openai.OpenAI` whose requests are answered by `session` on `loop`."""
    import openai

    http = httpx.Client(transport=SyncProxyTransport(session, loop), base_url=PROXY_URL)
    # No retries: a refused call (limits, bad request) is an answer, not a network fault.
    return openai.OpenAI(
        base_url=PROXY_URL, api_key="looprl", http_client=http, max_retries=0, timeout=None
    )
