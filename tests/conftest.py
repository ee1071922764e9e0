"""Test-session setup: fast compilation, one persistent JAX compilation cache
per pytest run.

XLA:CPU's backend compiles at optimisation level 0 (``XLA_FLAGS``, unless
the caller sets a level): the tests' programs are small and compiled more
often than run, and the level changes compile time, not results beyond
float rounding.

Several tests compile the same programs more than once: the resume test
retrains the end-to-end config, and the notebook test starts a training
process per ablation arm. A cache directory shared by the xdist workers and
their subprocesses (through ``JAX_COMPILATION_CACHE_DIR``) lets a later
compilation load what an earlier one built. It lives in the run's pytest
temporary directory, so every run starts empty and pytest removes old ones.

It also sizes XLA:CPU's thread pool for Pallas' GPU interpreter (jax >=
0.11), before any backend starts: the interpreter runs each simulated
warpgroup as a computation that holds a pool thread while it waits on a
barrier, and the pool has one thread per core (``NPROC`` overrides that).
On a 2-core machine, the two compute warpgroups and the memory warpgroup of
a Hopper kernel that shares its executable with another kernel then wait
for each other forever (the fused-dQ backward's step barrier did, under
``jax.grad``; it passes with ``NPROC=8``).

After a test module that leaves its worker above ``_MAX_RSS`` bytes
resident, JAX's in-memory caches are dropped: a worker runs hundreds of
modules, and the executables they compiled would otherwise stay resident
for the whole run (5.5 GB per worker by its end). A later module that
compiles the same program loads it from the persistent cache; dropping
after every module instead took 6% more test time in one run.
"""

import gc
import os

# Before jax is imported (see the docstring); subprocess tests append their
# own flags to these.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

if jax.__version_info__ >= (0, 11):
  os.environ.setdefault("NPROC", str(max(8, os.cpu_count() or 1)))


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # the caller chose one
    yield
    return
  base = tmp_path_factory.getbasetemp()
  if base.name.startswith("popen-gw"):  # an xdist worker: share the run's
    base = base.parent
  path = base / "jax_compilation_cache"
  path.mkdir(exist_ok=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(path)
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(path))
  yield
  jax.config.update("jax_compilation_cache_dir", previous)
  del os.environ["JAX_COMPILATION_CACHE_DIR"]


_MAX_RSS = 3 << 30


def _resident_bytes() -> int:
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError):  # not Linux: always drop
    return _MAX_RSS + 1


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
  yield
  if _resident_bytes() > _MAX_RSS:
    jax.clear_caches()
    gc.collect()
