"""Tool calling for the OpenAI server: parsers per model family (`parsers.py`, registry
`TOOL_PARSERS`) and the per-request plan (`chat.py`)."""

from xlaserve.entrypoints.openai.tools.chat import (
    AUTO_NEEDS_PARSER,
    ChoiceToolStream,
    ToolPlan,
    ToolRequestError,
    plan_tools,
    required_schema,
)
from xlaserve.entrypoints.openai.tools.parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    ToolStreamer,
    get_tool_parser,
)

__all__ = [
    "AUTO_NEEDS_PARSER",
    "TOOL_PARSERS",
    "ChoiceToolStream",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolParser",
    "ToolPlan",
    "ToolRequestError",
    "ToolStreamer",
    "get_tool_parser",
    "plan_tools",
    "required_schema",
]
