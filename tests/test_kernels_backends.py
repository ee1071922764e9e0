"""The backend dispatcher: config names, ``"auto"``, refusals and warnings
(:mod:`agentic_rl.kernels.backends`), and ``attn_impl="auto"`` through the
model and the trainer."""

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import kernels
from agentic_rl import model
from agentic_rl.kernels import backends
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from experiments.configs import default

ATT, LP = backends.ATTENTION, backends.LOGPROBS


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
  monkeypatch.setattr(backends, "_warned", set())


def test_auto_resolves_per_platform():
  assert jax.default_backend() == "cpu"
  assert backends.resolve(ATT, "auto") == "xla"
  assert backends.resolve(LP, "auto") == "xla"
  assert backends.resolve(ATT, "auto", on="gpu") == "triton"
  assert backends.resolve(ATT, "auto", on="cuda") == "triton"
  assert backends.resolve(LP, "auto", on="gpu") == "triton"
  with pytest.warns(backends.UnverifiedBackendWarning, match="never run"):
    assert backends.resolve(ATT, "auto", on="tpu") == "mosaic_tpu"
  assert backends.resolve(ATT, "auto", on="metal") == "xla"


@pytest.mark.parametrize("family,name,hardware", [
    (ATT, "triton", "a GPU"), (ATT, "cudnn", "an NVIDIA GPU"),
    (ATT, "mosaic_gpu", "a Hopper GPU"), (ATT, "mosaic_tpu", "a TPU"),
    (LP, "triton", "a GPU"), (LP, "mosaic_tpu", "a TPU")])
def test_a_backend_for_other_hardware_is_refused_on_cpu(family, name, hardware):
  field = {ATT: "attn_impl", LP: "logprob_impl"}[family]
  with pytest.raises(ValueError, match=(
      f"{field}='{name}' needs {hardware}.*platform is 'cpu'.*"
      f"{field}='auto' \\(here: 'xla'\\) or 'xla'")):
    backends.resolve(family, name)


def test_every_name_is_accepted_by_the_configs_and_runs_somewhere():
  def somewhere(family, name):  # a platform the backend runs on
    return (getattr(backends.BACKENDS[family].get(name), "platforms", None)
            or ("cpu",))[0]

  for name in kernels.ATTN_IMPLS:
    config = model.TransformerConfig.tiny(attn_impl=name).validate()
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", backends.UnverifiedBackendWarning)
      resolved = config.resolved(somewhere(ATT, name))
    assert resolved.attn_impl != "auto"
    if resolved.attn_impl not in ("xla", "xla_vjp"):
      assert backends.attention_kwargs(resolved.attn_impl)
  for name in kernels.LOGPROB_IMPLS:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", backends.UnverifiedBackendWarning)
      assert backends.logprob_kwargs(
          backends.resolve(LP, name, on=somewhere(LP, name)))
  with pytest.raises(ValueError, match="attn_impl must be one of"):
    model.TransformerConfig.tiny(attn_impl="cuda").validate()
  with pytest.raises(ValueError, match="logprob_impl must be one of"):
    backends.resolve(LP, "cuda")


def test_unverified_backends_warn_once_when_selected():
  with pytest.warns(backends.UnverifiedBackendWarning) as caught:
    for _ in range(3):
      backends.resolve(ATT, "mosaic_tpu", on="tpu")
      backends.resolve(ATT, "mosaic_gpu", on="gpu")
  assert sorted(str(w.message).split("=")[0] for w in caught) == [
      "attn_impl", "attn_impl"]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for name in ("xla", "xla_vjp", "triton", "cudnn", "pallas"):
      backends.resolve(ATT, name, on="gpu")
    backends.resolve(ATT, "pallas")  # interpreted on CPU: for tests


def test_auto_attention_is_the_reference_bit_for_bit_on_cpu():
  config = model.TransformerConfig.tiny(sliding_windows=(3, None))
  params = model.init_params(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)

  def loss(params, cfg):
    return jnp.sum(model.forward(params, tokens, cfg) ** 2)

  got = {impl: jax.value_and_grad(loss)(
      params, dataclasses.replace(config, attn_impl=impl))
         for impl in ("xla", "auto")}
  jax.tree.map(np.testing.assert_array_equal, got["xla"], got["auto"])


def _rl_only():
  cfg = default.get_config("tiny")
  cfg.stages = ("rl",)
  cfg.rl.iterations = 1
  cfg.eval.every = 100
  return cfg


@pytest.mark.slow
def test_train_with_auto_impls_matches_xla_on_cpu(tmp_path):
  """The default config's "auto" is the same program as "xla" on CPU: one
  RL iteration and the evaluation give the same metrics."""
  runs = {}
  for impl in ("auto", "xla"):
    cfg = _rl_only()
    cfg.model.update(attn_impl=impl, logprob_impl=impl)
    loop.train(cfg, str(tmp_path / impl))
    runs[impl] = metrics_lib.read_metrics(
        os.path.join(str(tmp_path / impl), "metrics.jsonl"))
  assert len(runs["auto"]) == len(runs["xla"]) > 0
  for auto, xla in zip(runs["auto"], runs["xla"]):
    keys = sorted(k for k in xla if not k.startswith("perf/")
                  and k != "wall_time")  # timings
    assert [auto[k] for k in keys] == [xla[k] for k in keys]


@pytest.mark.parametrize("field,name", [("attn_impl", "triton"),
                                        ("logprob_impl", "mosaic_tpu")])
def test_train_refuses_a_backend_for_other_hardware_before_building(
    field, name):
  cfg = _rl_only()
  cfg.model[field] = name
  with pytest.raises(config_lib.ConfigError,
                     match=f"config.model.{field}='{name}' needs"):
    loop.train(cfg, "/nonexistent-unused")
