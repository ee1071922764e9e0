"""Tool calls shared by the codecs: the parsed call, its error, schema checks.

A tool is described by a JSON schema::

  {"name": "calc", "description": "Evaluates an expression.",
   "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                  "required": ["expr"]}}

:func:`check_call` turns a decoded call object (``{"name": "calc",
"arguments": {"expr": "1+2"}}``; the argument key is a parameter, Llama 3
writes ``"parameters"``) into a :class:`ToolCall` checked against the
offered tools, or raises :class:`ToolCallError` saying what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A parsed tool call: the tool's ``name`` and its ``arguments``."""

  name: str
  arguments: dict[str, Any]


class ToolCallError(ValueError):
  """A tool call that is not JSON, names no offered tool or does not match
  its schema; the message is what the policy is told."""


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
               "array": list, "object": dict, "null": type(None)}


def check_arguments(schema: Mapping[str, Any], arguments: dict[str, Any], name: str) -> None:
  """Raises ToolCallError if ``arguments`` do not match the tool's schema
  (required keys, ``additionalProperties: false``, JSON types)."""
  params = schema.get("parameters") or {}
  props = params.get("properties") or {}
  if missing := [k for k in params.get("required", ()) if k not in arguments]:
    raise ToolCallError(f"{name} is missing the argument(s) {', '.join(missing)}")
  if params.get("additionalProperties", True) is False:
    if extra := sorted(set(arguments) - set(props)):
      raise ToolCallError(f"{name} takes no argument(s) {', '.join(extra)}")
  for key, value in arguments.items():
    want = (props.get(key) or {}).get("type")
    if want is None:
      continue
    types = tuple(_JSON_TYPES[t] for t in ([want] if isinstance(want, str) else want)
                  if t in _JSON_TYPES)
    bad_bool = isinstance(value, bool) and bool not in types
    if types and (bad_bool or not isinstance(value, types)):
      raise ToolCallError(f"{name}: argument {key} must be {want}, got {value!r:.40}")


def loads_call(text: str) -> Any:
  """The JSON value of a call's text; ToolCallError if it is not one JSON
  value (two values, e.g. ``{...}; {...}``, are more than one call)."""
  text = text.strip()
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    try:
      _, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
      raise ToolCallError(f"the tool call is not JSON ({e.msg} at {e.pos})") from None
    if text[end:].lstrip(" \n;,").startswith("{"):
      raise ToolCallError("one tool call per turn") from None
    raise ToolCallError(f"the tool call is not JSON ({e.msg} at {e.pos})") from None


def check_call(call: Any, tools: Sequence[Mapping[str, Any]],
               arg_keys: Sequence[str] = ("arguments",)) -> ToolCall:
  """A decoded call object checked against ``tools``.

  Args:
    call: the JSON value the policy wrote, e.g. ``{"name": "calc",
      "arguments": {"expr": "1+2"}}``.
    tools: the offered tools' JSON schemas.
    arg_keys: keys the arguments may be under, first match wins.
  Raises:
    ToolCallError: not an object with a string ``name``, arguments that are
      not an object, an unknown tool, arguments that do not match.
  """
  if not isinstance(call, dict) or not isinstance(call.get("name"), str):
    raise ToolCallError('a tool call is a JSON object with a "name"')
  key = next((k for k in arg_keys if k in call), arg_keys[0])
  arguments = call.get(key, {})
  if isinstance(arguments, str):  # some models write the arguments as a JSON string
    try:
      arguments = json.loads(arguments)
    except json.JSONDecodeError:
      pass
  if not isinstance(arguments, dict):
    raise ToolCallError(f'the "{key}" of a tool call are a JSON object')
  by_name = {t["name"]: t for t in tools}
  if call["name"] not in by_name:
    raise ToolCallError(f"no tool {call['name']!r:.40}; tools: {', '.join(by_name)}")
  check_arguments(by_name[call["name"]], arguments, call["name"])
  return ToolCall(call["name"], arguments)
