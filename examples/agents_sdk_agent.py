"""Tic-tac-toe played by an openai-agents SDK agent, trained through looprl unchanged.

The agent is ordinary openai-agents code: an `Agent` with one `function_tool`,
`choose_square`, run by `Runner.run` for a whole game. The game itself is the built-in
`tictactoe-game` env (its prompt, its seeded opponent, its rewards): the tool plays the
move in it and returns the env's reply (the opponent's move and the new board). The
SDK's default model, `OpenAIResponsesModel`, speaks the Responses API; it gets the client
looprl passes in, so every model call is answered by the policy being trained and its
tokens recorded. Tracing is off: nothing leaves the machine.

pip install openai-agents
looprl run --set env.name=examples.agents_sdk_agent:TicTacToeSDKAgent --set model.name=tiny-random
"""

from typing import Annotated

from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    ToolsToFinalOutputResult,
    function_tool,
    set_tracing_disabled,
)
from pydantic import Field

from looprl.agents import AgentResult
from looprl.envs.builtin.tictactoe import CHOOSE_SQUARE_TOOL, TicTacToeGame
from looprl.types import Message, ToolCall

set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI


class TicTacToeSDKAgent:
    name = "tictactoe-sdk-agent"
    description = "A whole tic-tac-toe game, played by an openai-agents SDK agent."
    outcomes = ("win", "draw", "loss", "illegal")
    reward_range = (-1.0, 1.0)
    max_turns = 5  # X places at most 5 marks: every game ends within 5 model calls

    def __init__(self, opponent="mixed:0.5", agent_plays="alternate", eval_size=64):
        self.settings = (opponent, agent_plays, eval_size)

    def tasks(self, split, n=None, seed=0):
        return self._game().tasks(split, n=n, seed=seed)

    def _game(self):
        opponent, agent_plays, eval_size = self.settings
        return TicTacToeGame(opponent, agent_plays, eval_size=eval_size)

    async def run_agent(self, client, task):
        game = self._game()
        system, intro = game.reset(task).messages
        steps = []

        # failure_error_function=None: a bug in the tool raises instead of being told to
        # the model, so looprl sees it (an env_error episode, left out of the loss).
        @function_tool(
            name_override="choose_square",
            description_override=CHOOSE_SQUARE_TOOL["function"]["description"],
            failure_error_function=None,
        )
        def choose_square(square: Annotated[int, Field(ge=1, le=9)]) -> str:
            move = Message("assistant", tool_calls=[ToolCall("choose_square", {"square": square})])
            steps.append(game.step(move))
            return steps[-1].messages[0].content

        def stop_when_over(context, results):
            return ToolsToFinalOutputResult(is_final_output=steps[-1].done)

        agent = Agent(
            name="tictactoe",
            instructions=system.content,
            model=OpenAIResponsesModel(model="policy", openai_client=client),
            model_settings=ModelSettings(tool_choice="required"),
            tools=[choose_square],
            tool_use_behavior=stop_when_over,
            reset_tool_choice=False,  # every turn is a move: keep the call forced
        )
        await Runner.run(
            agent, intro.content, max_turns=self.max_turns,
            run_config=RunConfig(tracing_disabled=True),
        )  # fmt: skip
        last = steps[-1]
        return AgentResult(last.reward, last.outcome, dict(last.info))
