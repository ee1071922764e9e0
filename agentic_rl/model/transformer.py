"""The decoder-only policy transformer as pure functions over a params pytree.

Params are a nested dict of arrays in ``config.param_dtype``; the per-layer
weights are stacked on a leading ``layers`` axis and :func:`forward` applies
them with ``lax.scan``, unrolled by default (``config.scan_unroll``; 1 gives
one compiled layer body, whatever the depth).
Incremental decoding (``kv_cache``) unrolls the layers instead, over one
cache buffer per layer, and takes :func:`unstack_layers` params. Compute
runs in ``config.dtype``; RMSNorm, RoPE and the softmax run in fp32; logits
are fp32.

Layout (D model, H query heads, K kv heads, Dh head dim, F mlp, V vocab,
L layers)::

  embed [V, D]                     final_norm [D]      unembed [D, V] (untied)
  layers/attn_norm [L, D]          layers/mlp_norm [L, D]
  layers/wq [L, D, H, Dh]          layers/w_gate [L, D, F]
  layers/wk, wv [L, D, K, Dh]      layers/w_up [L, D, F]
  layers/wo [L, H, Dh, D]          layers/w_down [L, F, D]
  layers/bq [L, H, Dh], bk, bv [L, K, Dh]     (qkv_bias)
  layers/q_norm, k_norm [L, Dh]               (qk_norm)
  layers/post_attn_norm, post_mlp_norm [L, D]  (post_norms)
  layers/lora_<w>_a [L, in..., r]             (lora_rank r, each targeted w)
  layers/lora_<w>_b [L, r, out...]            e.g. lora_wq_a [L, D, r],
                                              lora_wq_b [L, r, H, Dh]

The building blocks below (``embed_tokens``, ``decoder_layer``,
``output_logits``, ``check_tokens``, ...) are shared with ``kv_cache``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from agentic_rl.kernels.reference import NO_WINDOW
from agentic_rl.model.attention import attention
from agentic_rl.model.config import LORA_TARGETS, TransformerConfig
from agentic_rl.model.remat import recompute_in_backward


Params = dict[str, Any]
# attend(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh) -> (out_BxTxHxDh, aux)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


# --- parameter table (one home for shapes, logical axes and init) -----------


def _param_table(config: TransformerConfig) -> dict[str, Any]:
  """Nested dict of ``(shape, axes, init)``; init is "ones", "zeros" or a std."""
  D, H, K, Dh = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
  F, V, L = config.mlp_dim, config.vocab_size, config.n_layers
  norm = "zeros" if config.norm_plus_one else "ones"
  layer = {
      "attn_norm": ((D,), ("embed",), norm),
      "wq": ((D, H, Dh), ("embed", "heads", "head_dim"), D ** -0.5),
      "wk": ((D, K, Dh), ("embed", "kv_heads", "head_dim"), D ** -0.5),
      "wv": ((D, K, Dh), ("embed", "kv_heads", "head_dim"), D ** -0.5),
      "wo": ((H, Dh, D), ("heads", "head_dim", "embed"), (H * Dh) ** -0.5),
      "mlp_norm": ((D,), ("embed",), norm),
      "w_gate": ((D, F), ("embed", "mlp"), D ** -0.5),
      "w_up": ((D, F), ("embed", "mlp"), D ** -0.5),
      "w_down": ((F, D), ("mlp", "embed"), F ** -0.5),
  }
  if config.qkv_bias:
    layer["bq"] = ((H, Dh), ("heads", "head_dim"), "zeros")
    layer["bk"] = ((K, Dh), ("kv_heads", "head_dim"), "zeros")
    layer["bv"] = ((K, Dh), ("kv_heads", "head_dim"), "zeros")
  if config.qk_norm:
    layer["q_norm"] = ((Dh,), ("head_dim",), norm)
    layer["k_norm"] = ((Dh,), ("head_dim",), norm)
  if config.post_norms:
    layer["post_attn_norm"] = ((D,), ("embed",), norm)
    layer["post_mlp_norm"] = ((D,), ("embed",), norm)
  layer.update(_lora_entries(layer, config))
  table = {
      "embed": ((V, D), ("vocab", "embed"), D ** -0.5),
      "layers": {name: ((L, *shape), ("layers", *axes), init)
                 for name, (shape, axes, init) in layer.items()},
      "final_norm": ((D,), ("embed",), norm),
  }
  if not config.tie_embeddings:
    table["unembed"] = ((D, V), ("embed", "vocab"), D ** -0.5)
  return table


def _lora_entries(layer: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
  """LoRA's ``lora_<w>_a`` ``[in..., r]`` (``N(0, 1 / fan_in)``) and
  ``lora_<w>_b`` ``[r, out...]`` (zeros) for each targeted projection ``w``
  of one layer's table; the rank axis is "lora_rank" (replicated)."""
  entries = {}
  for name in LORA_TARGETS:
    if not config.lora_adapts(name):
      continue
    shape, axes, _ = layer[name]
    n_in = 2 if name == "wo" else 1  # wo contracts (H, Dh); the others D or F
    r = config.lora_rank
    entries[f"lora_{name}_a"] = ((*shape[:n_in], r), (*axes[:n_in], "lora_rank"),
                                 math.prod(shape[:n_in]) ** -0.5)
    entries[f"lora_{name}_b"] = ((r, *shape[n_in:]), ("lora_rank", *axes[n_in:]), "zeros")
  return entries


