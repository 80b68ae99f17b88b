"""One exception type per layer. Messages say what was wrong and what to do."""


class LoopRLError(Exception):
    """Base class of every error looprl raises on purpose."""


class ConfigError(LoopRLError):
    """An invalid config value, file or override."""


class EnvError(LoopRLError):
    """An unknown environment, bad environment arguments, or a broken environment."""


class ModelError(LoopRLError):
    """A model that cannot be found or loaded."""


class ChatError(LoopRLError):
    """A chat template or tool schema that cannot be rendered."""


class RequestError(LoopRLError):
    """A model request (chat, agent call) that cannot be served as asked; `param` names
    the culprit field, OpenAI-style (e.g. "tool_choice" or "messages[2].role")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineError(LoopRLError):
    """A rollout engine that cannot serve: not installed, not starting, or gone."""


class EndpointError(LoopRLError):
    """An OpenAI-compatible endpoint (a reference model's, a teacher's server) that could
    not be reached or refused a request."""
