"""The config converted once: ``settings.parse`` (typed, frozen, every
default in one place), the default config's size, and the section variants
that open a section to the command line."""

import dataclasses

import ml_collections
import pytest

from agentic_rl.train import config as config_lib
from agentic_rl.train import run as run_lib
from agentic_rl.train import settings
from experiments.configs import default


def _leaves(d) -> int:
  return sum(_leaves(v) if hasattr(v, "items") else 1 for v in d.values())


def test_the_default_config_is_small_and_every_section_opens():
  assert _leaves(default.get_config()) < 100
  assert _leaves(default.get_config("all")) > 200


@pytest.mark.parametrize("variant", ["", "tiny", "gem", "ledger", "smollm", "tiny,stagewise"])
def test_opening_sections_changes_no_setting(variant):
  """The keys a section variant adds are at their defaults: the run's
  settings are the same with every section open ("all") as without."""
  shown = settings.parse(default.get_config(variant))
  opened = settings.parse(default.get_config(",".join(filter(None, ("all", variant)))))
  # "all" adds the optional mechanisms' sections, off at their defaults.
  assert shown.parl is None and opened.parl == settings.ParlSettings()
  assert opened.reward_hooks == settings.RewardHooksSettings()
  assert dataclasses.replace(opened, parl=None, reward_hooks=None) == shown


def test_a_section_variant_opens_that_section_only():
  c = default.get_config("tiny,rl.signal")
  assert "ada_max_rounds" in c.rl.signal and "adaptive_staleness" not in c.rl.shift
  assert c.rl.signal.allocation == "dynamic"  # kept as the config set it
  c.rl.signal.ada_max_rounds = 2
  assert settings.parse(c)["rl"].signal.ada_max_rounds == 2
  c = default.get_config("rl.loss_kwargs")
  assert c.rl.loss_kwargs.ppo.eps_high == 0.28 and c.rl.loss_kwargs.cispo.eps_high == 4.0
  with pytest.raises(ValueError, match="unknown config variant 'rl.nope'"):
    default.get_config("rl.nope")


def test_parse_fills_defaults_and_refuses_unknown_keys():
  c = ml_collections.ConfigDict({"stages": ("rl",), "rl": {"kind": "rl", "group_size": 4}})
  s = settings.parse(c)
  assert s["rl"].group_size == 4 and s["rl"].iterations == settings.RLStage().iterations
  assert s.sampling == settings.SamplingSettings() and s.parl is None
  c.rl.grup_size = 4
  with pytest.raises(settings.ConfigError, match=r"config\.rl has no key grup_size; its keys: "
                     r".*group_size"):
    settings.parse(c)
  with pytest.raises(settings.ConfigError, match=r"config\.sampling has no key nope"):
    settings.parse({"sampling": {"nope": 1}})
  with pytest.raises(settings.ConfigError, match=r"config\.rl\.signal: .*allocation"):
    settings.parse({"stages": ("rl",), "rl": {"kind": "rl", "signal": {"allocation": "x"}}})


def test_settings_round_trip_through_their_dict():
  s = settings.parse(default.get_config("all,tiny"))
  assert settings.parse(s.to_dict()) == s


def test_share_prefill_has_one_default_and_one_reader():
  """``sampling.share_prefill``: its default is the settings' (the config
  generated from it); the run reads the typed value, and the one rule on it
  refuses it with host environments."""
  assert default.get_config().sampling.share_prefill is settings.SamplingSettings.share_prefill
  c = default.get_config("tiny")
  del c.sampling["share_prefill"]
  assert run_lib.build(c).cfg.sampling.share_prefill is False
  c = default.get_config("tiny,gem")
  c.sampling.share_prefill = True
  with pytest.raises(config_lib.ConfigError, match=r"config\.sampling\.share_prefill"):
    config_lib.validate(c)


def test_group_size_is_checked_once_where_it_is_read():
  c = default.get_config("tiny")
  c.rl.group_size = 0
  with pytest.raises(config_lib.ConfigError, match=r"config\.rl\.group_size must be an integer "
                     r">= 1, got 0"):
    config_lib.validate(c)
  c.rl.group_size = 2
  assert config_lib.validate(c)["rl"].group_size == 2
