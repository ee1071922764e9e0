"""Install agentic_rl.

The kernels are ``agentic_rl.kernels`` (subpackages by backend: ``triton/``,
``hopper/``, ``tpu/``). Tools that are not library code (the kernel
benchmark, the ahead-of-time compile check) are in ``experiments/`` and are
not installed.
"""
import setuptools

_PACKAGES = setuptools.find_packages(include=["agentic_rl", "agentic_rl.*"])

setuptools.setup(
    name="agentic_rl",
    version="0.1.0",
    description="A JAX research codebase for agentic reinforcement learning.",
    python_requires=">=3.11",
    packages=_PACKAGES,
    package_data={"agentic_rl.text": ["assets/*.model"]},
    include_package_data=True,
    install_requires=[
        "jax>=0.10.2",
        "flax",
        "optax",
        "orbax-checkpoint",
        "chex",
        "sentencepiece",
        "ml-collections",
        "absl-py",
        "tensorflow-datasets",
        "array_record",
        "importlib_resources",  # tensorflow-datasets imports it without declaring it
        "numpy",
        "tensorboardX",
        "safetensors",
        "tokenizers",
        "jinja2>=3.1",
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-xdist",
            "hypothesis",
            # Parity tests against Hugging Face. torch 2.13.0's CPU wheel is
            # what pip resolves quickly here; a looser pin pulls a CUDA build.
            "torch==2.13.0",
            "transformers",
            "matplotlib",
            "nbclient",
            "nbformat",
            "ipykernel",
            # The GEM games' tests (agentic_rl/envs/gem.py).
            "gem-llm==0.1.0",
            # The reasoning-gym adapter's tests (agentic_rl/envs/reasoning.py).
            "reasoning-gym",
            # GGUF checkpoints (agentic_rl/model/gguf.py); accelerate is what
            # transformers' own GGUF loading, the parity reference, needs.
            "gguf",
            "accelerate",
        ],
        # GGUF checkpoints (config.model.init_from=FILE.gguf).
        "gguf": ["gguf"],
        "gem": ["gem-llm==0.1.0"],
        # Environment hubs: GEM games (gem:<id>) and reasoning-gym datasets
        # (reasoning_gym:<dataset>).
        "hubs": ["gem-llm==0.1.0", "reasoning-gym"],
        # The side-by-side benchmark against torch, transformers and TRL
        # (experiments/bench_real.py).
        "bench": ["trl", "transformers", "torch==2.13.0", "accelerate", "gguf"],
        # Host environments as Ray actors (config.tasks.env_pool="ray").
        "ray": ["ray"],
        # JAX's CUDA 13 plugin and libraries (~4.4 GB): runs on NVIDIA GPUs,
        # and compiles for one without it (experiments/aot_kernels.py).
        "cuda": ["jax[cuda13]"],
    },
)
