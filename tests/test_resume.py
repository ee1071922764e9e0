"""Run config in the workdir, and the check of a resumed run's config."""

import json
import math
import os

import ml_collections
import numpy as np
import pytest
from ml_collections.config_dict import placeholder

from agentic_rl.train import resume
from experiments.configs import default


def _cfg():
  """A small config shaped like the experiment's: two stages by kind."""
  return ml_collections.ConfigDict(dict(
      seed=0,
      model=dict(d_model=32, dtype="float32"),
      tasks=dict(families=("calc_chain", "multihop"), weights=(0.5, 0.5)),
      eval=dict(every=20, num_prompts=8),
      checkpoint=dict(every=20, keep=2),
      mesh=dict(data=-1, fsdp=1),
      distributed=dict(coordinator_address="", num_processes=1),
      micro_batches=1,
      stages=("warm", "polish"),
      warm=dict(kind="sft", steps=400, warmup_steps=20, batch_size=32),
      polish=dict(kind="rl", iterations=40, loss="ppo", warmup_steps=0,
                  loss_kwargs=dict(ppo=dict(eps_high=0.28)),
                  exploration=dict(entropy_band=(), temperature_final=1.0),
                  correction_kwargs=dict()),
  ))


def _refusal(saved, new) -> str:
  with pytest.raises(ValueError) as raised:
    resume.check_resume(resume.config_to_dict(saved), resume.config_to_dict(new))
  return str(raised.value)


def test_config_to_dict_is_plain_json():
  cfg = _cfg()
  cfg.polish.loss_kwargs.ppo.eps_low = placeholder(float)
  cfg.model.scale = np.float32(0.5)
  plain = resume.config_to_dict(cfg)
  assert type(plain) is dict and type(plain["polish"]["loss_kwargs"]) is dict
  assert plain["tasks"]["families"] == ["calc_chain", "multihop"]
  assert plain["stages"] == ["warm", "polish"]
  assert plain["polish"]["exploration"]["entropy_band"] == []
  assert plain["polish"]["loss_kwargs"]["ppo"] == {"eps_high": 0.28, "eps_low": None}
  assert plain["model"]["scale"] == 0.5 and type(plain["model"]["scale"]) is float
  assert json.loads(json.dumps(plain)) == plain
  cfg.model.init = object()
  with pytest.raises(TypeError, match=r"config\.model\.init has type object"):
    resume.config_to_dict(cfg)


def test_save_and_load_round_trip(tmp_path):
  assert resume.load_run_config(tmp_path) is None
  cfg = default.get_config("tiny")
  path = resume.save_run_config(tmp_path / "run", cfg)
  assert path == os.fspath(tmp_path / "run" / resume.CONFIG_FILE)
  assert os.listdir(tmp_path / "run") == [resume.CONFIG_FILE]  # no temp file
  saved = resume.load_run_config(tmp_path / "run")
  assert saved == resume.config_to_dict(cfg)
  # The experiment's own config resumes unchanged after the JSON round trip.
  assert resume.check_resume(saved, resume.config_to_dict(default.get_config("tiny"))) == []


def test_safe_changes_are_allowed_and_reported():
  saved, new = _cfg(), _cfg()
  new.eval.every = 10
  new.eval.num_prompts = 16
  new.checkpoint.every = 5
  new.checkpoint.keep = 4
  new.mesh.fsdp = 2
  new.distributed.num_processes = 2
  new.warm.steps = 500  # an sft stage's length
  new.polish.iterations = 60  # an rl stage's length
  notices = resume.check_resume(resume.config_to_dict(saved), new)
  assert notices == [
      "config.checkpoint.every: 20 -> 5 (allowed on resume)",
      "config.checkpoint.keep: 2 -> 4 (allowed on resume)",
      "config.distributed.num_processes: 1 -> 2 (allowed on resume)",
      "config.eval.every: 20 -> 10 (allowed on resume)",
      "config.eval.num_prompts: 8 -> 16 (allowed on resume)",
      "config.mesh.fsdp: 1 -> 2 (allowed on resume)",
      "config.polish.iterations: 40 -> 60 (allowed on resume)",
      "config.warm.steps: 400 -> 500 (allowed on resume)",
  ]
  assert resume.check_resume(resume.config_to_dict(saved), saved) == []


def test_other_changes_are_refused_listing_every_key():
  saved, new = _cfg(), _cfg()
  new.polish.loss = "cispo"
  new.model.d_model = 64
  new.seed = 1
  new.stages = ("polish",)
  new.tasks.weights = (0.25, 0.75)
  new.polish.loss_kwargs.ppo.eps_low = 0.2  # added
  del new.model["dtype"]  # removed
  new.polish.correction_kwargs.tis = dict(cap=2.0)  # {} -> a table
  new.eval.every = 10  # allowed, but listed as such
  message = _refusal(saved, new)
  for line in ('config.polish.loss: "ppo" -> "cispo"',
               "config.model.d_model: 32 -> 64",
               "config.seed: 0 -> 1",
               'config.stages: ["warm", "polish"] -> ["polish"]',
               "config.tasks.weights: [0.5, 0.5] -> [0.25, 0.75]",
               "config.polish.loss_kwargs.ppo.eps_low: <absent> -> 0.2",
               'config.model.dtype: "float32" -> <absent>',
               "config.polish.correction_kwargs: {} -> <absent>",
               "config.polish.correction_kwargs.tis.cap: <absent> -> 2.0",
               "config.eval.every: 20 -> 10 (allowed on resume)"):
    assert f"\n  {line}" in message, (line, message)
  assert "--workdir" in message and "restore the old values" in message
  assert message.index("cannot change") < message.index("polish.loss")


def test_step_keys_follow_the_stage_kind():
  saved, new = _cfg(), _cfg()
  new.polish.steps = 7  # not an rl stage's step count
  assert "config.polish.steps: <absent> -> 7" in _refusal(saved, new)
  saved.warm.iterations, new = 3, _cfg()
  new.warm.iterations = 4  # not an sft stage's step count
  assert "config.warm.iterations: 3 -> 4\n" in _refusal(saved, new) + "\n"
  saved, new = _cfg(), _cfg()
  new.polish.kind = "sft"  # a kind change is refused, and with it the length
  new.polish.iterations = 50
  message = _refusal(saved, new)
  assert 'config.polish.kind: "rl" -> "sft"' in message
  assert "config.polish.iterations: 40 -> 50\n" in message


@pytest.mark.parametrize("where", ["saved", "new"])
def test_length_is_refused_when_the_schedule_depends_on_it(where):
  saved, new = _cfg(), _cfg()
  for cfg in (saved, new):
    cfg.warm.schedule = "warmup_constant"
  (saved if where == "saved" else new).polish.schedule = "warmup_cosine"
  if where == "saved":
    new.polish.schedule = "warmup_cosine"
  new.polish.iterations = 60
  new.warm.steps = 500
  message = _refusal(saved, new)
  assert ("config.polish.iterations: 40 -> 60 (the warmup_cosine learning-rate "
          "schedule depends on it)") in message
  assert "config.warm.steps: 400 -> 500 (allowed on resume)" in message


def test_non_finite_values_compare_equal_and_bools_are_not_numbers():
  saved, new = _cfg(), _cfg()
  for cfg in (saved, new):
    cfg.polish.band = (0.0, math.inf)
    cfg.polish.nan = math.nan
  stored = json.loads(json.dumps(resume.config_to_dict(saved)))
  assert resume.check_resume(stored, new) == []
  new.micro_batches = True
  assert "config.micro_batches: 1 -> true" in _refusal(saved, new)
