"""The chat and tool-call layer: rendering with chat templates, parsing tool calls."""

from looprl.chat.formats import FORMATS, detect_format, format_tool_call, format_tool_calls
from looprl.chat.parsers import ParseResult, parse_tool_calls, validate_arguments
from looprl.chat.render import ChatRenderer, fallback_tool_block

__all__ = [
    "FORMATS",
    "ChatRenderer",
    "ParseResult",
    "detect_format",
    "fallback_tool_block",
    "format_tool_call",
    "format_tool_calls",
    "parse_tool_calls",
    "validate_arguments",
]
