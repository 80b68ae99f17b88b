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
