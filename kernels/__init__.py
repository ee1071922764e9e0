"""Pallas kernels, installed as ``agentic_rl.kernels``.

Every op takes ``impl``: ``"pallas"``, ``"xla"`` (the pure-JAX references in
:mod:`agentic_rl.kernels.reference`), plus ``"cudnn"`` for
:func:`flash_attention` and ``"xla_chunked"`` for :func:`token_logprobs`.
``impl="pallas"`` runs one of two kernel families, chosen by the platform or
by ``backend=``: ``"triton"`` (GPU; the default on CPU) or ``"mosaic_tpu"``
(TPU; the ``*_tpu`` modules). On CPU either family runs interpreted, so both
are tested everywhere. The kernels' dots follow
``jax_default_matmul_precision`` as XLA's do (Triton's default for fp32 is
TF32; ``jax.default_matmul_precision("highest")`` gives IEEE fp32 on both).
"""

from agentic_rl.kernels._common import BACKENDS as PALLAS_BACKENDS
from agentic_rl.kernels._common import pallas_backend
from agentic_rl.kernels.decode import DecodeBlockSizes
from agentic_rl.kernels.decode import decode_attention
from agentic_rl.kernels.decode_tpu import TpuDecodeBlockSizes
from agentic_rl.kernels.flash import AttentionBlockSizes
from agentic_rl.kernels.flash import flash_attention
from agentic_rl.kernels.flash_tpu import TpuAttentionBlockSizes
from agentic_rl.kernels.logprobs import LogprobBlockSizes
from agentic_rl.kernels.logprobs import token_logprobs
from agentic_rl.kernels.logprobs_tpu import TpuLogprobBlockSizes
from agentic_rl.kernels.reference import NO_WINDOW

__all__ = [
    "AttentionBlockSizes",
    "DecodeBlockSizes",
    "LogprobBlockSizes",
    "NO_WINDOW",
    "PALLAS_BACKENDS",
    "TpuAttentionBlockSizes",
    "TpuDecodeBlockSizes",
    "TpuLogprobBlockSizes",
    "decode_attention",
    "flash_attention",
    "pallas_backend",
    "token_logprobs",
]