def is_adapter_name(name: str) -> bool:
  """Whether a ``layers`` key names a LoRA adapter (``lora_<w>_a`` / ``_b``)."""
  return name.startswith("lora_")


def _is_entry(x) -> bool:
  return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


def init_params(config: TransformerConfig, key: jax.Array) -> Params:
  """Random parameters (nested dict of ``param_dtype`` arrays).

  Projections are ``N(0, fan_in ** -0.5)``, the embedding (and untied
  unembedding) ``N(0, d_model ** -0.5)``, biases zero, norm scales one (zero
  with ``norm_plus_one``, so the scale ``1 + w`` starts at one). Runs as one
  jitted computation (one compile per config, not one per array shape).

  With ``lora_rank > 0`` the base is the one drawn without LoRA from ``key``
  and the adapters are :func:`init_adapters` of ``fold_in(key, 1)``.
  """
  config.validate()
  params = _init_params(config, key)
  if config.lora_rank:
    adapters = init_adapters(config, jax.random.fold_in(key, 1))
    params = {**params, "layers": {**params["layers"], **adapters["layers"]}}
  return params


def init_adapters(config: TransformerConfig, key: jax.Array) -> Params:
  """Fresh LoRA adapters ``{"layers": {lora_<w>_a, lora_<w>_b, ...}}`` in
  ``lora_dtype``: ``A ~ N(0, 1 / fan_in)``, ``B = 0`` (the adapted model
  starts equal to its base)."""
  config.validate()
  return _init_params(config, key, adapters=True)


def _table_part(config: TransformerConfig, adapters: bool) -> dict[str, Any]:
  """The parameter table without the adapters, or only them (``adapters``)."""
  table = _param_table(config)
  layers = {k: v for k, v in table["layers"].items() if is_adapter_name(k) == adapters}
  return {"layers": layers} if adapters else {**table, "layers": layers}


@functools.partial(jax.jit, static_argnums=0, static_argnames="adapters")
def _init_params(config: TransformerConfig, key: jax.Array, *,
                 adapters: bool = False) -> Params:
  # One normal draw for all random leaves, sliced up: XLA:CPU compiles one
  # random kernel per shape, which takes seconds each.
  dtype = jnp.dtype(config.lora_dtype) if adapters else config.params_dtype
  entries, treedef = jax.tree.flatten(_table_part(config, adapters), is_leaf=_is_entry)
  sizes = [math.prod(shape) for shape, _, init in entries
           if not isinstance(init, str)]
  z = jax.random.normal(key, (sum(sizes),), jnp.float32)
  offset, leaves = 0, []
  for shape, _, init in entries:
    if init == "ones":
      leaves.append(jnp.ones(shape, dtype))
    elif init == "zeros":
      leaves.append(jnp.zeros(shape, dtype))
    else:
      size = math.prod(shape)
      leaves.append((init * z[offset:offset + size].reshape(shape)).astype(dtype))
      offset += size
  return jax.tree.unflatten(treedef, leaves)


