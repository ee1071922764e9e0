"""Attention, decode attention and fused log-probs.

Laid out by backend:

* ``reference.py``: the pure-JAX (XLA) references, ``impl="xla"``, and the
  specification the kernels are tested against.
* ``flash.py``, ``decode.py``, ``logprobs.py``: the ops' entry points
  (:func:`flash_attention`, :func:`decode_attention`,
  :func:`token_logprobs`): argument checks, dispatch on ``impl`` and
  ``backend``, the shared ``custom_vjp`` s, and the pure-JAX chunked
  log-prob path (``impl="xla_chunked"``).
* ``triton/``: Pallas Triton kernels, for GPUs (run on an H200).
* ``hopper/``: Pallas Mosaic GPU attention kernels, for Hopper GPUs
  (compiled for an H200, never run on a GPU).
* ``tpu/``: Pallas Mosaic TPU kernels (run only in the TPU interpreter).
* ``attention_rules.py``, ``logprob_math.py``, ``_common.py``: masking
  rules, tile math and plumbing shared by the kernel families.
* ``backends.py``: the dispatcher from config names (``attn_impl``,
  ``logprob_impl``, ``"auto"``) to backends, per platform
  (:func:`resolve`).

Every op takes ``impl``: ``"pallas"``, ``"xla"``, plus ``"cudnn"`` for
:func:`flash_attention` and ``"xla_chunked"`` for :func:`token_logprobs`.
``impl="pallas"`` runs one of two kernel families, chosen by the platform or
by ``backend=``: ``"triton"`` (GPU; the default on CPU) or ``"mosaic_tpu"``
(TPU). Off its own platform a family runs interpreted, so both are tested on
CPU. The kernels' dots follow ``jax_default_matmul_precision`` as XLA's do
(Triton's default for fp32 is TF32; ``jax.default_matmul_precision
("highest")`` gives IEEE fp32 on both).
"""

from agentic_rl.kernels._common import BACKENDS as PALLAS_BACKENDS
from agentic_rl.kernels._common import pallas_backend
from agentic_rl.kernels.backends import ATTN_IMPLS
from agentic_rl.kernels.backends import LOGPROB_IMPLS
from agentic_rl.kernels.backends import UnverifiedBackendWarning
from agentic_rl.kernels.backends import attention_kwargs
from agentic_rl.kernels.backends import logprob_kwargs
from agentic_rl.kernels.backends import resolve
from agentic_rl.kernels.decode import DecodeBlockSizes
from agentic_rl.kernels.decode import TpuDecodeBlockSizes
from agentic_rl.kernels.decode import decode_attention
from agentic_rl.kernels.flash import AttentionBlockSizes
from agentic_rl.kernels.flash import TpuAttentionBlockSizes
from agentic_rl.kernels.flash import flash_attention
from agentic_rl.kernels.logprobs import LogprobBlockSizes
from agentic_rl.kernels.logprobs import TpuLogprobBlockSizes
from agentic_rl.kernels.logprobs import token_logprobs
from agentic_rl.kernels.reference import NO_WINDOW

__all__ = [
    "ATTN_IMPLS",
    "AttentionBlockSizes",
    "DecodeBlockSizes",
    "LOGPROB_IMPLS",
    "LogprobBlockSizes",
    "NO_WINDOW",
    "PALLAS_BACKENDS",
    "TpuAttentionBlockSizes",
    "TpuDecodeBlockSizes",
    "TpuLogprobBlockSizes",
    "UnverifiedBackendWarning",
    "attention_kwargs",
    "decode_attention",
    "flash_attention",
    "logprob_kwargs",
    "pallas_backend",
    "resolve",
    "token_logprobs",
]
