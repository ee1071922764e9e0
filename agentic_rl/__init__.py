"""agentic_rl: a JAX research codebase for agentic reinforcement learning."""

__version__ = "0.1.0"
