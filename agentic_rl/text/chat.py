"""A checkpoint's chat template as the conversation codec of multi-turn rollouts.

:func:`render` renders a Hugging Face chat template the way transformers'
``apply_chat_template`` does (a sandboxed jinja2 environment with
``trim_blocks``, ``lstrip_blocks``, loop controls, ``tojson``,
``raise_exception``, ``strftime_now``, ``namespace``; the tokenizer's
``bos_token``, ``eos_token``, ... as variables), and the rendered string is
tokenised with no special tokens added, so
``ChatCodec.encode_prompt(messages)`` equals
``tokenizer.apply_chat_template(conversation, add_generation_prompt=True)``.

:class:`ChatCodec` has the project codec's interface for the host loop.
Messages (:class:`agentic_rl.text.codec.Message`) map to the template's::

  system, user, assistant  ->  {"role": ..., "content": ...}
  tool_call                ->  {"role": "assistant", "tool_calls": [{"type":
                               "function", "function": {"name", "arguments"}}]}
                               (merged into the assistant message before it)
  tool_result              ->  {"role": "tool", "content": ...}

A policy turn ends at the template's end-of-turn token (``<|im_end|>``,
``<|eot_id|>``, ``<end_of_turn>``) or an eos id (``ids.stop_ids``). The
host then frames the observation with :meth:`ChatCodec.frame_observation_ids`:
the ids the template writes between the end of the policy's turn and the
start of its next one, derived by rendering conversations with a sentinel
content and cutting around it. For Qwen2.5 and a tool result::

  ...</tool_call><|im_end|>  +  \\n<|im_start|>user\\n<tool_response>\\n
  {observation}  +  \\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

Tool calls are written in one of two formats (``tool_format``):

  hermes       <tool_call>\\n{"name": "calc", "arguments": {"expr": "1+2"}}\\n</tool_call>
               (Qwen2.5, Qwen3; also the text format of templates without tools)
  llama3_json  the whole message is {"name": "calc", "parameters": {"expr": "1+2"}},
               optionally after <|python_tag|> (Llama 3.1, 3.2)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import numpy as np

from agentic_rl.text.codec import Message
from agentic_rl.text.hf_tokenizer import HFTokenizer
from agentic_rl.text.tools import ToolCall, ToolCallError, check_call, loads_call

TOOL_FORMATS = ("hermes", "llama3_json")
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"  # private-use characters around escaped tokens


# ------------------------------------------------------------------ rendering
class _GenerationBlock(jinja2.ext.Extension):
  """``{% generation %}...{% endgeneration %}`` (assistant-mask markers of
  some templates) renders its body unchanged."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
  """A template ``namespace`` that stores no underscore-prefixed names."""

  def __init__(*args, **kwargs):  # pylint: disable=no-self-argument
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(f"a template namespace cannot store {name!r}")


