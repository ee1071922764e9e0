"""Which kernel backend runs on which hardware, and the choice of one.

The model picks a backend per op family by name: ``attn_impl``
(:class:`agentic_rl.model.TransformerConfig`: self-attention through
:func:`~agentic_rl.kernels.flash_attention`, one-token cache attention
through :func:`~agentic_rl.kernels.decode_attention`) and ``logprob_impl``
(the experiment config's ``model.logprob_impl``: teacher-forced scoring
through :func:`~agentic_rl.kernels.token_logprobs`). :func:`resolve` is the
one place a name is checked against the platform and ``"auto"`` is turned
into a backend; it runs before anything is compiled (when a config is
checked, and again when the op is traced, for the platform being lowered
for).

Attention (``attn_impl``), with where each runs, its code, and whether it
has run on that hardware:

* ``xla``: any platform; ``agentic_rl/kernels/reference.py``; yes.
* ``xla_vjp``: any platform; the reference forward with a hand-written
  backward, ``agentic_rl/model/attention.py``; yes (CPU).
* ``triton``: GPU; ``agentic_rl/kernels/triton/``; yes (H200).
* ``cudnn``: NVIDIA GPU; ``jax.nn.dot_product_attention(implementation=
  "cudnn")`` for self-attention, the Triton decode kernel; yes (H200).
* ``mosaic_gpu``: Hopper GPU (sm_90); ``agentic_rl/kernels/hopper/`` for
  self-attention, the Triton decode kernel; no (compiled for an H200 on
  CPU, never run on a GPU).
* ``mosaic_tpu``: TPU; ``agentic_rl/kernels/tpu/``; no (run in the TPU
  interpreter and lowered for a TPU only).
* ``pallas``: the platform's Pallas kernels (``triton`` on GPU,
  ``mosaic_tpu`` on TPU, the Triton kernels interpreted on CPU: for tests).

Log-probs (``logprob_impl``): ``xla`` (the reference, materialising the
logits), ``xla_chunked`` (pure JAX over vocabulary chunks,
``agentic_rl/kernels/logprobs.py``), ``triton`` (GPU, ran on an H200),
``mosaic_tpu`` (TPU, never run on one) and ``pallas`` (the platform's, as above).

``"auto"`` is :data:`AUTO`'s choice for the platform: the XLA references on
CPU (the Pallas kernels only run interpreted there) and on any platform not
listed, the Triton kernels on GPU (they cover every case the model
produces; cuDNN refuses soft-caps, traced windows and fp32 inputs, the
Hopper kernels also segment ids), and the Mosaic TPU kernels on TPU.
``cudnn`` and ``mosaic_gpu`` are opt-in: a case outside their scope raises
when traced.

A backend that cannot run on the platform is refused with a ``ValueError``
that names the fix. One that has never run on its hardware (``mosaic_gpu``,
``mosaic_tpu``; ``pallas`` on a TPU) warns once when selected: it passes its
tests in Pallas' interpreters and lowers (and, for Hopper, compiles) for
that hardware, but its speed and its compile-time limits there are
unverified.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax

from agentic_rl.kernels import _common
from agentic_rl.kernels.triton import flash as triton_flash

ATTENTION = "attention"
LOGPROBS = "logprobs"


@dataclasses.dataclass(frozen=True)
class Backend:
  """One selectable implementation of an op family.

  ``platforms``: where it runs (None: every platform). ``ran_on_hardware``:
  it has run, compiled, on the hardware it is written for (for ``pallas``,
  that of the platform's family). ``hardware``: that hardware, in words.
  """
  name: str
  platforms: tuple[str, ...] | None
  ran_on_hardware: bool
  hardware: str


def _backends(*rows) -> dict[str, Backend]:
  return {row[0]: Backend(*row) for row in rows}


BACKENDS = {
    ATTENTION: _backends(
        ("xla", None, True, "any platform (XLA)"),
        ("xla_vjp", None, True, "any platform (XLA)"),
        ("triton", ("gpu",), True, "a GPU (Pallas Triton)"),
        ("cudnn", ("gpu",), True, "an NVIDIA GPU (cuDNN)"),
        ("mosaic_gpu", ("gpu",), False,
         "a Hopper GPU, sm_90 (Pallas Mosaic GPU)"),
        ("mosaic_tpu", ("tpu",), False, "a TPU (Pallas Mosaic TPU)"),
        ("pallas", ("cpu", "gpu", "tpu"), True,
         "the platform's Pallas kernels (interpreted on CPU)"),
    ),
    LOGPROBS: _backends(
        ("xla", None, True, "any platform (XLA)"),
        ("xla_chunked", None, True, "any platform (XLA)"),
        ("triton", ("gpu",), True, "a GPU (Pallas Triton)"),
        ("mosaic_tpu", ("tpu",), False, "a TPU (Pallas Mosaic TPU)"),
        ("pallas", ("cpu", "gpu", "tpu"), True,
         "the platform's Pallas kernels (interpreted on CPU)"),
    ),
}

# "auto" per platform; any platform not listed gets "xla".
AUTO = {
    ATTENTION: {"cpu": "xla", "gpu": "triton", "tpu": "mosaic_tpu"},
    LOGPROBS: {"cpu": "xla", "gpu": "triton", "tpu": "mosaic_tpu"},
}

ATTN_IMPLS = ("auto", *BACKENDS[ATTENTION])
LOGPROB_IMPLS = ("auto", *BACKENDS[LOGPROBS])

_FIELD = {ATTENTION: "attn_impl", LOGPROBS: "logprob_impl"}
_PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}
_warned: set[str] = set()


class UnverifiedBackendWarning(UserWarning):
  """A kernel backend that has never run on its hardware was selected."""


def platform(name: str | None = None) -> str:
  """``"cpu"``, ``"gpu"``, ``"tpu"`` or another backend name: ``name``, or
  the platform being lowered for (:func:`_common.target_platform`), with
  ``"cuda"`` and ``"rocm"`` as ``"gpu"``."""
  name = name or _common.target_platform()
  return _PLATFORMS.get(name, name)


def names(family: str) -> tuple[str, ...]:
  """Every name ``family``'s config field accepts, ``"auto"`` first."""
  return ("auto", *BACKENDS[family])


def check_name(family: str, name: str, *, field: str | None = None) -> None:
  """Raises ``ValueError`` unless ``name`` is one of :func:`names`; does not
  look at the platform."""
  if name not in names(family):
    raise ValueError(f"{field or _FIELD[family]} must be one of "
                     f"{names(family)}, got {name!r}")


def resolve(family: str, name: str, *, on: str | None = None,
            field: str | None = None) -> str:
  """The backend that ``name`` selects for ``family`` on platform ``on``
  (None: the platform being lowered for), never ``"auto"``.

  Raises ``ValueError`` (naming ``field``, default ``attn_impl`` or
  ``logprob_impl``, and the fix) for an unknown name or a backend that
  cannot run there. Warns once per backend that has never run on its
  hardware.
  """
  field = field or _FIELD[family]
  check_name(family, name, field=field)
  where = platform(on)
  if name == "auto":
    name = AUTO[family].get(where, "xla")
  backend = BACKENDS[family][name]
  if backend.platforms is not None and where not in backend.platforms:
    raise ValueError(
        f"{field}={name!r} needs {backend.hardware}, but the platform is "
        f"{where!r}. Use {field}='auto' (here: "
        f"{AUTO[family].get(where, 'xla')!r}) or 'xla'.")
  if name == "mosaic_gpu":
    _check_hopper(field)
  ran = backend.ran_on_hardware
  if name == "pallas" and where == "tpu":
    ran = BACKENDS[family]["mosaic_tpu"].ran_on_hardware
  if not ran and (key := f"{family}:{name}:{where}") not in _warned:
    _warned.add(key)
    warnings.warn(
        f"{field}={name!r} selects kernels for {where} that have never run "
        f"on that hardware: they pass their tests in Pallas' interpreter and "
        f"lower for it, but their speed and compile-time limits there are "
        f"unverified. {field}='xla' is the reference.",
        UnverifiedBackendWarning, stacklevel=2)
  return name


def _check_hopper(field: str) -> None:
  """Refuses ``mosaic_gpu`` on an attached GPU older than Hopper (sm_90).
  Under an abstract mesh (compiling for a device that is not attached) the
  target is taken to be what the mesh names."""
  if getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None):
    return
  if jax.default_backend() != "gpu":
    return
  capability = getattr(jax.devices()[0], "compute_capability", None)
  try:
    major = int(str(capability).split(".")[0])
  except ValueError:
    return
  if major < 9:
    raise ValueError(
        f"{field}='mosaic_gpu' needs a Hopper GPU (sm_90), but this one is "
        f"sm_{str(capability).replace('.', '')}. Use {field}='triton' or "
        f"'auto'.")