def param_axes(config: TransformerConfig) -> Params:
  """Same tree as :func:`init_params`, leaves are tuples of logical axis names.

  Names: "layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab",
  "lora_rank".
  """
  config.validate()
  return jax.tree.map(lambda e: e[1], _param_table(config), is_leaf=_is_entry)


# --- building blocks ----------------------------------------------------------


def rms_norm(x: jax.Array, w: jax.Array, *, eps: float,
             plus_one: bool) -> jax.Array:
  """``x / sqrt(mean(x^2) + eps) * s`` over the last axis, ``s = w`` or
  ``1 + w`` (Gemma); computed in fp32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale = w.astype(jnp.float32)
  if plus_one:
    scale = 1.0 + scale
  return (y * scale).astype(x.dtype)


Rope = tuple[jax.Array, jax.Array]  # (cos, sin), each [B, T, 1, Dh / 2]


def rope_tables(positions_BxT: jax.Array, head_dim: int, theta: float, *,
                table_len: int | None = None, factor: float = 1.0,
                llama3: tuple[float, float, float, int] | None = None) -> Rope:
  """fp32 ``(cos a, sin a)`` ``[B, T, 1, Dh/2]`` with
  ``a_i = pos / factor / theta ** (2i / Dh)`` (``factor``: linear RoPE
  scaling; ``llama3``: the frequencies rescaled as
  ``TransformerConfig.rope_llama3`` says); computed once per forward and
  shared by every layer's q and k.

  With ``table_len`` (positions in ``[0, table_len)``; others are clipped),
  the tables are computed for all ``table_len`` positions and gathered by
  position: the same values, but in a decode loop XLA computes the table once
  (it does not depend on the step) where it would otherwise recompute cos
  and sin inside each of the 2L rotation fusions of every step.
  """
  if table_len is not None:
    cos_S, sin_S = rope_tables(jnp.arange(table_len)[None], head_dim, theta,
                               factor=factor, llama3=llama3)
    at = jnp.clip(positions_BxT, 0, table_len - 1)
    return cos_S[0][at], sin_S[0][at]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32)
                              / head_dim))
  if factor != 1.0:
    inv_freq = inv_freq / factor
  if llama3 is not None:
    inv_freq = _llama3_frequencies(inv_freq, *llama3)
  angles_BxTxHalf = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  return (jnp.cos(angles_BxTxHalf)[:, :, None, :],
          jnp.sin(angles_BxTxHalf)[:, :, None, :])


def _llama3_frequencies(inv_freq: jax.Array, factor: float, low: float, high: float,
                        context: int) -> jax.Array:
  """Llama 3.1's RoPE frequencies (``TransformerConfig.rope_llama3``): long
  wavelengths slowed by ``factor``, short ones kept, smoothly in between."""
  wavelen = 2 * math.pi / inv_freq
  smooth = (context / wavelen - low) / (high - low)
  between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  return jnp.where(wavelen < context / high, inv_freq,
                   jnp.where(wavelen > context / low, inv_freq / factor, between))


Ropes = tuple[Rope, Rope | None]  # (global, local: None without local_rope_theta)


def model_ropes(positions_BxT: jax.Array, config: TransformerConfig, *,
                table_len: int | None = None) -> Ropes:
  """The RoPE tables of ``config``'s layers (:func:`rope_tables`): the
  global one (``rope_theta``, ``rope_scaling_factor``) and, when
  ``config.has_local_rope``, the sliding-window layers' one
  (``local_rope_theta``, unscaled)."""
  tables = functools.partial(rope_tables, positions_BxT, config.head_dim,
                             table_len=table_len)
  glob = tables(config.rope_theta, factor=config.rope_scaling_factor, llama3=config.rope_llama3)
  local = tables(config.local_rope_theta) if config.has_local_rope else None
  return glob, local


def layer_rope(ropes: Ropes, window) -> Rope:
  """The rope of a layer with ``window`` (None or ``NO_WINDOW``: global).

  ``window`` may be a Python int / None (unrolled layers: a static choice)
  or a traced int32 scalar (the :func:`forward` scan: a select).
  """
  glob, local = ropes
  if local is None or window is None:
    return glob
  if isinstance(window, (int, np.integer)):
    return glob if window == NO_WINDOW else local
  is_local = window != NO_WINDOW
  return tuple(jnp.where(is_local, l, g) for g, l in zip(glob, local))


def rotate(x_BxTxNxD: jax.Array, rope: Rope) -> jax.Array:
  """Rotary embedding, Hugging Face "rotate_half" convention (Su et al. 2021).

  With ``x = [x1, x2]`` split in halves along D and ``rope = (cos a, sin a)``
  (:func:`rope_tables`): ``[x1 cos a - x2 sin a, x2 cos a + x1 sin a]``.
  Computed in fp32, returned in x's dtype.
  """
  cos, sin = rope
  x1, x2 = jnp.split(x_BxTxNxD.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxD.dtype)


def apply_rope(x_BxTxNxD: jax.Array, positions_BxT: jax.Array,
               theta: float) -> jax.Array:
  """:func:`rotate` by the angles of ``positions_BxT``."""
  return rotate(x_BxTxNxD,
                rope_tables(positions_BxT, x_BxTxNxD.shape[-1], theta))


def concrete_or_none(x) -> np.ndarray | None:
  """x as a numpy array, or None when it is traced (under jit/vmap)."""
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return None


def check_tokens(tokens: jax.Array, vocab_size: int, ndim: int) -> jax.Array:
  """Check token ids' rank and dtype and, when concrete, their range.

  Under ``jit`` the values are traced and cannot be checked: the caller
  guarantees ``0 <= id < vocab_size`` (an out-of-range id embeds as NaN).
  """
  tokens = jnp.asarray(tokens)
  if tokens.ndim != ndim:
    raise ValueError(f"tokens must have {ndim} dims, got shape {tokens.shape}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
  values = concrete_or_none(tokens)
  if values is not None and values.size:
    lo, hi = values.min(), values.max()
    if lo < 0 or hi >= vocab_size:
      raise ValueError(f"token ids must be in [0, {vocab_size}), "
                       f"got values in [{lo}, {hi}]")
  return tokens


def check_shape(name: str, x: jax.Array | None, shape: tuple[int, ...]):
  """ValueError unless ``x`` is None or an integer array of ``shape``."""
  if x is None:
    return
  if tuple(jnp.shape(x)) != shape:
    raise ValueError(f"{name} must have shape {shape}, got {jnp.shape(x)}")
  if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
    raise ValueError(f"{name} must be integers, got {jnp.result_type(x)}")


def embed_tokens(params: Params, tokens_BxT: jax.Array,
                 config: TransformerConfig) -> jax.Array:
  """``embed[tokens]`` in compute dtype (``* sqrt(d_model)`` with embed_scale)."""
  dtype = config.compute_dtype
  x_BxTxD = jnp.take(params["embed"], tokens_BxT, axis=0).astype(dtype)
  if config.embed_scale:
    x_BxTxD = x_BxTxD * jnp.asarray(config.d_model ** 0.5, dtype)
  return x_BxTxD


def _dense(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
  """``einsum(spec, x, w)`` for a projection whose contracted dims are x's
  last and w's first ones (``"btd,dhk->bthk"``), as one 2-D matmul
  ``[N, I] @ [I, O]`` between reshapes, in x's dtype.

  The same products (bit for bit), but in 2-D XLA:CPU computes the weight
  gradient ``x^T dy`` with a transposed GEMM operand, where for the einsum
  over ``[B, T, ...]`` it first copies an activation into a transposed
  layout, for every projection (a third of a learner step, BENCHMARKS.md).
  Below float32 the matmul is :func:`_matmul_low`.
  """
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  n = sum(c in ws for c in xs)
  if xs[len(xs) - n:] != ws[:n] or out != xs[:len(xs) - n] + ws[n:]:
    raise ValueError(f"{spec!r} does not contract x's last dims with w's first ones")
  lead, out_dims = x.shape[:x.ndim - n], w.shape[n:]
  x_NxI = x.reshape(math.prod(lead), -1)
  w_IxO = w.reshape(math.prod(w.shape[:n]), -1)
  if jnp.finfo(x.dtype).bits < 32:
    y = _matmul_low(x_NxI, w_IxO)
  else:
    y = jnp.dot(x_NxI, w_IxO.astype(x.dtype))
  return y.reshape(*lead, *out_dims)


@jax.custom_vjp
def _matmul_low(x_NxI: jax.Array, w_IxO: jax.Array) -> jax.Array:
  """``x @ w`` in x's (16-bit) dtype with float32 accumulation, w cast to
  x's dtype; the backward's two matmuls take 16-bit operands too and
  accumulate in float32, as mixed-precision training does (``dx`` in x's
  dtype, ``dw`` in w's: float32 master weights get a float32 gradient).

  Written out because autodiff of a float32-accumulating matmul gives a
  float32 cotangent, whose backward matmuls then run in float32; and on
  XLA:CPU a 16-bit matmul reaches the CPU's bfloat16 units (AMX,
  AVX512-BF16, through YNNPACK) only with a float32 result (with a 16-bit
  one, Eigen computes it in float32; XLA:CPU still does so for ``dw``,
  whose operands are contracted over their rows).
  """
  return jnp.dot(x_NxI, w_IxO.astype(x_NxI.dtype),
                 preferred_element_type=jnp.float32).astype(x_NxI.dtype)


def _matmul_low_fwd(x_NxI, w_IxO):
  return _matmul_low(x_NxI, w_IxO), (x_NxI, w_IxO)


def _matmul_low_bwd(res, dy_NxO):
  x_NxI, w_IxO = res
  low = x_NxI.dtype
  dy_NxO = dy_NxO.astype(low)
  dx_NxI = lax.dot_general(dy_NxO, w_IxO.astype(low), (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(low)
  dw_IxO = lax.dot_general(x_NxI, dy_NxO, (((0,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(w_IxO.dtype)
  return dx_NxI, dw_IxO


_matmul_low.defvjp(_matmul_low_fwd, _matmul_low_bwd)


def _project(x: jax.Array, p: Params, name: str, spec: str,
             config: TransformerConfig) -> jax.Array:
  """The projection ``p[name]`` of ``x`` (``_dense(x, W, spec)``), with its
  LoRA adapters where ``config`` targets it (Hu et al. 2021)::

    W x + (alpha / r) B (A x),   A = lora_<name>_a [in..., r],
                                 B = lora_<name>_b [r, out...]

  The low-rank path runs in the compute dtype, as the base product.
  """
  y = _dense(x, p[name], spec)
  if not config.lora_adapts(name):
    return y
  return y + _lora_delta(x, p[f"lora_{name}_a"], p[f"lora_{name}_b"], spec,
                         config.lora_scale)


def _lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, spec: str,
                scale: float) -> jax.Array:
  """``scale * B(A x)`` for the projection ``spec`` (``_dense``'s) whose
  weight factors as ``A`` ``[in..., r]`` times ``B`` ``[r, out...]``."""
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  n = sum(c in ws for c in xs)
  r = next(c for c in "rzyxwv" if c not in spec)
  lead, contracted, outs = xs[:len(xs) - n], ws[:n], ws[n:]
  h = _dense(x, a, f"{xs},{contracted}{r}->{lead}{r}")
  delta = _dense(h, b, f"{lead}{r},{r}{outs}->{out}")
  return delta * jnp.asarray(scale, delta.dtype)


def decoder_layer(x_BxTxD: jax.Array, p: Params, rope: Rope,
                  config: TransformerConfig,
                  attend: AttendFn) -> tuple[jax.Array, Any]:
  """One pre-norm layer on one layer's params ``p`` (no ``layers`` axis).

  ``rope``: :func:`rope_tables` of the tokens' positions (this layer's,
  :func:`layer_rope`).

  ``attend(q, k, v)`` (q, k after qk-norm and RoPE, q times
  ``config.query_scale`` when set) returns the attention output and an
  auxiliary value (e.g. an updated KV cache) passed through. With
  ``post_norms`` the attention and MLP outputs are RMS-normed before their
  residual adds.
  """
  eps, plus_one = config.norm_eps, config.norm_plus_one
  h = rms_norm(x_BxTxD, p["attn_norm"], eps=eps, plus_one=plus_one)
  q_BxTxHxDh = _project(h, p, "wq", "btd,dhk->bthk", config)
  k_BxTxKxDh = _project(h, p, "wk", "btd,dhk->bthk", config)
  v_BxTxKxDh = _project(h, p, "wv", "btd,dhk->bthk", config)
  if config.qkv_bias:
    q_BxTxHxDh += p["bq"].astype(h.dtype)
    k_BxTxKxDh += p["bk"].astype(h.dtype)
    v_BxTxKxDh += p["bv"].astype(h.dtype)
  if config.qk_norm:
    q_BxTxHxDh = rms_norm(q_BxTxHxDh, p["q_norm"], eps=eps, plus_one=plus_one)
    k_BxTxKxDh = rms_norm(k_BxTxKxDh, p["k_norm"], eps=eps, plus_one=plus_one)
  q_BxTxHxDh = rotate(q_BxTxHxDh, rope)
  k_BxTxKxDh = rotate(k_BxTxKxDh, rope)
  if config.query_scale is not None:
    q_BxTxHxDh = q_BxTxHxDh * jnp.asarray(config.query_scale, q_BxTxHxDh.dtype)
  o_BxTxHxDh, aux = attend(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh)
  attn_BxTxD = _project(o_BxTxHxDh, p, "wo", "bthk,hkd->btd", config)
  if config.post_norms:
    attn_BxTxD = rms_norm(attn_BxTxD, p["post_attn_norm"], eps=eps,
                          plus_one=plus_one)
  x_BxTxD = x_BxTxD + attn_BxTxD

  h = rms_norm(x_BxTxD, p["mlp_norm"], eps=eps, plus_one=plus_one)
  gate_BxTxF = _project(h, p, "w_gate", "btd,df->btf", config)
  up_BxTxF = _project(h, p, "w_up", "btd,df->btf", config)
  down_ab = ((p["lora_w_down_a"], p["lora_w_down_b"]) if config.lora_adapts("w_down")
             else (None, None))
  down = functools.partial(_gated_down, activation=config.mlp_activation,
                           lora_scale=config.lora_scale)
  if config.backward_recompute:
    # Keeps gate and up (not act(gate), the product, ...) for the backward.
    mlp_BxTxD = recompute_in_backward(down, gate_BxTxF, up_BxTxF, p["w_down"], *down_ab)
  else:
    mlp_BxTxD = down(gate_BxTxF, up_BxTxF, p["w_down"], *down_ab)
  if config.post_norms:
    mlp_BxTxD = rms_norm(mlp_BxTxD, p["post_mlp_norm"], eps=eps,
                         plus_one=plus_one)
  return x_BxTxD + mlp_BxTxD, aux


def _gated_down(gate_BxTxF, up_BxTxF, w_down, lora_a=None, lora_b=None, *,
                activation: str, lora_scale: float = 0.0) -> jax.Array:
  """``down(act(gate) * up)``, plus LoRA's ``scale * B(A u)`` on the unit
  ``u`` when given the adapters ``lora_a`` [F, r], ``lora_b`` [r, D]."""
  unit_BxTxF = gated_unit(gate_BxTxF, up_BxTxF, activation=activation)
  y = _dense(unit_BxTxF, w_down, "btf,fd->btd")
  if lora_a is None:
    return y
  return y + _lora_delta(unit_BxTxF, lora_a, lora_b, "btf,fd->btd", lora_scale)


def gated_unit(gate: jax.Array, up: jax.Array, *, activation: str) -> jax.Array:
  """``act(gate) * up``: SiLU (SwiGLU) or tanh-approximate GELU (GeGLU)."""
  if activation == "silu":
    act = jax.nn.silu(gate)
  else:
    act = jax.nn.gelu(gate, approximate=True)
  return act * up


def unembedding(params: Params, config: TransformerConfig) -> jax.Array:
  """``[D, V]`` output matrix in compute dtype: ``embed.T`` when tied.

  ``logits = final_logit_softcap(hidden @ unembedding)`` with fp32
  accumulation reproduces :func:`forward`'s logits from its hidden states.
  """
  w_DxV = params["embed"].T if config.tie_embeddings else params["unembed"]
  return w_DxV.astype(config.compute_dtype)


def output_logits(params: Params, x_BxTxD: jax.Array,
                  config: TransformerConfig) -> tuple[jax.Array, jax.Array]:
  """Final norm then fp32 logits; returns ``(logits_BxTxV, hidden_BxTxD)``."""
  hidden_BxTxD = rms_norm(x_BxTxD, params["final_norm"], eps=config.norm_eps,
                          plus_one=config.norm_plus_one)
  logits_BxTxV = jnp.einsum("btd,dv->btv", hidden_BxTxD,
                            unembedding(params, config),
                            preferred_element_type=jnp.float32)
  cap = config.final_logit_softcap
  if cap is not None:
    logits_BxTxV = cap * jnp.tanh(logits_BxTxV / cap)
  return logits_BxTxV, hidden_BxTxD


def layer_params(params: Params, i: int) -> Params:
  """Layer ``i``'s weights, from stacked or :func:`unstack_layers` params."""
  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return layers[i]
  return jax.tree.map(lambda x: x[i], layers)


