"""Pallas Mosaic GPU attention kernels for Hopper (sm_90a): forward, dQ and
dK/dV, selected per side by ``AttentionBlockSizes(fwd=, bwd="mosaic_gpu")``
or ``attn_impl="mosaic_gpu"``.

Not yet run on a GPU: they pass their tests in Pallas' GPU interpreter (jax
>= 0.11), lower for CUDA and compile for an H200 on CPU
(``experiments/aot_kernels.py``), so their speed on a GPU is unverified;
selecting them in a config warns (:mod:`agentic_rl.kernels.backends`).
Entry point: :mod:`agentic_rl.kernels.flash`.
"""
