"""Final hidden states of whole prompts on a loaded XLA runner (the pooling runner's forward).

`XlaHiddenStates(runner, max_tokens).forward(prompts)` runs the prompts as one ragged prefill
batch through the runner's compiled FORWARD program (a token bucket compiled at start-up: no
new compilation), returning each prompt's final-norm hidden states [T_i, H] as float32 numpy.
The batch's K/V are written into the engine's own KV blocks 0.. : `--runner pooling` turns
generation off, so nothing else reads them (the same contract as backends_torch/pooling.py).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from xlaserve.backends_xla.utils import pick_bucket
from xlaserve.runner_core import ragged_inputs


class XlaHiddenStates:
    """Hidden states of prompts on `runner` (a backends_xla ModelRunner, KV cache allocated)."""

    def __init__(self, runner: Any, max_tokens: int) -> None:  # noqa: ANN401
        self.runner = runner
        self.block_size = runner.block_size
        self.max_tokens = min(max_tokens, runner.token_buckets[-1])
        self.max_seqs = runner.max_num_seqs

    def forward(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Per prompt [T_i, H] float32 (ValueError past max_tokens or max_num_seqs prompts)."""
        r = self.runner
        total = sum(len(p) for p in prompts)
        if total > self.max_tokens or len(prompts) > self.max_seqs:
            raise ValueError(
                f"batch of {len(prompts)} prompts / {total} tokens is over the limit of "
                f"{self.max_seqs} / {self.max_tokens}"
            )
        chunks, block = [], 0
        for p in prompts:
            n = -(-len(p) // self.block_size)
            chunks.append((list(p), 0, list(range(block, block + n))))
            block += n
        if block > r.num_kv_blocks:
            raise ValueError("batch needs more KV blocks than the engine has")
        x = ragged_inputs(chunks, self.block_size)
        t, b = len(x.input_ids), len(prompts)
        batch = r._dummy_batch(pick_bucket(r.token_buckets, t))
        batch.input_ids[:t], batch.positions[:t] = x.input_ids, x.positions
        batch.slot_mapping[:t] = x.slot_mapping
        batch.kv_lens[:b] = x.seq_lens
        batch.block_tables[:b, : x.block_tables.shape[1]] = x.block_tables
        batch.cu_q_lens[1 : b + 1], batch.cu_q_lens[b + 1 :] = x.query_start_loc[1:], t
        batch.num_seqs[0] = b
        batch.logits_indices[:b] = x.query_start_loc[1:] - 1
        _, hidden, _ = r._forward(batch)
        h = np.asarray(jax.device_get(hidden), dtype=np.float32)[:t]
        q = x.query_start_loc
        return [h[q[i] : q[i + 1]] for i in range(b)]
