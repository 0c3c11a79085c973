"""Structured output (JSON schema, regex, choice, EBNF grammar) via xgrammar.

`manager.StructuredOutputManager` (imports xgrammar lazily) compiles grammars off the engine's
step loop and fills per-step token bitmasks; `openai_compat.structured_from_request` maps OpenAI /
vLLM request fields onto `StructuredOutputsParams`. Importing this package imports neither
xgrammar nor torch.
"""

from xlaserve.structured.openai_compat import grammar_source_bytes, structured_from_request

__all__ = ["grammar_source_bytes", "structured_from_request"]
