"""Pallas kernels (TPU Mosaic; GPU later) with plain jnp references.

Importing this package imports jax (it is a backend package, imported lazily by the XLA runner).
"""

from xlaserve.kernels_pallas.ragged_paged_attention import (
    BlockSizes,
    ragged_paged_attention,
    ref_ragged_paged_attention,
    write_kv,
)

__all__ = ["BlockSizes", "ragged_paged_attention", "ref_ragged_paged_attention", "write_kv"]
