"""Configuration of the decoder-only policy transformer.

The config is plain data: a frozen, hashable dataclass (so it can be a static
argument of ``jax.jit``) that is checked by :meth:`TransformerConfig.validate`
before anything is traced.

Architecture (pre-norm decoder, Llama / Qwen2 / Gemma family):

    x = embed[tokens] (* sqrt(d_model) if embed_scale)
    per layer:  x += Attn(RMSNorm(x));  x += GatedMLP(RMSNorm(x))
      (post_norms, Gemma 2/3: x += RMSNorm(Attn(RMSNorm(x))), likewise MLP)
    logits = softcap(RMSNorm(x) @ unembed)

RMSNorm is ``x / sqrt(mean(x^2) + eps) * w`` (``* (1 + w)`` with
``norm_plus_one``, Gemma); the MLP is ``down(act(gate(x)) * up(x))`` with
``act`` = SiLU (SwiGLU, Shazeer 2020) or tanh-GELU (GeGLU, Gemma); RoPE uses
the Hugging Face "rotate_half" convention (the two halves of each head
vector are rotated together, not interleaved pairs), with angles
``pos / factor / theta ** (2i / Dh)`` (``theta = local_rope_theta`` and
``factor = 1`` on sliding-window layers when ``local_rope_theta`` is set,
else ``rope_theta`` and ``rope_scaling_factor``). Attention logits are
``q . k * query_pre_attn_scalar ** -0.5`` (default ``head_dim ** -0.5``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from agentic_rl.kernels import backends
from agentic_rl.kernels.reference import NO_WINDOW

MLP_ACTIVATIONS = ("silu", "gelu")
# "auto" and every attention backend (agentic_rl.kernels.backends).
ATTN_IMPLS = backends.ATTN_IMPLS
# The projections LoRA can adapt (``lora_targets``), by parameter name.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def alternating_windows(
    n_layers: int, window: int, *, global_every: int = 2
) -> tuple[int | None, ...]:
  """Per-layer windows with every ``global_every``-th layer global.

  Layer ``i`` is global (``None``) iff ``(i + 1) % global_every == 0``, else
  local with ``window``. ``global_every=2`` gives Gemma 2's local/global
  alternation; ``global_every=6`` gives Gemma 3's five local layers per
  global one.
  """
  if global_every < 1:
    raise ValueError(f"global_every must be >= 1, got {global_every}")
  return tuple(None if (i + 1) % global_every == 0 else window
               for i in range(n_layers))


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters of the policy transformer (see the module docstring).

  Attributes:
    vocab_size: V, number of token ids.
    d_model: D, width of the residual stream.
    n_layers: L, number of decoder layers.
    n_heads: H, query heads.
    n_kv_heads: K, key/value heads (``H % K == 0``; K == H is MHA, K == 1 MQA).
    head_dim: Dh, per-head width (even, for RoPE).
    mlp_dim: F, hidden width of the gated MLP.
    mlp_activation: "silu" (SwiGLU) or "gelu" (GeGLU with tanh-GELU).
    norm_eps: RMSNorm epsilon.
    norm_plus_one: RMSNorm scales by ``1 + w`` (Gemma) instead of ``w``.
    rope_theta: RoPE base frequency (of the global layers when
      ``local_rope_theta`` is set).
    local_rope_theta: RoPE base of the sliding-window layers (Gemma 3's
      ``rope_local_base_freq``), or None: every layer uses ``rope_theta``.
      No effect without sliding windows.
    rope_scaling_factor: linear RoPE scaling (position interpolation) of the
      ``rope_theta`` RoPE: angles ``pos / factor / theta ** (2i / Dh)``;
      1.0 is plain RoPE. With ``local_rope_theta`` the sliding-window layers
      are unscaled (Gemma 3 4B+: ``factor = 8`` on the global layers).
    rope_llama3: Llama 3.1's frequency-dependent RoPE scaling, ``(factor,
      low_freq_factor, high_freq_factor, original_max_position_embeddings)``,
      or None. With ``L = original_max_position_embeddings`` and a
      frequency's wavelength ``w = 2 pi / f``: ``f`` is kept where
      ``w < L / high_freq_factor``, divided by ``factor`` where
      ``w > L / low_freq_factor``, and in between interpolated,
      ``(1 - s) f / factor + s f`` with ``s = (L / w - low) / (high - low)``.
    query_pre_attn_scalar: attention logits are ``q . k / sqrt(s)`` with
      this ``s`` (Gemma 2/3), or None for ``s = head_dim``. Applied by
      scaling q by ``sqrt(head_dim / s)`` before attention (every backend
      keeps its ``head_dim ** -0.5``).
    qkv_bias: biases on the q, k, v projections (Qwen2).
    qk_norm: RMSNorm over ``head_dim`` on queries and keys before RoPE.
    post_norms: "sandwich" norms (Gemma 2/3): RMSNorm on the attention
      output and on the MLP output before each residual add,
      ``x += RMSNorm_post(Attn(RMSNorm_pre(x)))`` and likewise for the MLP.
    tie_embeddings: the unembedding is the embedding matrix transposed.
    embed_scale: multiply embeddings by ``sqrt(d_model)`` (Gemma).
    attn_logit_softcap: ``c * tanh(s / c)`` on attention logits, or None.
    final_logit_softcap: ``c * tanh(z / c)`` on output logits, or None.
    sliding_windows: per-layer window (int) or None for global attention;
      None for the whole field means every layer is global. A query at
      position p sees keys at positions j with ``p - j < window``.
    dtype: compute dtype (activations, matmul inputs, KV cache).
    param_dtype: dtype the parameters are stored in.
    attn_impl: "auto" (the platform's choice: "xla" on CPU, "triton" on
      GPU, "mosaic_tpu" on TPU), "xla" (reference), "xla_vjp" (the
      reference with a hand-written self-attention backward: faster on
      CPU), "triton" (GPU), "cudnn" (GPU self-attention), "mosaic_gpu"
      (Hopper self-attention; never run on a GPU), "mosaic_tpu" (TPU;
      never run on a TPU) or "pallas" (the platform's Pallas kernels,
      interpreted on CPU). The table is in
      :mod:`agentic_rl.kernels.backends`; :meth:`resolved` picks for the
      platform, refusing a backend that cannot run there.
    remat: rematerialise each layer's activations in the backward pass
      (``jax.checkpoint`` on the layer body in :func:`forward`).
    scan_unroll: layers applied per iteration of :func:`forward`'s layer
      loop (``lax.scan``'s ``unroll``): None unrolls all of them (no loop),
      1 compiles one layer body whatever the depth (the quickest compile
      for deep models). On XLA:CPU the loop's stacked residuals, slices and
      bookkeeping take a fifth of a 2-layer learner step (BENCHMARKS.md).
    backward_recompute: the attention core (``attn_impl="xla"``) and the
      gated MLP keep only their inputs (q, k, v; gate and up) for the
      backward and recompute the rest there
      (:func:`agentic_rl.model.remat.recompute_in_backward`): the same
      values and gradients bit for bit, a third fewer temporaries in a
      learner step; False keeps autodiff's residuals.
    lora_rank: r of the low-rank adapters (LoRA, Hu et al. 2021), 0 for none.
      A targeted projection ``W`` computes ``W x + (lora_alpha / r) B(A x)``
      with ``A`` ``[in, r]`` and ``B`` ``[r, out]`` (zero at init, so the
      adapted model starts equal to its base); the trainer then updates only
      ``A`` and ``B`` (:mod:`agentic_rl.model.lora`).
    lora_alpha: the adapters' scale is ``lora_alpha / lora_rank``.
    lora_targets: which projections get adapters, a subset of
      :data:`LORA_TARGETS`.
    lora_dtype: dtype the adapters are stored in (the base stays in
      ``param_dtype``, e.g. bfloat16, with float32 adapters).
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  mlp_activation: str = "silu"
  norm_eps: float = 1e-6
  norm_plus_one: bool = False
  rope_theta: float = 10_000.0
  local_rope_theta: float | None = None
  rope_scaling_factor: float = 1.0
  rope_llama3: tuple[float, float, float, int] | None = None
  query_pre_attn_scalar: float | None = None
  qkv_bias: bool = False
  qk_norm: bool = False
  post_norms: bool = False
  tie_embeddings: bool = False
  embed_scale: bool = False
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  sliding_windows: tuple[int | None, ...] | None = None
  dtype: Any = "float32"
  param_dtype: Any = "float32"
  attn_impl: str = "xla"
  remat: bool = False
  scan_unroll: int | None = None
  backward_recompute: bool = True
  # LoRA adapters (agentic_rl.model.lora).
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = LORA_TARGETS
  lora_dtype: Any = "float32"

  def __post_init__(self):
    # Lists are unhashable (and jit needs a hashable static config).
    if isinstance(self.sliding_windows, list):
      object.__setattr__(self, "sliding_windows", tuple(self.sliding_windows))
    if isinstance(self.rope_llama3, list):
      object.__setattr__(self, "rope_llama3", tuple(self.rope_llama3))
    if isinstance(self.lora_targets, list):
      object.__setattr__(self, "lora_targets", tuple(self.lora_targets))

  # --- presets ---------------------------------------------------------------

  @classmethod
  def tiny(cls, **overrides) -> TransformerConfig:
    """A 2-layer GQA model for tests (26.8K parameters)."""
    base = dict(vocab_size=128, d_model=32, n_layers=2, n_heads=4,
                n_kv_heads=2, head_dim=8, mlp_dim=64)
    return cls(**{**base, **overrides})

  @classmethod
  def llama_10m(cls, **overrides) -> TransformerConfig:
    """A Llama-style benchmark model: 9.83M parameters.

    Hidden 320, 8 layers, 5 heads of 64 (MHA), SwiGLU width 768, vocab 1024,
    untied unembedding.
    """
    base = dict(vocab_size=1024, d_model=320, n_layers=8, n_heads=5,
                n_kv_heads=5, head_dim=64, mlp_dim=768)
    return cls(**{**base, **overrides})

  @classmethod
  def llama_10m_gqa(cls, **overrides) -> TransformerConfig:
    """:meth:`llama_10m`'s GQA sibling: 10.2M parameters.

    Hidden 384, 6 layers, 6 query heads of 64 sharing 2 key/value heads,
    SwiGLU width 1024, vocab 1024, untied unembedding: a KV cache of 6 KB
    per token against ``llama_10m``'s 20 KB.
    """
    base = dict(vocab_size=1024, d_model=384, n_layers=6, n_heads=6,
                n_kv_heads=2, head_dim=64, mlp_dim=1024)
    return cls(**{**base, **overrides})

  # --- derived ---------------------------------------------------------------

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def params_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  @property
  def lora_scale(self) -> float:
    """``lora_alpha / lora_rank``, the adapters' scale (0.0 without LoRA)."""
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  def lora_adapts(self, name: str) -> bool:
    """Whether the projection ``name`` (e.g. "wq") has LoRA adapters."""
    return self.lora_rank > 0 and name in self.lora_targets

  @property
  def has_sliding_windows(self) -> bool:
    return self.sliding_windows is not None and any(
        w is not None for w in self.sliding_windows)

  @property
  def has_local_rope(self) -> bool:
    """Sliding-window layers use a RoPE of their own (``local_rope_theta``)."""
    return self.local_rope_theta is not None and self.has_sliding_windows

  @property
  def query_scale(self) -> float | None:
    """``sqrt(head_dim / query_pre_attn_scalar)``, or None when it is 1."""
    s = self.query_pre_attn_scalar
    if s is None or s == self.head_dim:
      return None
    return (self.head_dim / s) ** 0.5

  def layer_windows(self) -> np.ndarray:
    """int32 ``[L]`` per-layer windows, global layers as ``NO_WINDOW``."""
    windows = self.sliding_windows or (None,) * self.n_layers
    return np.array([NO_WINDOW if w is None else w for w in windows], np.int32)

  # --- validation ------------------------------------------------------------

  def resolved(self, platform: str | None = None) -> TransformerConfig:
    """This config with ``attn_impl`` resolved for ``platform`` (None: the
    one being lowered for): ``"auto"`` becomes a backend, and one that
    cannot run there raises ``ValueError`` naming the fix
    (:func:`agentic_rl.kernels.backends.resolve`)."""
    impl = backends.resolve(backends.ATTENTION, self.attn_impl, on=platform)
    return dataclasses.replace(self, attn_impl=impl)

  def validate(self) -> TransformerConfig:
    """Raise ``ValueError`` naming the first problem; return self if fine."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                 "head_dim", "mlp_dim"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) \
          or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
          f"({self.n_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"mlp_activation must be one of {MLP_ACTIVATIONS}, "
                       f"got {self.mlp_activation!r}")
    backends.check_name(backends.ATTENTION, self.attn_impl)
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
    if not self.rope_theta > 0:
      raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
    for name in ("local_rope_theta", "query_pre_attn_scalar"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not value > 0):
        raise ValueError(f"{name} must be None or > 0, got {value!r}")
    if isinstance(self.rope_scaling_factor, bool) or not self.rope_scaling_factor > 0:
      raise ValueError(
          f"rope_scaling_factor must be > 0, got {self.rope_scaling_factor!r}")
    if self.rope_llama3 is not None:
      if len(self.rope_llama3) != 4 or not all(v > 0 for v in self.rope_llama3) or not (
          self.rope_llama3[2] > self.rope_llama3[1]):
        raise ValueError("rope_llama3 must be (factor, low_freq_factor, high_freq_factor, "
                         "original_max_position_embeddings), all > 0 and high > low, got "
                         f"{self.rope_llama3!r}")
      if self.rope_scaling_factor != 1.0:
        raise ValueError("rope_llama3 and rope_scaling_factor are two RoPE scalings: "
                         "set one")
    if self.scan_unroll is not None and (
        not isinstance(self.scan_unroll, (int, np.integer))
        or isinstance(self.scan_unroll, bool) or self.scan_unroll < 1):
      raise ValueError(f"scan_unroll must be None or an int >= 1, got {self.scan_unroll!r}")
    for name in ("attn_logit_softcap", "final_logit_softcap"):
      cap = getattr(self, name)
      if cap is not None and not cap > 0:
        raise ValueError(f"{name} must be None or > 0, got {cap}")
    if self.sliding_windows is not None:
      if len(self.sliding_windows) != self.n_layers:
        raise ValueError(
            f"sliding_windows has {len(self.sliding_windows)} entries but "
            f"n_layers is {self.n_layers}")
      for i, w in enumerate(self.sliding_windows):
        if w is not None and (not isinstance(w, (int, np.integer))
                              or isinstance(w, bool) or not 0 < w < NO_WINDOW):
          raise ValueError(
              f"sliding_windows[{i}] must be None or an int in "
              f"[1, {NO_WINDOW}), got {w!r}")
    self._validate_lora()
    for name in ("dtype", "param_dtype", "lora_dtype"):
      try:
        dt = jnp.dtype(getattr(self, name))
      except TypeError as e:
        raise ValueError(f"{name} is not a dtype: {getattr(self, name)!r}") from e
      if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype, got {dt}")
    return self

  def _validate_lora(self) -> None:
    rank = self.lora_rank
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank < 0:
      raise ValueError(f"lora_rank must be an int >= 0 (0: no adapters), got {rank!r}")
    if isinstance(self.lora_alpha, bool) or not isinstance(
        self.lora_alpha, (int, float, np.number)) or not self.lora_alpha > 0:
      raise ValueError(f"lora_alpha must be a number > 0 (the adapters' scale is "
                       f"lora_alpha / lora_rank), got {self.lora_alpha!r}")
    targets = self.lora_targets
    if isinstance(targets, str) or not isinstance(targets, tuple):
      raise ValueError(f"lora_targets must be a tuple of projection names from "
                       f"{LORA_TARGETS}, got {targets!r}")
    if unknown := [t for t in targets if t not in LORA_TARGETS]:
      raise ValueError(f"lora_targets has unknown projections {unknown}; valid: "
                       f"{', '.join(LORA_TARGETS)}")
    if len(set(targets)) != len(targets):
      raise ValueError(f"lora_targets names a projection twice: {targets!r}")
    if rank and not targets:
      raise ValueError("lora_targets is empty with lora_rank > 0: name at least one "
                       f"projection of {LORA_TARGETS}, or set lora_rank=0")
