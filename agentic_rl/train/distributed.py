"""Multi-process (multi-host) start-up through ``jax.distributed.initialize``.

JAX runs one Python process per host (or per GPU group); every process runs
the same program and sees the *global* device list, so
``sharding.make_mesh`` builds one mesh over all hosts and a jitted step runs
on all of them.  ``maybe_initialize`` must be called first, before anything
touches a device.

Launch (two hosts, or two processes on one machine on loopback; the
trainer's ``--coordinator_address / --num_processes / --process_id`` flags
feed :func:`maybe_initialize`)::

    # host 0 (also runs the coordinator; the port must be free and reachable)
    python -m experiments.train --workdir=/mnt/nfs/run1 \
        --coordinator_address=10.0.0.1:8476 --num_processes=2 --process_id=0
    # host 1
    python -m experiments.train --workdir=/mnt/nfs/run1 \
        --coordinator_address=10.0.0.1:8476 --num_processes=2 --process_id=1

Leave the three flags unset for an ordinary single-process run.  On CPU the
cross-process collectives go through gloo (set here); on GPU/TPU through
NCCL/ICI.  ``--workdir`` must be the same shared directory on every host:
checkpoints are written by all processes together (orbax coordinates them)
and metrics by process 0 only.
"""

from __future__ import annotations

import jax


def maybe_initialize(coordinator_address: str | None = None,
                     num_processes: int | None = None,
                     process_id: int | None = None, *,
                     initialization_timeout: int = 300,
                     cpu_collectives: str | None = "gloo") -> bool:
  """Join a multi-process JAX run, or do nothing for a single process.

  Args:
    coordinator_address: ``"host:port"`` of process 0's coordinator service.
    num_processes: total number of processes (>= 1).
    process_id: this process's index in ``[0, num_processes)``.
    initialization_timeout: seconds to wait for all processes to connect.
    cpu_collectives: ``jax_cpu_collectives_implementation`` for CPU devices
      (``"gloo"``; None leaves JAX's default).

  Returns:
    True if ``jax.distributed.initialize`` was called, False when all three
    arguments are None (single process; nothing happens).

  Raises:
    ValueError: only some arguments given, a malformed address or an
      out-of-range ``process_id``; checked before contacting anyone.
  """
  given = {"coordinator_address": coordinator_address,
           "num_processes": num_processes, "process_id": process_id}
  if all(v is None for v in given.values()):
    return False
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(
        f"multi-process start needs coordinator_address, num_processes and "
        f"process_id together; missing {missing}")
  host, _, port = coordinator_address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"coordinator_address must be 'host:port', got "
                     f"{coordinator_address!r}")
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got "
                     f"{process_id}")
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id,
                             initialization_timeout=initialization_timeout)
  return True
