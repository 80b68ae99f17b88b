"""Checks of what the config chooses: the environment, the model's config, its chat
template and tool-call syntax, its weights on the device, a forced call's grammar, and
one real token from the engine.

They run in that order, each on what the one before loaded, the way `looprl run`
starts. Every failure becomes a row rather than a traceback: whatever stops a run
here (a missing folder, a template error, an engine fault) is what the user must see."""

from __future__ import annotations

import time
from typing import Any

from looprl.agents import is_agent_env
from looprl.apps.doctor.check import Check, first_line, skipped
from looprl.chat import ChatRenderer
from looprl.config import Config, ModelConfig
from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.requests import generation_request, tool_name
from looprl.envs import make_env
from looprl.errors import ConfigError, EnvError, LoopRLError, ModelError
from looprl.model.load import ALIASES, GEMMA3_INSTALL, TINY_CONFIG, load_tokenizer, resolve
from looprl.types import Message

MODEL_FIX = (
    "set model.name to a hub id, a local model folder, gguf:PATH, or an alias: "
    + ", ".join(ALIASES)
)
FORCED_FORMATS = "hermes, llama3, mistral or glm"


def check_environment(name: str, args: dict[str, Any]) -> Check:
    """The env builds and resets on its first eval task; `value` = (env, observation),
    the observation None for an agent environment (its agent writes the requests)."""
    try:
        env = make_env(name, args)
        if is_agent_env(env):
            return Check("environment", True, f"{name}: an agent environment", value=(env, None))
        observation = env.reset(env.tasks("eval", n=1, seed=0)[0])
    except EnvError as err:
        fix = "set env.name to a name `looprl envs` lists, or package.module:Class; check env.args"
        return Check("environment", False, first_line(err), fix=fix)
    except Exception as err:  # the environment's own code raised
        fix = f"`looprl envs check {name}` tests the environment without a model"
        return Check("environment", False, f"{name}: {type(err).__name__}: {first_line(err)}", fix)
    tools = ", ".join(str(tool_name(tool)) for tool in observation.tools) or "none"
    detail = f"{name}: tools {tools}; tool_choice={observation.tool_choice}"
    return Check("environment", True, detail, value=(env, observation))


def check_model_config(name: str, trust_remote_code: bool = False) -> Check:
    """`model.name` resolves and its transformers config loads (the GGUF of an alias is
    converted into the cache on first use, as a run would)."""
    if name == "tiny-random":
        size = f"{TINY_CONFIG['num_hidden_layers']} layers, hidden {TINY_CONFIG['hidden_size']}"
        return Check("model config", True, f"tiny-random: Llama-style, built in code ({size})")
    from transformers import AutoConfig

    try:
        source, kwargs = resolve(name)
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as err:  # OSError, ValueError, ModelError, a remote code's own error
        fix = f"make setup-gemma, or: {GEMMA3_INSTALL}" if name == "gemma3-270m" else MODEL_FIX
        return Check("model config", False, f"cannot load {name!r}: {first_line(err)}", fix)
    architecture = (getattr(config, "architectures", None) or [config.model_type])[0]
    layers = getattr(config, "num_hidden_layers", "?")
    hidden = getattr(config, "hidden_size", "?")
    return Check("model config", True, f"{name}: {architecture}, {layers} layers, hidden {hidden}")


def check_chat_template(model: ModelConfig) -> Check:
    """The tokenizer has a chat template; which way tools reach the prompt and which
    call syntax `model.tool_format` picks. `value` = the renderer."""
    try:
        tokenizer = load_tokenizer(model.name, model.trust_remote_code, model.chat_template)
    except Exception as err:
        return Check("chat template", False, f"tokenizer: {first_line(err)}", MODEL_FIX)
    if getattr(tokenizer, "chat_template", None) is None:
        return Check(
            "chat template",
            False,
            f"the tokenizer of {model.name} has no chat template",
            fix="use an instruct/chat model, or set model.chat_template (a template or a file)",
        )
    try:
        renderer = ChatRenderer(tokenizer, model.tool_format, model.tool_prompt, model.name)
    except LoopRLError as err:
        return Check("chat template", False, first_line(err), "set model.tool_prompt=auto")
    tools = (
        "the template renders tools"
        if renderer.native_tools
        else "tools go in a system-prompt block (the template ignores them)"
    )
    if model.tool_format == "auto":
        syntax = f"model.tool_format=auto picks the {renderer.format} call syntax"
    else:
        syntax = f"the {renderer.format} call syntax (model.tool_format)"
    detail = f"{tools}; {syntax}"
    return Check("chat template", True, detail, value=renderer)


