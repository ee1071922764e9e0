"""Text for training the tokenizer, so its BPE merges fit the environments.

Digits, operators, tool names and tags are reserved single-id pieces, so the
only text BPE merges matter for is natural language: the shared system
prompt, the families' user prompts and the tool-result messages. The corpus
is those, in the proportions an episode has them, over every family and
difficulty level. Environments are built without a tokenizer here, so the
corpus exists before the tokenizer it trains.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np

from agentic_rl.envs import prompts
from agentic_rl.envs import registry
from agentic_rl.envs import tokens


def text_corpus(*, seed: int = 0, lines: int = 20000) -> Iterator[str]:
  """Yields ``lines`` corpus lines, deterministic for ``seed``.

  Each episode contributes its system prompt, its user prompt and (one in
  four) a tool-result message.
  """
  if lines < 0:
    raise ValueError(f"lines must be >= 0, got {lines}")
  rng = np.random.default_rng(seed)
  envs = [registry.make_env(name, None) for name in sorted(registry.ENVS)]
  episodes = -(-lines // 2)
  per_env = -(-episodes // len(envs))
  out: list[str] = []
  for e, env in enumerate(envs):
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), e), per_env)
    levels = np.arange(per_env) % env.num_levels
    batch = jax.tree.map(np.asarray, jax.jit(jax.vmap(env.generate))(keys, levels))
    for i in range(per_env):
      out.append(prompts.SYSTEM_PROMPT)
      out.append(env.prompt_text(jax.tree.map(lambda x: x[i], batch)))
      if rng.random() < 0.25:
        out.append(str(rng.choice(tokens.MESSAGES)))
  order = rng.permutation(len(out))[:lines]
  for i in order:
    yield out[i]