def attention_kwargs(name: str) -> tuple[dict, dict]:
  """``(flash_attention kwargs, decode_attention kwargs)`` for a resolved
  kernel backend (not ``xla`` or ``xla_vjp``, which the model runs itself).
  """
  triton = dict(impl="pallas", backend="triton")
  hopper = triton_flash.AttentionBlockSizes(fwd="mosaic_gpu", bwd="mosaic_gpu")
  table = {
      "triton": (triton, triton),
      "cudnn": (dict(impl="cudnn"), triton),
      "mosaic_gpu": (dict(triton, block_sizes=hopper), triton),
      "mosaic_tpu": (dict(impl="pallas", backend="mosaic_tpu"),) * 2,
      "pallas": (dict(impl="pallas"),) * 2,
  }
  if name not in table:
    raise ValueError(f"attention backend {name!r} has no kernel kwargs; "
                     f"expected one of {tuple(table)}")
  return table[name]


def logprob_kwargs(name: str) -> dict:
  """:func:`~agentic_rl.kernels.token_logprobs` kwargs for a resolved
  ``logprob_impl``."""
  table = {
      "xla": dict(impl="xla"),
      "xla_chunked": dict(impl="xla_chunked"),
      "triton": dict(impl="pallas", backend="triton"),
      "mosaic_tpu": dict(impl="pallas", backend="mosaic_tpu"),
      "pallas": dict(impl="pallas"),
  }
  if name not in table:
    raise ValueError(f"logprob backend {name!r} is not resolved; expected "
                     f"one of {tuple(table)}")
  return table[name]