def check_model_weights(cfg: Config) -> Check:
    """The policy loads as a run loads it (LoRA included). `value` = the policy."""
    from looprl.loop.policy import load_policy

    started = time.perf_counter()
    try:
        policy = load_policy(cfg)
    except ModelError as err:
        return Check("model weights", False, first_line(err), MODEL_FIX)
    except ConfigError as err:
        return Check("model weights", False, first_line(err), "change the config value it names")
    except (MemoryError, RuntimeError) as err:  # torch's out-of-memory is a RuntimeError
        fix = "use a smaller model or model.dtype=bfloat16, or a machine with more memory"
        return Check("model weights", False, first_line(err), fix)
    seconds = time.perf_counter() - started
    parameters = sum(p.numel() for p in policy.model.parameters()) / 1e6
    dtype = str(next(policy.model.parameters()).dtype).removeprefix("torch.")
    lora = cfg.model.lora
    training = f"LoRA r={lora.rank}" if lora.enabled else "full fine-tune"
    detail = (
        f"{parameters:.1f}M parameters, {dtype} on {policy.device}, {training}; "
        f"loaded in {seconds:.1f} s"
    )
    return Check("model weights", True, detail, value=policy)


def check_forced_call(policy: Any, observation: Any) -> Check:
    """The first eval task's prompt renders, and the grammar of its forced call compiles
    for this tokenizer. `value` = the engine request for that prompt."""
    renderer = policy.renderer
    if observation is None:  # an agent env: its requests come later, one by one
        prompt = renderer.prompt_ids([Message(role="user", content="Hello")], None)
        request = GenerationRequest(prompt, max_new_tokens=1)
        detail = "agent environment: its agent's requests say what they force"
        return Check("forced-call grammar", True, detail, value=request)
    tools, choice = observation.tools, observation.tool_choice
    try:
        prompt = renderer.prompt_ids(observation.messages, tools)
    except LoopRLError as err:
        fix = "set model.tool_prompt=fallback (tools in a system-prompt block)"
        return Check("forced-call grammar", False, f"prompt: {first_line(err)}", fix)
    started = time.perf_counter()
    try:
        request = generation_request(prompt, tools, choice, renderer.format, 1, policy.engine)
    except LoopRLError as err:
        fix = f"set model.tool_format to {FORCED_FORMATS} (the syntax the model writes)"
        return Check("forced-call grammar", False, first_line(err), fix)
    if request.constraint is None:
        detail = f"tool_choice={choice}: the environment forces no call"
        return Check("forced-call grammar", True, detail, value=request)
    seconds = time.perf_counter() - started
    detail = (
        f"a {choice} call in the {renderer.format} syntax compiles ({seconds:.1f} s); "
        f"prompt {len(prompt)} tokens"
    )
    return Check("forced-call grammar", True, detail, value=request)


def check_generate(engine: Any, request: GenerationRequest) -> Check:
    """One real token from the engine: the first thing a run's baseline eval does."""
    started = time.perf_counter()
    try:
        [completion] = engine.generate([request], SamplingParams(max_new_tokens=1, seed=0))
    except Exception as err:  # a kernel, device or shape fault inside the model
        fix = "try model.device=cpu, model.dtype=float32 or model.cascade_attention=false"
        return Check("1-token generate", False, f"{type(err).__name__}: {first_line(err)}", fix)
    milliseconds = (time.perf_counter() - started) * 1000
    text = engine.tokenizer.decode(completion.ids)
    detail = f"{text!r} in {milliseconds:.0f} ms on {engine.device}"
    return Check("1-token generate", True, detail)


def model_checks(cfg: Config, environment: Check, device_ready: bool) -> list[Check]:
    """The model's checks in order; a check whose prerequisite failed is skipped."""
    config = check_model_config(cfg.model.name, cfg.model.trust_remote_code)
    checks = [config]
    if not config.ok:
        return checks + _skip_from("chat template", "the model config did not load")
    checks.append(check_chat_template(cfg.model))
    if not checks[-1].ok:
        return checks + _skip_from("model weights", "the chat template check failed")
    if not device_ready:
        return checks + _skip_from("model weights", "the CUDA check failed")
    weights = check_model_weights(cfg)
    checks.append(weights)
    if not weights.ok:
        return checks + _skip_from("forced-call grammar", "the model did not load")
    if not environment.ok:
        return checks + _skip_from("forced-call grammar", "the environment did not load")
    checks.append(check_forced_call(weights.value, environment.value[1]))
    if not checks[-1].ok:
        return checks + _skip_from("1-token generate", "the prompt or its grammar failed")
    return checks + [check_generate(weights.value.engine, checks[-1].value)]


MODEL_CHECKS = (
    "model config",
    "chat template",
    "model weights",
    "forced-call grammar",
    "1-token generate",
)


def _skip_from(name: str, because: str) -> list[Check]:
    """`name` and every model check after it, skipped."""
    return [skipped(later, because) for later in MODEL_CHECKS[MODEL_CHECKS.index(name) :]]
