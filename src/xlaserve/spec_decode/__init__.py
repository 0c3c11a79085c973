"""Speculative decoding shared by both backends.

- `ngram`: prompt-lookup proposer run by the engine after each step (no device work).
- `rejection`: the verification contract (greedy and lossless rejection sampling) that every
  backend's sampler implements, with a numpy reference.
- Draft-model and EAGLE proposals run inside the backend runner (their own paged KV cache indexed
  by the target's block tables) and come back in `RunnerOutput.spec_token_ids`.
- `eagle`: the EAGLE head checkpoint format and its checks against the target.

Nothing here imports torch or jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xlaserve.spec_decode.ngram import NgramProposer, ngram_propose

if TYPE_CHECKING:
    from xlaserve.config import SpeculativeConfig

__all__ = ["NgramProposer", "check_speculative_config", "ngram_propose"]


def check_speculative_config(config: SpeculativeConfig | None, backend: str) -> None:
    """Fail at engine construction (before any model loads) for what is not implemented: the
    backend's runner must list the method in its capabilities (xlaserve.runner)."""
    if config is None:
        return
    from xlaserve.runner import backends_with, get_capabilities

    if config.method in get_capabilities(backend).speculative_methods:
        return
    backends = backends_with(lambda caps: config.method in caps.speculative_methods)
    raise NotImplementedError(
        f"speculative method {config.method!r} is implemented for the "
        f"{', '.join(backends)} backend(s), not {backend!r}"
    )
