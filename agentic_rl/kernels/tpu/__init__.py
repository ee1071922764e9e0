"""Pallas Mosaic TPU kernels: flash attention (forward, dQ, dK/dV), decode
attention and the fused log-prob (forward, dh, dW).

Not yet run on a TPU: they pass their tests in Mosaic's TPU interpreter on
CPU and lower for an abstract TPU v5p, so their speed and compile-time
limits (VMEM) on a TPU are unverified; selecting them in a config warns
(:mod:`agentic_rl.kernels.backends`). Entry points:
:mod:`agentic_rl.kernels.flash`, :mod:`~agentic_rl.kernels.decode`,
:mod:`~agentic_rl.kernels.logprobs`.
"""
