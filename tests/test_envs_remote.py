"""Host environments in their own processes (and Ray actors where Ray is
installed): the protocol is forwarded, failures on the other side become
errors of the episode, and the trainer runs on them."""

import json
import os

import jax
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl import rollout
from agentic_rl.envs import remote
from agentic_rl.envs import text_games
from agentic_rl.text import default_codec
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from experiments.configs import default


class Tooled(text_games.GuessNumber):
  """The guessing game with a tool, a pid probe and ways to fail."""

  tools = [{"name": "pid", "description": "the process id", "parameters": {}}]

  def call_tool(self, name, arguments):
    return str(os.getpid()), 0.0, False

  def step(self, action):
    if "crash" in action:
      os._exit(3)  # the interpreter dies without a word
    if "raise" in action:
      raise KeyError("no such move")
    return super().step(action)


def test_a_process_env_forwards_the_protocol_and_reports_failures():
  env = remote.ProcessEnv(f"{__name__}:Tooled", {"high": 8})
  try:
    local = Tooled(high=8)
    assert env.reset(3) == local.reset(3)
    assert env.step("<answer>1</answer>") == local.step("<answer>1</answer>")
    assert env.demonstration(5) == local.demonstration(5)
    assert env.tools == Tooled.tools
    pid = int(env.call_tool("pid", {})[0])
    assert pid != os.getpid()  # it runs elsewhere
    with pytest.raises(remote.RemoteEnvError, match="KeyError: 'no such move'"):
      env.step("raise")
    with pytest.raises(remote.RemoteEnvError, match="exited"):
      env.step("crash")
  finally:
    env.close()
  plain = remote.ProcessEnv("guess_number", {})
  assert not hasattr(plain, "call_tool") and plain.tools is None
  plain.close()
  with pytest.raises(remote.RemoteEnvError, match="cannot be loaded"):
    remote.ProcessEnv("no_such_module:Env").reset(0)


def test_a_crashed_environment_process_ends_only_its_episode():
  codec = default_codec()
  config = model_lib.TransformerConfig.tiny(vocab_size=codec.tokenizer.vocab_size)
  params = model_lib.init_params(config, jax.random.key(0))
  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=16, max_turns=4,
                                    max_total_tokens=256)
  host_loop = rollout.HostLoop(config, sampling, codec, batch_size=2, env_workers=2)
  envs = [remote.ProcessEnv(f"{__name__}:Tooled", {}) for _ in range(2)]
  try:
    out = host_loop.run(params, envs, [0, 1], jax.random.key(0), 0,
                        actor=lambda tag, obs: ("<answer>crash</answer>" if tag == 0
                                                else "<answer>1</answer>"))
  finally:
    for env in envs:
      env.close()
  status = [rollout.EPISODE_STATUS[s] for s in np.asarray(out.status_B)]
  assert status[0] == "env_error" and status[1] == "ok"


class PidGuess(text_games.GuessNumber):
  """The guessing game that leaves a file named after its process id in
  ``pid_dir`` at every reset."""

  def __init__(self, pid_dir, **kwargs):
    super().__init__(**kwargs)
    self.pid_dir = pid_dir

  def reset(self, seed):
    open(os.path.join(self.pid_dir, str(os.getpid())), "w").close()
    return super().reset(seed)


def _pool_cfg(pool, pid_dir):
  cfg = default.get_config("tiny")
  cfg.stages = ("rl",)
  cfg.tasks.update(source="host", host_env=f"{__name__}:PidGuess", env_pool=pool,
                   env_workers=4, host_kwargs=json.dumps({"pid_dir": str(pid_dir)}))
  cfg.rl.update(iterations=1, prompts_per_step=2, group_size=2)
  cfg.eval.update(num_prompts=2, pass_k_prompts=1, batch_rows=2)
  return cfg


@pytest.mark.slow  # a training run on spawned environment processes
def test_the_trainer_runs_on_environment_processes(tmp_path):
  pids = tmp_path / "pids"
  pids.mkdir()
  summary = loop.train(_pool_cfg("processes", pids), str(tmp_path / "run"))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path / "run"), "metrics.jsonl"))
  assert summary["steps"] == 1
  assert records[-1]["episode/env_errors"] == 0 and "shift/kl_behaviour_learner" in records[-1]
  # Every reset ran in an environment process of its own, none in the trainer's.
  seen = {int(p) for p in os.listdir(pids)}
  assert os.getpid() not in seen and len(seen) >= 4


def test_the_trainer_runs_on_ray_actors(tmp_path):
  ray = pytest.importorskip("ray", reason="Ray (pip install -e '.[ray]') is optional")
  here = os.path.dirname(os.path.abspath(__file__))
  path = os.pathsep.join([here, os.path.dirname(here)])
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
           runtime_env={"env_vars": {"PYTHONPATH": path}})
  try:
    env = remote.RayEnv(f"{__name__}:Tooled", {})
    assert env.reset(2) == Tooled().reset(2)
    with pytest.raises(remote.RemoteEnvError, match="no such move"):
      env.step("raise")
    env.close()
    pids = tmp_path / "pids"
    pids.mkdir()
    summary = loop.train(_pool_cfg("ray", pids), str(tmp_path / "run"))
    assert summary["steps"] == 1
    assert os.getpid() not in {int(p) for p in os.listdir(pids)}
  finally:
    ray.shutdown()
