r"""Can the policy network learn to copy a number of any length, and how fast?

  python -m experiments.copy_study --seeds=0,1,2,3,4 --out=/tmp/copy_study.json
  python -m experiments.copy_study --config.model.n_heads=16 \
      --config.model.n_kv_heads=16 --config.model.head_dim=8

Copying a tool's number into the next action is the skill the default run's
calculator chains need (docs/default_run). This trains the configured model
from scratch, with the warm start's loss and optimiser (``config.sft``), on
that skill alone: rows ``<|user|>FILLER<|end|><tool_result>N</tool_result>
<answer>N</answer>`` with ``N`` of 1-9 digits drawn evenly (``--lengths``)
and a filler of 0-3 numbers that moves the tool result's position; the loss
covers the answer. Every ``--every`` steps it reports, per length, the share of
``--eval_rows`` held-out rows whose whole answer the greedy policy copies
(the argmax at each answer token given the right ones before it), and
writes the curves to ``--out``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from ml_collections import config_flags

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.text import tokenizer as tok_lib
from agentic_rl.train import config as config_lib
from agentic_rl.train import learner
from experiments import common

_CONFIG = config_flags.DEFINE_config_file(
    "config", "experiments/configs/default.py", "Experiment config (its model and sft stage).")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds (parameters and data).")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps per seed.")
_EVERY = flags.DEFINE_integer("every", 50, "Evaluate every this many steps.")
_EVAL_ROWS = flags.DEFINE_integer("eval_rows", 512, "Held-out rows per evaluation.")
LENGTHS = tuple(range(1, 10))  # digits of the numbers copied, by default
_LENGTHS = flags.DEFINE_list("lengths", [str(n) for n in LENGTHS],
                            "Digits of the numbers to copy, drawn evenly.")
_OUT = flags.DEFINE_string("out", "", "Where to write the JSON result (empty: nowhere).")

ROW_LEN = 48  # the longest row (9 digits, 3 filler numbers) has 43 tokens


def copy_rows(tokenizer, rng: np.random.Generator, n: int,
              lengths=LENGTHS) -> dict[str, np.ndarray]:
  """``n`` copy rows of numbers with ``lengths`` digits (each 1-9): int32
  ``tokens_BxT`` (padded with 0), fp32 ``loss_mask_BxT`` on the answer and
  its closing tag, int32 ``answer_start_B`` and ``length_B`` (digits)."""
  tokens = np.zeros((n, ROW_LEN), np.int32)
  mask = np.zeros((n, ROW_LEN), np.float32)
  start, length = np.zeros(n, np.int32), rng.choice(lengths, n).astype(np.int32)
  for b, digits in enumerate(length):
    number = str(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits))
    filler = " ".join(str(x) for x in rng.integers(0, 1000, rng.integers(0, 4)))
    head = tokenizer.encode(f"<|user|>{filler}<|end|><tool_result>{number}</tool_result><answer>")
    tail = tokenizer.encode(f"{number}</answer>")
    tokens[b, :len(head) + len(tail)] = head + tail
    mask[b, len(head):len(head) + len(tail)] = 1.0
    start[b] = len(head)
  return {"tokens_BxT": tokens, "loss_mask_BxT": mask, "answer_start_B": start,
          "length_B": length}


def copy_rates(predicted_BxT: np.ndarray, rows: dict[str, np.ndarray]) -> dict[int, float]:
  """Per length, the share of rows whose answer digits all equal the argmax
  ``predicted_BxT`` (position t predicts token t + 1)."""
  tokens, start, length = rows["tokens_BxT"], rows["answer_start_B"], rows["length_B"]
  ok = np.array([np.array_equal(predicted_BxT[b, s - 1:s - 1 + n], tokens[b, s:s + n])
                 for b, (s, n) in enumerate(zip(start, length))])
  return {int(n): float(ok[length == n].mean()) for n in np.unique(length)}


def study(cfg, seed: int, *, steps: int, every: int, eval_rows: int,
          lengths=LENGTHS) -> list[dict]:
  """One seed's curve: ``[{"step", "nll", "copied": {length: share}}, ...]``."""
  cfg = config_lib.validate(cfg)
  model_config = config_lib.model_config(cfg)
  tokenizer = tok_lib.load_tokenizer()
  optimizer = objectives.make_optimizer(config_lib.optimizer_config(cfg["sft"], steps))
  loss_fn = learner.sft_loss(model_config)
  rng = np.random.default_rng(seed)
  held_out = copy_rows(tokenizer, rng, eval_rows, lengths)

  @jax.jit
  def step(params, opt_state, batch):
    norm = {"num_tokens": jnp.sum(batch["loss_mask_BxT"])}
    (nll, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, norm)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, nll

  predict = jax.jit(lambda p, t: jnp.argmax(model_lib.forward(p, t, model_config), -1))
  params = model_lib.init_params(model_config, jax.random.key(seed))
  opt_state = optimizer.init(params)
  curve = []
  for i in range(1, steps + 1):
    rows = copy_rows(tokenizer, rng, cfg["sft"].batch_size, lengths)
    batch = {k: rows[k] for k in ("tokens_BxT", "loss_mask_BxT")}
    params, opt_state, nll = step(params, opt_state, batch)
    if i % every == 0 or i == steps:
      copied = copy_rates(np.asarray(predict(params, held_out["tokens_BxT"])), held_out)
      curve.append({"step": i, "nll": float(nll), "copied": copied})
      print(f"seed {seed} step {i:4d} nll {float(nll):.3f} copied " +
            " ".join(f"{n}:{r:.2f}" for n, r in copied.items()), flush=True)
  return curve


def run(cfg, seeds, *, steps: int, every: int, eval_rows: int, lengths, out: str = "") -> dict:
  """Every seed's :func:`study`, a summary line, and the JSON at ``out``."""
  lengths = tuple(int(n) for n in lengths)
  if not lengths or not all(1 <= n <= 9 for n in lengths):
    raise ValueError(f"lengths must be digit counts in 1-9, got {lengths}")
  result = {"model": dict(cfg.model), "sft": {k: cfg.sft[k] for k in (
      "batch_size", "learning_rate", "warmup_steps")}, "steps": steps, "lengths": lengths,
            "curves": {}}
  for seed in seeds:
    result["curves"][seed] = study(cfg, seed, steps=steps, every=every, eval_rows=eval_rows,
                                   lengths=lengths)
  last = [c[-1] for c in result["curves"].values()]
  print(f"after {steps} steps: nll {np.mean([c['nll'] for c in last]):.3f} (mean over "
        f"seeds), copied {np.mean([np.mean(list(c['copied'].values())) for c in last]):.2f} "
        "(mean over seeds and lengths)")
  if out:
    common.write_json(out, result)
  return result


def main(argv):
  del argv
  run(_CONFIG.value, [int(s) for s in _SEEDS.value], steps=_STEPS.value, every=_EVERY.value,
      eval_rows=_EVAL_ROWS.value, lengths=_LENGTHS.value, out=_OUT.value)


if __name__ == "__main__":
  app.run(main)
