"""Host environments that live outside the trainer's process.

``config.tasks.env_pool`` says where each rollout row's environment runs:

* ``"threads"`` (the default): in the trainer's process; its calls run on
  worker threads (:class:`agentic_rl.rollout.EnvWorkers`).
* ``"processes"``: each environment in a process of its own, started with
  ``spawn`` (:class:`ProcessEnv`): for environments that hold the GIL,
  leak, or crash the interpreter.
* ``"ray"``: each environment in a Ray actor (:class:`RayEnv`, the optional
  ``ray`` extra), on whatever cluster ``ray.init`` reaches: for
  environments that must run on other machines.

A proxy has the environment's protocol (``reset``, ``step``, and
``demonstration``, ``tools``, ``call_tool`` where the environment has
them) and forwards each call; the environment is built where it runs, from
the factory's spec (``config.tasks.host_env``) and keyword arguments, so
nothing but strings, numbers and the calls' values crosses over.
:meth:`close` ends it (the host loop closes an environment whose call ran
past its time limit).
"""

from __future__ import annotations

import abc
import multiprocessing
import threading
from collections.abc import Mapping
from typing import Any

from agentic_rl.envs import factories

ENV_POOLS = ("threads", "processes", "ray")


def _build(spec: str, kwargs: Mapping[str, Any]):
  return factories.load_factory(spec)(**dict(kwargs))


class _Proxy(abc.ABC):
  """Forwards the protocol's calls through ``self._call(method, *args)``.

  The environment describes itself (its methods and tools) once it is
  built, which the first use waits for, so that many proxies start their
  environments at once; the optional methods exist only where the
  environment has them.
  """

  _ready = False

  @abc.abstractmethod
  def _describe(self) -> tuple[frozenset, Any]:
    """Waits for the environment to be built; its methods and ``tools``."""

  @abc.abstractmethod
  def _call(self, method: str, *args):
    """``env.method(*args)`` where the environment lives."""

  def _wait_ready(self) -> None:
    if not self._ready:
      methods, self.tools = self._describe()
      for name in ("demonstration", "call_tool"):
        if name in methods:
          setattr(self, name, lambda *args, name=name: self._call(name, *args))
      self._ready = True

  def __getattr__(self, name):  # only for attributes not set yet
    if name in ("tools", "demonstration", "call_tool") and not self._ready:
      self._wait_ready()
      return getattr(self, name)
    raise AttributeError(name)

  def reset(self, seed):
    return self._call("reset", seed)

  def step(self, action):
    return self._call("step", action)


def _serve(conn, spec: str, kwargs: dict) -> None:
  """The child process: builds the environment, answers calls until closed."""
  try:
    env = _build(spec, kwargs)
    conn.send(("ok", (_methods_of(env), getattr(env, "tools", None))))
  except Exception as e:  # pylint: disable=broad-except
    conn.send(("error", f"{type(e).__name__}: {e}"))
    return
  while True:
    try:
      method, args = conn.recv()
    except EOFError:
      return
    try:
      conn.send(("ok", getattr(env, method)(*args)))
    except Exception as e:  # pylint: disable=broad-except
      conn.send(("error", f"{type(e).__name__}: {e}"))


def _methods_of(env) -> frozenset:
  return frozenset(m for m in ("reset", "step", "demonstration", "call_tool")
                   if callable(getattr(env, m, None)))


class RemoteEnvError(RuntimeError):
  """An exception raised by the environment on the other side (its type and
  message)."""


class ProcessEnv(_Proxy):
  """An environment in a process of its own.

  Args:
    spec: the factory (``config.tasks.host_env``).
    kwargs: its keyword arguments.
  """

  _context = multiprocessing.get_context("spawn")

  def __init__(self, spec: str, kwargs: Mapping[str, Any] | None = None):
    self._conn, child = self._context.Pipe()
    self._process = self._context.Process(target=_serve, args=(child, spec, dict(kwargs or {})),
                                          daemon=True)
    self._process.start()
    child.close()
    self._lock = threading.Lock()

  def _describe(self):
    with self._lock:
      return self._receive()

  def _receive(self):
    try:
      status, value = self._conn.recv()
    except (EOFError, OSError):
      raise RemoteEnvError(f"the environment's process exited (code "
                           f"{self._process.exitcode})") from None
    if status == "error":
      raise RemoteEnvError(value)
    return value

  def _call(self, method: str, *args):
    self._wait_ready()
    with self._lock:
      self._conn.send((method, args))
      return self._receive()

  def close(self) -> None:
    self._process.kill()
    self._conn.close()


class RayEnv(_Proxy):
  """An environment in a Ray actor (``pip install -e ".[ray]"``; connects
  with ``ray.init()`` unless Ray is already initialised). The factory's
  module must be importable on the Ray workers (installed there, or on
  their ``PYTHONPATH`` through ``ray.init(runtime_env=...)``).

  Args:
    spec: the factory (``config.tasks.host_env``).
    kwargs: its keyword arguments.
  """

  def __init__(self, spec: str, kwargs: Mapping[str, Any] | None = None):
    import ray  # pylint: disable=import-outside-toplevel
    if not ray.is_initialized():
      ray.init(log_to_driver=False)
    self._ray = ray
    self._actor = ray.remote(_RayServer).remote(spec, dict(kwargs or {}))
    self._described = self._actor.describe.remote()

  def _describe(self):
    return self._get(self._described)

  def _get(self, ref):
    try:
      return self._ray.get(ref)
    except self._ray.exceptions.RayTaskError as e:  # the environment raised
      raise RemoteEnvError(str(e.cause if e.cause is not None else e)) from None
    except self._ray.exceptions.RayError as e:  # its actor died, or Ray itself failed
      raise RemoteEnvError(f"{type(e).__name__}: {e}") from None

  def _call(self, method: str, *args):
    self._wait_ready()
    return self._get(self._actor.call.remote(method, args))

  def close(self) -> None:
    self._ray.kill(self._actor)


class _RayServer:
  def __init__(self, spec: str, kwargs: dict):
    self.env = _build(spec, kwargs)

  def describe(self):
    return _methods_of(self.env), getattr(self.env, "tools", None)

  def call(self, method: str, args: tuple):
    return getattr(self.env, method)(*args)


def make_env(pool: str, spec: str, kwargs: Mapping[str, Any] | None = None):
  """A proxy for the environment ``spec`` builds, living where ``pool``
  says (``"processes"`` or ``"ray"``)."""
  if pool == "processes":
    return ProcessEnv(spec, kwargs)
  if pool == "ray":
    return RayEnv(spec, kwargs)
  raise ValueError(f"env_pool must be one of {ENV_POOLS[1:]} for a proxy, got {pool!r}")
