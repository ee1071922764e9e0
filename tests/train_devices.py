"""Subprocess worker: the whole trainer on a mesh of simulated CPU devices.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 \
      python tests/train_devices.py WORKDIR data=2,fsdp=2 [tensor=2 ...] [--teacher DIR] \
      [--stop_after N]

Runs ``loop.train`` on :func:`config` once per mesh layout (each a
comma-separated ``axis=size`` list) into ``WORKDIR/<layout>``, and prints the
workdirs as one JSON line; with ``--stop_after N`` each run stops after N
steps and is resumed from its checkpoint. With ``--processes N --process_id
I --port P`` it joins a multi-process run on loopback first (every process
passes the same layouts and workdir).
"""

import argparse
import json
import os

from agentic_rl.train import distributed


def config(teacher: str = "", **mesh):
  """The tiny run with the paths that touch device placement: two updates per
  batch (the scoring pass), a stale actor and a frozen reference policy; with
  a ``teacher`` run directory, the distill stage alone (on-policy, the
  teacher scoring inside the step).

  The KL estimator is k1, whose gradient is the score itself: k2 and k3 have
  gradient ``d * grad log pi`` with ``d`` the policy/reference log-ratio,
  which at the reference is rounding noise, and Adam turns a batch whose only
  gradient is noise (the first RL batch of this tiny policy has all-equal
  rewards) into full-size steps that differ from layout to layout.
  """
  from experiments.configs import default  # pylint: disable=g-import-not-at-top
  cfg = default.get_config("tiny")
  cfg.rl.update(updates_per_batch=2, max_staleness=2, kl_coef=0.05, kl_estimator="k1")
  cfg.mesh.update(data=1, fsdp=1, tensor=1)
  cfg.mesh.update(**mesh)
  if teacher:
    cfg.stages = ("distill",)
    cfg.distill.teachers.all = teacher
  return cfg


def parse_layout(layout: str) -> dict[str, int]:
  return {k: int(v) for k, v in (part.split("=") for part in layout.split(","))}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("workdir")
  parser.add_argument("layouts", nargs="+")
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--process_id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--teacher", default="", help="distill from this run directory")
  parser.add_argument("--stop_after", type=int, default=0,
                      help="stop each run after this many steps, then resume it")
  args = parser.parse_args()
  if args.processes > 1:
    distributed.maybe_initialize(f"127.0.0.1:{args.port}", args.processes, args.process_id)
  from agentic_rl.train import loop  # pylint: disable=g-import-not-at-top
  workdirs = []
  for layout in args.layouts:
    workdirs.append(os.path.join(args.workdir, layout.replace(",", "_")))
    cfg = config(args.teacher, **parse_layout(layout))
    if args.stop_after:
      loop.train(cfg, workdirs[-1], stop_after=args.stop_after)
    loop.train(cfg, workdirs[-1])
  print(json.dumps(workdirs))


if __name__ == "__main__":
  main()