class _DictFactory:
  """``dict(...)`` in a template, without access to the type itself."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  """JSON without jinja's HTML escaping, with json.dumps' options."""
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


_COMPILED: dict[str, jinja2.Template] = {}


def compile_template(source: str) -> jinja2.Template:
  """A chat template compiled in the sandbox transformers renders it in."""
  if source not in _COMPILED:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_DictFactory(), namespace=_Namespace)
    _COMPILED[source] = env.from_string(source)
  return _COMPILED[source]


def render(source: str, messages: Sequence[Mapping[str, Any]], *,
           tools: Sequence[Mapping[str, Any]] | None = None,
           add_generation_prompt: bool = False, **variables) -> str:
  """Renders a conversation (Hugging Face message dicts) with a chat template.

  Args:
    source: the template.
    messages: ``{"role", "content", ...}`` dicts; keys whose value is None are
      dropped, as transformers does.
    tools: tools as the template takes them,
      ``{"type": "function", "function": schema}``.
    add_generation_prompt: end with the header of the assistant's next turn.
    **variables: more template variables (``bos_token``, ``eos_token``, ...,
      template options such as ``enable_thinking``).
  """
  chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
  return compile_template(source).render(
      messages=chat, tools=None if tools is None else list(tools), documents=None,
      add_generation_prompt=add_generation_prompt, **variables)


def template_names(source: str) -> tuple[frozenset[str], frozenset[str]]:
  """The template's undeclared variables and its string constants."""
  ast = compile_template(source).environment.parse(source)
  consts = {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
  return frozenset(jinja2.meta.find_undeclared_variables(ast)), frozenset(consts)


# ------------------------------------------------------------------ codec
@dataclasses.dataclass(frozen=True)
class ChatIds:
  """Token ids the rollout uses inside jit (plain ints, hashable).

  ``end`` is the template's end-of-turn token; ``stop_ids`` (``end`` and the
  eos ids) end a policy turn; ``final_ids`` equals ``stop_ids`` (the
  environment decides when an episode is over).
  """

  pad: int
  eos: int
  end: int
  stop_ids: tuple[int, ...]
  final_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Framing:
  """What the template writes around an observation: ``prefix`` + content +
  ``suffix``.

  ``content`` is how the template rewrites the observation's text:
  ``"none"``, ``"strip"`` (``| trim``), ``"json"`` (``| tojson`` of a string:
  the quotes are in prefix/suffix, the body is escaped) or ``"strip_json"``.
  The fixed ids are ``head_ids`` (the prefix up to its last added token) and
  ``tail_ids`` (the suffix from its first added token); the plain text
  between them (``head_text`` + content + ``tail_text``, e.g. Qwen's
  ``"\n"`` before ``</tool_response>``) is tokenised as one piece, as it is
  in the rendered conversation.
  """

  prefix: str
  suffix: str
  content: str
  role: str
  head_ids: tuple[int, ...]
  head_text: str
  tail_text: str
  tail_ids: tuple[int, ...]

  def transform(self, text: str) -> str:
    return _transform(self.content, text)

  @property
  def verbatim(self) -> bool:
    """The observation's ids go in unchanged (no plain text at its edges)."""
    return not self.head_text and not self.tail_text and self.content == "none"


def _transform(content: str, text: str) -> str:
  if content in ("strip", "strip_json"):
    text = text.strip()
  if content in ("json", "strip_json"):
    text = json.dumps(text, ensure_ascii=False)[1:-1]
  return text


_SENTINEL = "OBSERVATION"
_PROBE_CALL = {"name": "probe", "arguments": {"x": 1}}
_PROBE = " \tProbe \"q\"\nline two "
_SAMPLES = ("The result is 42, see {\"ok\": true}.", "\nstarts with a newline", "ends: so.\n\n",
            "x", "  spaced  ")


class ChatCodec:
  """Conversations in a checkpoint's chat template, for the host loop.

  Example::

    codec = ChatCodec.from_pretrained("/tmp/tiny_qwen")
    prompt = codec.encode_prompt([Message("user", "What is 2+3?")], tools=tools)
    # ... the policy writes ids ending with one of codec.ids.stop_ids ...
    call = codec.parse_tool_call(action_ids, tools)  # None: no call
    obs = codec.frame_observation_ids(codec.encode_text("5"), tool=call is not None)
  """

  def __init__(self, tokenizer: HFTokenizer, chat_template: str | Mapping[str, str] | None = None,
               *, tool_format: str | None = None, template_variables: Mapping[str, Any] = ()):
    template = tokenizer.chat_template if chat_template is None else chat_template
    if template is None:
      raise ValueError("the checkpoint has no chat template (tokenizer_config.json "
                       "chat_template or chat_template.jinja)")
    self.tokenizer = tokenizer
    self._templates = dict(template) if isinstance(template, Mapping) else {"default": template}
    if "default" not in self._templates:
      raise ValueError(f"no default chat template among {sorted(self._templates)}")
    self.template = self._templates["default"]
    self.variables = {**tokenizer.special_tokens, **dict(template_variables)}
    names, consts = template_names(self.template)
    self.uses_tools = "tools" in names or "tool_use" in self._templates
    self.supports_tool_calls = "tool_calls" in self.template
    self.supports_tool_role = bool({"tool", "ipython"} & consts)
    if tool_format is None:
      tool_format = ("hermes" if "<tool_call>" in self.template else
                     "llama3_json" if '"parameters"' in self.template or
                     "<|python_tag|>" in self.template else "hermes")
    if tool_format not in TOOL_FORMATS:
      raise ValueError(f"tool_format {tool_format!r}; expected one of {TOOL_FORMATS}")
    self.tool_format = tool_format
    self.supports_system = self._renders([{"role": "system", "content": "S"},
                                          {"role": "user", "content": "U"}])
    self._control = sorted((p for p in tokenizer.added_pieces if p.strip()), key=len, reverse=True)
    self._control_re = re.compile("|".join(map(re.escape, self._control)) or "(?!)")
    self._marked_re = re.compile(
        f"{_MARK_OPEN}({self._control_re.pattern}){_MARK_CLOSE}|[{_MARK_OPEN}{_MARK_CLOSE}]")
    end = self._end_of_turn()
    stops = tuple(dict.fromkeys((end, *tokenizer.eos_ids)))
    self.ids = ChatIds(pad=tokenizer.pad_id, eos=tokenizer.eos_id, end=end,
                       stop_ids=stops, final_ids=stops)
    self._python_tag = tokenizer.backend.token_to_id("<|python_tag|>")
    self.framing = {tool: self._derive_framing(tool) for tool in (True, False)}

  @classmethod
  def from_pretrained(cls, path: str, **kwargs) -> ChatCodec:
    """The codec of the checkpoint directory ``path`` (see :class:`HFTokenizer`)."""
    return cls(HFTokenizer.from_pretrained(path), **kwargs)

  # ---------------------------------------------------------------- rendering
  def _template_for(self, tools) -> str:
    return self._templates.get("tool_use", self.template) if tools else self.template

  def render(self, conversation: Sequence[Mapping[str, Any]], *,
             tools: Sequence[Mapping[str, Any]] | None = None,
             add_generation_prompt: bool = False) -> str:
    """The template's text of Hugging Face message dicts; ``tools`` are
    schemas ``{"name", "description", "parameters"}``."""
    wrapped = None if not tools else [{"type": "function", "function": dict(t)} for t in tools]
    return render(self._template_for(tools), conversation, tools=wrapped,
                  add_generation_prompt=add_generation_prompt, **self.variables)

  def _renders(self, conversation) -> bool:
    try:
      self.render(conversation)
    except jinja2.exceptions.TemplateError:
      return False
    return True

  def _call_text(self, call: Mapping[str, Any]) -> str:
    """A call written in the tool format, for templates without tool calls."""
    if self.tool_format == "llama3_json":
      return json.dumps({"name": call["name"], "parameters": call["arguments"]},
                        ensure_ascii=False)
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"

  def to_hf(self, messages: Sequence[Message], *,
            tools: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Project messages as the template's message dicts.

    A ``tool_call`` message's content is the call's JSON, ``{"name": ...,
    "arguments": {...}}``. Templates without a tool role get tool results as
    user messages, without tool calls the call as text in the tool format;
    without a system role the system text opens the first user message; and
    when the template ignores ``tools`` their :meth:`describe_tools` text is
    added to the system message.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
      if m.role in ("system", "user"):
        out.append({"role": m.role, "content": m.content})
      elif m.role == "assistant":
        out.append({"role": "assistant", "content": m.content})
      elif m.role == "tool_call":
        call = json.loads(m.content)
        call = {"name": call["name"],
                "arguments": call.get("arguments", call.get("parameters", {}))}
        if not (out and out[-1]["role"] == "assistant"):
          out.append({"role": "assistant", "content": ""})
        if self.supports_tool_calls:
          out[-1].setdefault("tool_calls", []).append({"type": "function", "function": call})
        else:
          text = out[-1]["content"]
          out[-1]["content"] = (text + "\n" if text else "") + self._call_text(call)
      elif m.role == "tool_result":
        out.append({"role": "tool" if self.supports_tool_role else "user", "content": m.content})
      else:
        raise ValueError(f"unknown role {m.role!r}")
    if tools and not self.uses_tools:
      text = self.describe_tools(tools)
      if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
      else:
        out.insert(0, {"role": "system", "content": text})
    if out and out[0]["role"] == "system" and not self.supports_system:
      system = out.pop(0)["content"]
      if out and out[0]["role"] == "user":
        out[0] = {"role": "user", "content": system + "\n\n" + out[0]["content"]}
      else:
        out.insert(0, {"role": "user", "content": system})
    return out

  # ---------------------------------------------------------------- encode
  def encode_prompt(self, messages: Sequence[Message], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    escape: bool = False) -> np.ndarray:
    """int32 ids of the conversation ending where the assistant's next turn
    begins: ``apply_chat_template(conversation, tools=..., add_generation_prompt=True)``.

    With ``escape`` the text of system, user and tool-result messages yields
    no added or special token (a ``"<|im_end|>"`` in an observation is
    plain text); other text is encoded as the template renders it.
    """
    return np.asarray(self.encode(messages, tools=tools, add_generation_prompt=True,
                                  escape=escape), np.int32)

  def encode(self, messages: Sequence[Message], *,
             tools: Sequence[Mapping[str, Any]] | None = None,
             add_generation_prompt: bool = False, escape: bool = False) -> list[int]:
    """Ids of a conversation (see :meth:`encode_prompt`)."""
    if escape:
      messages = [Message(m.role, self._mark(m.content))
                  if m.role in ("system", "user", "tool_result") else m for m in messages]
    text = self.render(self.to_hf(messages, tools=tools), tools=tools if self.uses_tools else None,
                       add_generation_prompt=add_generation_prompt)
    if not escape:
      return self.tokenizer.encode(text)
    pieces = self._marked_re.split(text)
    ids = self.tokenizer.encode(pieces[0])
    for i in range(1, len(pieces), 2):
      if pieces[i] is not None:
        ids += self.encode_text(pieces[i])
      if pieces[i + 1]:
        ids += self.tokenizer.encode(pieces[i + 1])
    return ids

  def _mark(self, text: str) -> str:
    text = text.replace(_MARK_OPEN, "").replace(_MARK_CLOSE, "")
    return self._control_re.sub(lambda m: _MARK_OPEN + m.group(0) + _MARK_CLOSE, text)

  def encode_text(self, text: str) -> list[int]:
    """Ids of text from outside the policy: no added or special token is
    recognised (``"<|im_end|>"`` or ``"<tool_call>"`` become ordinary
    pieces), otherwise as :meth:`HFTokenizer.encode`."""
    ids = self.tokenizer.encode_plain(text)
    if bad := self.tokenizer.added_ids.intersection(ids):
      raise ValueError(f"the tokenizer makes added tokens "
                       f"{sorted(self.tokenizer.id_to_piece(i) for i in bad)} from plain text")
    return ids

  # ---------------------------------------------------------------- framing
  def _end_of_turn(self) -> int:
    """The first added token the template writes after an assistant's text."""
    text = self.render([{"role": "user", "content": "Question"},
                        {"role": "assistant", "content": "Reply"}])
    after = text[text.rindex("Reply") + len("Reply"):]
    for i in self.tokenizer.encode(after):
      if i in self.tokenizer.added_ids:
        return i
    raise ValueError(f"the chat template writes no end-of-turn token after an assistant "
                     f"message (it writes {after!r})")

  def _turns(self, tool: bool, content: str) -> tuple[list[dict], list[dict]]:
    user = [{"role": "user", "content": "Question"}]
    if tool:
      messages = self.to_hf([Message("user", "Question"),
                             Message("tool_call", json.dumps(_PROBE_CALL)),
                             Message("tool_result", content)])
    else:
      messages = user + [{"role": "assistant", "content": "Reply"},
                         {"role": "user", "content": content}]
    return user, messages

  def _tail(self, tool: bool, content: str) -> str:
    """The text after the policy's end-of-turn token up to its next turn."""
    user, messages = self._turns(tool, content)
    head = self.render(user, add_generation_prompt=True)
    text = self.render(messages, add_generation_prompt=True)
    if not text.startswith(head):
      raise ValueError("the chat template renders a conversation's start differently "
                       "once more turns follow; observations cannot be framed")
    end = self.tokenizer.id_to_piece(self.ids.end)
    rest = text[len(head):]
    if end not in rest:
      raise ValueError(f"the template does not end the assistant's turn with {end!r}")
    return rest[rest.index(end) + len(end):]

  def _derive_framing(self, tool: bool) -> Framing:
    role = "tool" if tool and self.supports_tool_role else "user"
    try:
      tail = self._tail(tool, _SENTINEL)
    except jinja2.exceptions.TemplateError:
      if not tool or not self.supports_tool_role:
        raise
      self.supports_tool_role, role = False, "user"
      tail = self._tail(tool, _SENTINEL)
    if tail.count(_SENTINEL) != 1:
      raise ValueError(f"the template writes an observation {tail.count(_SENTINEL)} times")
    prefix, suffix = tail.split(_SENTINEL)
    probe = self._tail(tool, _PROBE)
    if not (probe.startswith(prefix) and probe.endswith(suffix)):
      raise ValueError("the template's framing of an observation depends on its content")
    middle = probe[len(prefix):len(probe) - len(suffix)]
    content = next((c for c in ("none", "strip", "json", "strip_json")
                    if _transform(c, _PROBE) == middle), None)
    if content is None:
      raise ValueError(f"the template rewrites an observation in an unknown way: "
                       f"{_PROBE!r} -> {middle!r}")
    heads = list(self._control_re.finditer(prefix))
    cut = heads[-1].end() if heads else 0
    tails = self._control_re.search(suffix)
    cut_tail = tails.start() if tails else len(suffix)
    enc = self.tokenizer.encode
    framing = Framing(prefix, suffix, content, role, tuple(enc(prefix[:cut])), prefix[cut:],
                      suffix[:cut_tail], tuple(enc(suffix[cut_tail:])))
    for sample in _SAMPLES:
      framed = self._frame(framing, self.encode_text(sample))
      whole = enc(self._tail(tool, sample))
      if framed != whole:
        raise ValueError(
            f"framing the observation {sample!r} ({prefix!r} + obs + {suffix!r}) tokenises "
            f"differently from the rendered turn: {framed} != {whole}")
    return framing

  def _frame(self, framing: Framing, obs_ids: Sequence[int]) -> list[int]:
    body = [int(i) for i in obs_ids]
    if not framing.verbatim:
      text = framing.transform(self.tokenizer.decode(body))
      body = self.encode_text(framing.head_text + text + framing.tail_text)
    return [*framing.head_ids, *body, *framing.tail_ids]

  def frame_observation_ids(self, obs_ids: Sequence[int], *, tool: bool) -> list[int]:
    """The ids after the policy's end-of-turn token up to where its next turn
    begins, around an observation's ids (from :meth:`encode_text`): a tool
    result (``tool=True``, the template's tool role, or a user turn if it
    has none) or a plain environment reply (a user turn).

    When plain text of the template touches the observation (Qwen's
    ``"\n"`` before ``</tool_response>``, Llama's ``"\n\n"`` after the
    header) or the template rewrites it (``| trim``, ``| tojson``), the
    observation is decoded and tokenised together with that text, so the
    ids equal the rendered conversation's; otherwise ``obs_ids`` go in
    unchanged.
    """
    return self._frame(self.framing[bool(tool)], obs_ids)

  # ---------------------------------------------------------------- actions
  @property
  def turn_end_id(self) -> int:
    """The stop id that ends a turn: the template's end-of-turn token."""
    return self.ids.end

  def _strip_stops(self, action_ids) -> list[int]:
    ids = [int(i) for i in np.asarray(action_ids).reshape(-1)]
    while ids and ids[-1] in self.ids.stop_ids:
      ids.pop()
    return ids

  def action_text(self, action_ids: Sequence[int] | np.ndarray) -> str:
    """The text an environment's ``step`` receives: the action without its
    end-of-turn and special tokens."""
    return self.tokenizer.decode(self._strip_stops(action_ids), skip_special_tokens=True)

  def calls_tool(self, action_ids: Sequence[int] | np.ndarray) -> bool:
    """Whether the action attempts a tool call (syntactically): it contains
    ``<tool_call>`` (hermes), or starts with ``{`` or ``<|python_tag|>``
    (llama3_json)."""
    if self.tool_format == "hermes":
      return "<tool_call>" in self.action_text(action_ids)
    ids = self._strip_stops(action_ids)
    return self._python_tag in ids or self.action_text(ids).lstrip().startswith("{")

  def parse_tool_call(self, action_ids: Sequence[int] | np.ndarray,
                      tools: Sequence[Mapping[str, Any]]) -> ToolCall | None:
    """The tool call of an action, checked against ``tools``; None when the
    action calls no tool.

    Raises:
      ToolCallError: a malformed call: not JSON, an unknown tool, arguments
        that do not match the schema, more than one call in the turn.
    """
    if not self.calls_tool(action_ids):
      return None
    text = self.action_text(action_ids)
    if self.tool_format == "llama3_json":
      return check_call(loads_call(text), tools, ("parameters", "arguments"))
    if text.count("<tool_call>") > 1:
      raise ToolCallError("one tool call per turn")
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)
    if not calls:
      raise ToolCallError("a tool call ends with </tool_call>")
    return check_call(loads_call(calls[0]), tools)

  def describe_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
    """Instructions that offer ``tools`` (JSON schemas) in the tool format,
    for templates that do not render tools themselves."""
    schemas = "\n".join(json.dumps({"type": "function", "function": dict(t)}, ensure_ascii=False)
                        for t in tools)
    if self.tool_format == "llama3_json":
      return ("You can call one of these functions. To call one, reply with only a JSON "
              'object {"name": function name, "parameters": {argument name: value}}.\n\n'
              + schemas)
    return ("# Tools\n\nYou can call one function per turn. The functions are described "
            "within <tools></tools>:\n<tools>\n" + schemas + "\n</tools>\n\nTo call one, reply "
            "with a JSON object inside <tool_call></tool_call>:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
