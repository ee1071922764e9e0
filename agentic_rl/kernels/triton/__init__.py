"""Pallas Triton kernels, for GPUs: flash attention (forward, dQ, dK/dV),
split-K decode attention and the fused log-prob (forward, logit gradient).

They have run compiled on an NVIDIA H200 (jax 0.11.2, CUDA 13; BENCHMARKS.md
has the measurements); off a GPU they run in Pallas' interpreter (the
default family of ``impl="pallas"`` on CPU). Entry points:
:mod:`agentic_rl.kernels.flash`, :mod:`~agentic_rl.kernels.decode`,
:mod:`~agentic_rl.kernels.logprobs`.
"""
