"""The prompt every environment shares: one short system message, then the
family's user message (``env.prompt_text(instance)``)."""

from __future__ import annotations

from agentic_rl.text.codec import Message

SYSTEM_PROMPT = "Tools: calc, store, recall, lookup, open. Answer with one integer."


def prompt_messages(env, instance, *, system: bool = True) -> list[Message]:
  """``[system, user]`` messages for one (unbatched) instance."""
  user = Message("user", env.prompt_text(instance))
  return [Message("system", SYSTEM_PROMPT), user] if system else [user]
