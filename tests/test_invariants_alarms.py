"""Tests of the invariant alarms: bands, checks, console line, band controller, defaults."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.invariants import (Band, ExplorationConfig, ShiftConfig, SignalConfig,
                                   alarm_metrics, check_alarms, format_alarms)
from agentic_rl.invariants.alarms import band_update, validate_bands


def test_band_contains_and_validation():
  band = Band(0.1, 0.5)
  assert band.contains(0.1) and band.contains(0.5) and band.contains(0.3)
  assert not band.contains(0.05) and not band.contains(0.6)
  assert not band.contains(math.nan)
  assert Band(high=0.5).contains(-1e9) and Band(low=1.0).contains(1e9)
  with pytest.raises(ValueError, match="above"):
    Band(1.0, 0.0)
  with pytest.raises(ValueError, match="NaN"):
    Band(math.nan, 1.0)
  with pytest.raises(ValueError, match="number"):
    Band("0", 1.0)


def test_check_alarms_fires_outside_band_and_skips_missing():
  bands = {"signal/zero_variance_frac": Band(high=0.5),
           "explore/distinct_success_seqs_solved": Band(low=1.5),
           "eval/pass_at_k": Band(low=0.1)}
  metrics = {"signal/zero_variance_frac": jnp.float32(0.625),
             "explore/distinct_success_seqs_solved": np.float32(2.0),
             "shift/staleness_max": 3.0}
  alarms = check_alarms(metrics, bands)
  assert alarms == {"signal/zero_variance_frac": True,
                    "explore/distinct_success_seqs_solved": False}
  assert alarm_metrics(alarms) == {"alarm/signal/zero_variance_frac": 1.0,
                                   "alarm/explore/distinct_success_seqs_solved": 0.0}
  assert check_alarms({"signal/zero_variance_frac": math.nan}, bands) == {
      "signal/zero_variance_frac": True}


def test_format_alarms():
  bands = {"signal/zero_variance_frac": Band(high=0.5), "shift/staleness_max": Band(high=2)}
  line = format_alarms({"signal/zero_variance_frac": 0.625, "shift/staleness_max": 1.0}, bands)
  assert line.startswith("ALARM ")
  assert "signal/zero_variance_frac=0.625" in line and "0.5]" in line
  assert "staleness" not in line
  assert format_alarms({"signal/zero_variance_frac": 0.25}, bands) == ""


def test_default_bands_fire_on_the_issue_examples():
  bands = dict(SignalConfig().bands + ExplorationConfig().bands + ShiftConfig().bands)
  collapsed = {"signal/zero_variance_frac": 0.6, "explore/distinct_success_seqs_solved": 1.0,
               "shift/kl_behaviour_learner": 1e-4}
  assert check_alarms(collapsed, bands) == {"signal/zero_variance_frac": True,
                                            "explore/distinct_success_seqs_solved": True,
                                            "shift/kl_behaviour_learner": False}
  healthy = {"signal/zero_variance_frac": 0.3, "explore/distinct_success_seqs_solved": 2.5,
             "shift/kl_behaviour_learner": 1e-4}
  assert not any(check_alarms(healthy, bands).values())


def test_validate_bands():
  validate_bands((("signal/x", Band()),), "signal")
  with pytest.raises(ValueError, match="tuple"):
    validate_bands([("signal/x", Band())], "signal")
  with pytest.raises(ValueError, match="pair"):
    validate_bands((("signal/x", (0, 1)),), "signal")
  with pytest.raises(ValueError, match="twice"):
    validate_bands((("signal/x", Band()), ("signal/x", Band())), "signal")
  with pytest.raises(ValueError, match="invariant"):
    validate_bands((("shift/x", Band()),), "signal")


def test_band_update_directions_clipping_and_jit():
  band = Band(1.0, 2.0)
  update = jax.jit(band_update, static_argnums=(2, 3, 4, 5, 6))
  for fn in (band_update, update):
    np.testing.assert_allclose(fn(0.1, 0.5, band, 2.0, 0.01, 1.0, True), 0.2)
    np.testing.assert_allclose(fn(0.1, 3.0, band, 2.0, 0.01, 1.0, True), 0.05)
    np.testing.assert_allclose(fn(0.1, 1.5, band, 2.0, 0.01, 1.0, True), 0.1)
    np.testing.assert_allclose(fn(0.1, 0.5, band, 2.0, 0.01, 1.0, False), 0.05)
    np.testing.assert_allclose(fn(0.8, 0.5, band, 2.0, 0.01, 1.0, True), 1.0)
    np.testing.assert_allclose(fn(0.1, math.nan, band, 2.0, 0.01, 1.0, True), 0.1)
  with pytest.raises(ValueError, match="factor"):
    band_update(0.1, 0.5, band, 1.0, 0.01, 1.0)
  with pytest.raises(ValueError, match="knob_min"):
    band_update(0.1, 0.5, band, 2.0, 1.0, 0.5)
