"""Cache kinds: what a model's layers keep between steps, one spec per layer group (no torch/jax).

Attention models keep paged K/V (`PagedAttentionSpec`): memory grows with the tokens, in blocks of
`block_size` positions. State-space and linear-attention layers (Mamba, Mamba2, short
convolutions, gated delta rule) keep a fixed-size recurrent state per request (`RecurrentStateSpec`:
SSM state + convolution window), whatever its length. A hybrid (Bamba, Jamba, ...) has both.

`CacheLayout` gathers a model's groups and does the ONE memory accounting of the engine: a budget
of bytes is split into KV blocks and state slots (`split`), and the KV cache manager then admits,
preempts and frees a request's blocks and its state slot together (kv_cache_manager.py).

Rules:
- A request holds at most one state slot (index into every recurrent layer's state tensors,
  [num_state_slots, ...]) from its first scheduled chunk until it finishes or is preempted.
- A state slot holds the state after the request's `num_computed_tokens` tokens: it cannot be
  shared or rewound, so prefix caching is off for models with recurrent layers (no state
  snapshots at block boundaries yet) and so are speculative drafts (rejected drafts would need a
  rewind).
- Sliding-window attention layers are accounted as full attention (blocks outside the window are
  not released early).
"""

from __future__ import annotations

from dataclasses import dataclass

KIND_ATTENTION = "attention"
KIND_SLIDING = "sliding_window"
KIND_STATE = "recurrent_state"


@dataclass(frozen=True)
class PagedAttentionSpec:
    """Paged K/V of `layers`: `bytes_per_block` for all of them together (one block id)."""

    layers: tuple[int, ...]
    bytes_per_block: int
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return KIND_SLIDING if self.sliding_window is not None else KIND_ATTENTION


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Fixed-size per-request state of `layers` (e.g. Mamba2: conv window [C, K-1] + SSM state
    [Hs, P, N] per layer): `bytes_per_slot` for all of them together (one state slot)."""

    layers: tuple[int, ...]
    bytes_per_slot: int

    @property
    def kind(self) -> str:
        return KIND_STATE


CacheGroupSpec = PagedAttentionSpec | RecurrentStateSpec


@dataclass(frozen=True)
class CacheLayout:
    """All cache groups of one model (a layer is in at most one group of each kind: paged K/V,
    recurrent state; Falcon-H1's parallel attention + Mamba2 layers are in one of each)."""

    groups: tuple[CacheGroupSpec, ...]

    def __post_init__(self) -> None:
        seen: dict[type, set[int]] = {}
        for g in self.groups:
            got = seen.setdefault(type(g), set())
            dup = got & set(g.layers)
            if dup:
                raise ValueError(f"layers {sorted(dup)} are in two cache groups of one kind")
            got |= set(g.layers)

    @property
    def bytes_per_block(self) -> int:
        return sum(g.bytes_per_block for g in self.groups if isinstance(g, PagedAttentionSpec))

    @property
    def bytes_per_slot(self) -> int:
        return sum(g.bytes_per_slot for g in self.groups if isinstance(g, RecurrentStateSpec))

    @property
    def has_attention(self) -> bool:
        return any(isinstance(g, PagedAttentionSpec) for g in self.groups)

    @property
    def has_state(self) -> bool:
        return any(isinstance(g, RecurrentStateSpec) for g in self.groups)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Distinct kinds in group order (for tables and logs)."""
        out: list[str] = []
        for g in self.groups:
            if g.kind not in out:
                out.append(g.kind)
        return tuple(out)

    def split(
        self, total_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int
    ) -> tuple[int, int]:
        """One budget -> (num KV blocks, num state slots).

        State slots first, one per sequence that may run (max_num_seqs), but never so many that
        the blocks left could not hold one max_model_len request; the rest are KV blocks. A model
        without attention layers still gets block ids (bookkeeping only, no memory): enough for
        max_num_seqs full-length requests. Raises when not even one request fits."""
        need_blocks = -(-max_model_len // block_size)
        per_block, per_slot = self.bytes_per_block, self.bytes_per_slot
        min_bytes = need_blocks * per_block + per_slot
        if total_bytes < min_bytes:
            raise ValueError(
                f"{total_bytes} bytes of cache cannot hold one request of max_model_len="
                f"{max_model_len} ({need_blocks} blocks x {per_block} B + one state slot of "
                f"{per_slot} B = {min_bytes} B)"
            )
        slots = 0
        if per_slot:
            room = total_bytes - need_blocks * per_block
            slots = max(1, min(max_num_seqs, room // per_slot))
        if per_block == 0:
            return max_num_seqs * need_blocks, slots
        return int((total_bytes - slots * per_slot) // per_block), int(slots)
