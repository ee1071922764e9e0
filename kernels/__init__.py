"""Pallas kernels, installed as ``agentic_rl.kernels``.

Every op takes ``impl``: ``"pallas"`` (Triton kernels on GPU, the same
kernels interpreted on CPU; no Mosaic TPU kernels, so TPU raises), ``"xla"``
(the pure-JAX references in :mod:`agentic_rl.kernels.reference`), plus
``"cudnn"`` for :func:`flash_attention` and ``"xla_chunked"`` for
:func:`token_logprobs`. The kernels' dots follow
``jax_default_matmul_precision`` as XLA's do (Triton's default for fp32 is
TF32; ``jax.default_matmul_precision("highest")`` gives IEEE fp32 on both).
"""

from agentic_rl.kernels.decode import DecodeBlockSizes
from agentic_rl.kernels.decode import decode_attention
from agentic_rl.kernels.flash import AttentionBlockSizes
from agentic_rl.kernels.flash import flash_attention
from agentic_rl.kernels.logprobs import LogprobBlockSizes
from agentic_rl.kernels.logprobs import token_logprobs
from agentic_rl.kernels.reference import NO_WINDOW

__all__ = [
    "AttentionBlockSizes",
    "DecodeBlockSizes",
    "LogprobBlockSizes",
    "NO_WINDOW",
    "decode_attention",
    "flash_attention",
    "token_logprobs",
]
