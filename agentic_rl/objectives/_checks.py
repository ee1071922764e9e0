"""Checks shared by the objective registries."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping


class UnknownHyperParameterError(ValueError):
  """A hyper-parameter that the named estimator, loss or correction lacks."""


def keyword_names(fn: Callable[..., object]) -> tuple[str, ...]:
  """The keyword-only parameters (hyper-parameters) of ``fn``."""
  params = inspect.signature(fn).parameters.values()
  return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)


def check_keywords(what: str, fn: Callable[..., object], kwargs: Mapping[str, object]) -> None:
  """Raise :class:`UnknownHyperParameterError` (a ``ValueError``) if ``kwargs``
  has a name ``fn`` does not accept."""
  accepted = keyword_names(fn)
  if unknown := sorted(set(kwargs) - set(accepted)):
    raise UnknownHyperParameterError(
        f"{what} got unknown hyper-parameter(s) {unknown}; it accepts: "
        f"{', '.join(accepted) or 'none'}")


def keyword_defaults(fn: Callable[..., object], exclude: tuple[str, ...] = ()) -> dict[str, object]:
  """The hyper-parameters of ``fn`` with their defaults (None for a required one)."""
  params = inspect.signature(fn).parameters.values()
  return {p.name: None if p.default is p.empty else p.default for p in params
          if p.kind is p.KEYWORD_ONLY and p.name not in exclude}
