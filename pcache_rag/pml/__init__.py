"""Prompt Markup Language: parse, lay out and plan schemas and prompts.

See ``docs/pml.md`` for the semantics and :mod:`pcache_rag.pml.parser` for the
rules on special characters and whitespace.
"""

from .chat import PLAIN, ChatFormat, chat_format_for
from .errors import PMLError
from .layout import ParamSlot, PromptPlan, SchemaLayout, Unit, bos_ids, layout_schema, plan_prompt
from .parser import (
    Import,
    Module,
    Param,
    Prompt,
    Role,
    Scaffold,
    Schema,
    Text,
    Union,
    escape,
    parse,
    parse_prompt,
    parse_schema,
    unescape,
)

__all__ = [
    "PMLError", "ChatFormat", "PLAIN", "chat_format_for", "escape", "unescape", "parse", "parse_schema",
    "parse_prompt", "layout_schema", "plan_prompt", "SchemaLayout", "PromptPlan", "Unit", "ParamSlot",
    "bos_ids", "Schema", "Prompt", "Module", "Union", "Param", "Scaffold", "Role", "Text", "Import",
]
