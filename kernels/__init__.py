"""Pallas kernels, installed as ``agentic_rl.kernels``."""
