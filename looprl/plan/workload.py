"""The shape of a run's sequences, from its environment and the model's tokenizer (no
weights): how long prompts are, how much of them every task shares (the head cascade
attention keeps once), how long an episode may grow, and how many tokens a forced tool
call appends in one jump-forward pass.

A model whose tokenizer is not at hand (a bare config folder) is measured with SmolLM2's
tokenizer instead, and the plan says so: token counts of BPE tokenizers of similar
vocabularies differ by tens of percent, not by factors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from looprl.chat import ChatRenderer
from looprl.config import Config
from looprl.envs import make_env
from looprl.errors import ModelError
from looprl.forward.prefix import MIN_SHARED_PREFIX
from looprl.model.load import load_tokenizer

PROBE_TASKS = 8
# agent environments write their own prompts: the plan assumes this length for them
AGENT_PROMPT_TOKENS = 512


@dataclass
class Workload:
    prompt_tokens: int  # the longest initial prompt among the probed tasks
    head_tokens: int  # prompt text every task shares (system prompt, tool schemas)
    response_tokens: int  # an episode after its prompt, at most: turns × max_new_tokens
    forced_tokens: int  # tokens a forced call appends in one pass (jump-forward), 0 if none
    turns: int
    tokenizer: str  # whose tokenizer counted the tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tokenizer(cfg: Config) -> tuple[Any, str]:
    try:
        tokenizer = load_tokenizer(
            cfg.model.name, cfg.model.trust_remote_code, cfg.model.chat_template
        )
        return tokenizer, cfg.model.name
    except (ModelError, OSError, ValueError):
        return load_tokenizer("tiny-random"), "SmolLM2's (the model ships none)"


def _common_prefix(prompts: list[list[int]]) -> int:
    n = 0
    while all(len(p) > n for p in prompts) and len({p[n] for p in prompts}) == 1:
        n += 1
    return n


def _forced_tokens(obs: Any, renderer: ChatRenderer, tokenizer: Any, vocab: int) -> int:
    """The jump-forward span of a forced call on a fresh grammar: the call's opening
    (format markers, the tool's name, the first argument's key) that the engine appends
    in one forward pass."""
    from looprl.engine import ToolConstraint
    from looprl.engine.grammar import GrammarCache

    try:
        grammars = GrammarCache(tokenizer, vocab, renderer.eos_ids)
        matcher = grammars.matcher(ToolConstraint(obs.tools, obs.tool_choice, renderer.format))
    except Exception:  # a format or schema the grammar cannot force: no jump-forward
        return 0
    text = matcher.find_jump_forward_string()
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0


def probe_workload(cfg: Config, vocab: int) -> Workload:
    tokenizer, source = _tokenizer(cfg)
    env = make_env(cfg.env.name, cfg.env.args)
    turns = int(getattr(env, "max_turns", 1))
    room = cfg.rollout.max_episode_tokens
    if not callable(getattr(env, "reset", None)):
        prompt, head, forced = AGENT_PROMPT_TOKENS, 0, 0
    else:
        renderer = ChatRenderer(
            tokenizer, cfg.model.tool_format, cfg.model.tool_prompt, model_name=cfg.model.name
        )
        tasks = env.tasks("train", n=PROBE_TASKS, seed=cfg.seed)
        observations = [env.reset(task) for task in tasks]
        prompts = [renderer.prompt_ids(o.messages, o.tools) for o in observations]
        prompt = max(len(p) for p in prompts)
        distinct = {tuple(p) for p in prompts}
        head = _common_prefix(prompts) if len(distinct) > 1 else 0
        head = min(head, min(len(p) for p in prompts) - 1)
        head = head if head >= MIN_SHARED_PREFIX else 0
        first = observations[0]
        forced = 0
        if cfg.rollout.jump_forward and first.tools and first.tool_choice not in ("auto", "none"):
            forced = _forced_tokens(first, renderer, tokenizer, vocab)
    response = max(1, min(turns * cfg.rollout.max_new_tokens, room - prompt))
    forced = min(forced, cfg.rollout.max_new_tokens)
    return Workload(prompt, head, response, forced, turns, source)
