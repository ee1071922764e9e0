"""Environments by name."""

from __future__ import annotations

from agentic_rl.envs.boxes import BoxesEnv
from agentic_rl.envs.calc_chain import CalcChainEnv
from agentic_rl.envs.composed import ComposedEnv
from agentic_rl.envs.mixture import MixtureEnv
from agentic_rl.envs.multihop import MultiHopEnv

ENVS = {"calc_chain": CalcChainEnv, "multihop": MultiHopEnv, "boxes": BoxesEnv,
        "composed": ComposedEnv}


def make_env(name: str, tokenizer_or_codec, **kwargs):
  """Builds an environment by name.

  ``name`` is one of ``ENVS`` (keyword arguments go to its constructor) or
  ``"mixture"``, with ``members`` (names), optional ``weights`` and
  ``member_kwargs`` (a dict: member name -> constructor kwargs); any other
  keyword arguments (e.g. ``rewards``) go to every member.
  """
  if name == "mixture":
    members = kwargs.pop("members", None)
    if not members:
      raise ValueError("make_env('mixture', ...) needs members=(names...)")
    weights = kwargs.pop("weights", None)
    member_kwargs = kwargs.pop("member_kwargs", {})
    unknown = set(member_kwargs) - set(members)
    if unknown:
      raise ValueError(f"member_kwargs for environments not in the mixture: {sorted(unknown)}")
    envs = [make_env(m, tokenizer_or_codec, **{**kwargs, **member_kwargs.get(m, {})})
            for m in members]
    return MixtureEnv(envs, weights)
  if name not in ENVS:
    raise ValueError(f"unknown environment {name!r}; expected one of "
                     f"{sorted(ENVS) + ['mixture']}")
  return ENVS[name](tokenizer_or_codec, **kwargs)
