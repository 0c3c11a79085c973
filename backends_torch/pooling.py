"""Final hidden states of whole prompts on a loaded torch runner (the pooling runner's forward).

`TorchHiddenStates(runner).forward(prompts)` runs the prompts as one ragged prefill batch over
a scratch paged KV cache of its own (the engine's KV blocks are never touched), returning each
prompt's final-norm hidden states [T_i, H] as float32 numpy arrays: what transformers'
`last_hidden_state` is for the same ids. Called from one thread at a time (the server holds a
lock); the engine runs no generation meanwhile (`--runner pooling` turns generation off).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


class TorchHiddenStates:
    """Hidden states of prompts on `runner` (a backends_torch ModelRunner with its model loaded)."""

    def __init__(self, runner: Any, max_tokens: int) -> None:  # noqa: ANN401
        self.runner = runner
        self.block_size = runner.block_size
        # Scratch blocks for `max_tokens` tokens in one batch (the longest batch we accept).
        self.num_blocks = math.ceil(max_tokens / self.block_size) + 1
        self.max_tokens = max_tokens
        self._caches: list[Any] | None = None

    @torch.inference_mode()
    def forward(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Per prompt [T_i, H] float32 (ValueError when the batch exceeds max_tokens)."""
        total = sum(len(p) for p in prompts)
        if total > self.max_tokens:
            raise ValueError(f"batch of {total} tokens is over the limit of {self.max_tokens}")
        if self._caches is None:
            self._caches = self.runner._alloc_caches(self.num_blocks)
        chunks = []
        block = 0
        for p in prompts:
            n = math.ceil(len(p) / self.block_size)
            chunks.append((list(p), 0, list(range(block, block + n))))
            block += n
        ids, pos, md = self.runner._build_inputs(chunks)
        hidden = self.runner.model(ids, pos, self._caches, md)  # [T, H]
        h = hidden.float().cpu().numpy()
        qsl = md.query_start_loc_host
        return [h[qsl[i] : qsl[i + 1]] for i in range(len(prompts))]