def unstack_layers(params: Params) -> Params:
  """``params`` with ``layers`` as a tuple of per-layer dicts.

  For the unrolled incremental decode (``kv_cache``): call it once, outside a
  decode loop, since XLA may copy weights sliced inside a loop body at every
  step (BENCHMARKS.md). Idempotent.
  """
  if isinstance(params["layers"], (tuple, list)):
    return params
  n = jax.tree.leaves(params["layers"])[0].shape[0]
  return {**params, "layers": tuple(layer_params(params, i) for i in range(n))}


def layer_window(window: jax.Array, config: TransformerConfig):
  """The scanned per-layer window, or None (static) when all are global."""
  return window if config.has_sliding_windows else None


# --- forward ------------------------------------------------------------------


def forward(
    params: Params,
    tokens_BxT: jax.Array,
    config: TransformerConfig,
    *,
    positions_BxT: jax.Array | None = None,
    segment_ids_BxT: jax.Array | None = None,
    return_hidden: bool = False,
    layer_params_constraint: Callable[[Params], Params] | None = None,
):
  """Full-sequence forward pass.

  Args:
    params: from :func:`init_params` (or ``hf.load_hf_checkpoint``).
    tokens_BxT: int token ids in ``[0, vocab_size)`` (checked when concrete;
      under jit the caller guarantees it).
    config: the model config (static under jit).
    positions_BxT: int RoPE positions; default ``arange(T)`` per row. They
      drive RoPE only: the mask is causal in sequence order.
    segment_ids_BxT: int ids; tokens attend only within their segment, so
      packed sequences (or padding, e.g. id 0) stay isolated.
    return_hidden: also return the final-normed hidden state.
    layer_params_constraint: applied to each layer's weights (a dict of
      arrays without the ``layers`` axis) where the layer uses them, e.g. a
      ``jax.lax.with_sharding_constraint`` that gathers them (ZeRO-3: one
      layer's weights gathered at a time, not all of them before the first).

  Returns:
    fp32 ``logits_BxTxV``, or ``(logits_BxTxV, hidden_BxTxD)`` with hidden in
    compute dtype (``logits = softcap(hidden @ unembedding(params, config))``).
  """
  config.validate()
  tokens_BxT = check_tokens(tokens_BxT, config.vocab_size, ndim=2)
  B, T = tokens_BxT.shape
  check_shape("positions_BxT", positions_BxT, (B, T))
  check_shape("segment_ids_BxT", segment_ids_BxT, (B, T))
  if positions_BxT is None:
    positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  ropes = model_ropes(positions_BxT, config)

  def body(x_BxTxD, layer):
    p, window = layer
    if layer_params_constraint is not None:
      p = layer_params_constraint(p)

    def attend(q, k, v):
      out = attention(q, k, v, impl=config.attn_impl,
                      recompute=config.backward_recompute,
                      segment_ids_BxT=segment_ids_BxT,
                      sliding_window=layer_window(window, config),
                      softcap=config.attn_logit_softcap)
      return out, None

    x_BxTxD, _ = decoder_layer(x_BxTxD, p, layer_rope(ropes, window), config,
                               attend)
    return x_BxTxD, None

  if config.remat:
    body = jax.checkpoint(body)
  x_BxTxD = embed_tokens(params, tokens_BxT, config)
  windows_L = jnp.asarray(config.layer_windows())
  x_BxTxD, _ = lax.scan(body, x_BxTxD, (params["layers"], windows_L),
                        unroll=config.scan_unroll or config.n_layers)
  logits_BxTxV, hidden_BxTxD = output_logits(params, x_BxTxD, config)
  if return_hidden:
    return logits_BxTxV, hidden_BxTxD
  return logits_BxTxV
