"""A verifiers classic MultiTurnEnv of its own (verifiers 0.1.x): its env_response answers a
whole turn with a user message, which looprl's worker cannot split into tool calls, so it
refuses it clearly. Used by tests/test_verifiers_classic.py."""

import verifiers as vf
from datasets import Dataset


class ChattyEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Are you sure?")]


def load_environment():
    rows = [{"question": "Say hi.", "answer": "hi"}, {"question": "Say bye.", "answer": "bye"}]
    return ChattyEnv(dataset=Dataset.from_list(rows), max_turns=3)
