"""The policy network: a decoder-only transformer as pure functions.

``forward`` runs full sequences (training, scoring); ``prefill`` / ``extend`` /
``decode_step`` run incrementally against a ``KVCache`` (rollouts);
``prefix.forward_hidden`` runs a prefix shared by a group of rows once;
``hf.load_hf_checkpoint`` / ``hf.save_hf_checkpoint`` import and export Llama,
Qwen2, Qwen3, Gemma, Gemma 2 and Gemma 3 (text) checkpoints, ``gguf.load_gguf``
reads GGUF files of those, and ``pretrained.load`` either;
``compiler_options`` are the XLA options every jit of the model passes.
"""

from agentic_rl.model import gguf, hf, pretrained
from agentic_rl.model.xla_options import compiler_options, mesh_platform
from agentic_rl.model.config import TransformerConfig, alternating_windows
from agentic_rl.model.kv_cache import (KVCache, decode_step, extend,
                                       grow_cache, init_cache, prefill,
                                       repeat_rows, split_slots)
from agentic_rl.model.transformer import (forward, init_params, param_axes,
                                          unembedding, unstack_layers)

__all__ = [
    "KVCache",
    "TransformerConfig",
    "alternating_windows",
    "compiler_options",
    "decode_step",
    "extend",
    "forward",
    "gguf",
    "grow_cache",
    "hf",
    "pretrained",
    "init_cache",
    "init_params",
    "mesh_platform",
    "param_axes",
    "prefill",
    "repeat_rows",
    "split_slots",
    "unembedding",
    "unstack_layers",
]
