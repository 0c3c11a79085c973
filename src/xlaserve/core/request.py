"""The engine core's view of one sequence (one of a request's n samples)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from xlaserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, blocks freed (recompute on resume)
    # Finished states (>= FINISHED_STOPPED).
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False)
class Request:
    """Rules:
    - tokens are `prompt_token_ids + output_token_ids`; `num_computed_tokens` of them have KV in
      the cache; the scheduler schedules up to `num_tokens - num_computed_tokens` (+ drafts).
    - `max_tokens` is already clipped to `max_model_len - num_prompt_tokens` by the engine.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the "priority" policy
    cache_salt: str | None = None  # extra key in the prefix-cache hash (tenant isolation)
    # Fairness group (scheduler.max_running_share): the sequences of one client request (its n
    # samples, the prompts of one HTTP request); None = the request is its own group.
    group_id: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Chained hashes of the full blocks of `all_token_ids` (filled by the KV cache manager).
    block_hashes: list[int] = field(default_factory=list)
    # Draft tokens proposed for the next step (speculative decoding).
    spec_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Async scheduling: tokens sampled by launched steps whose results are not back yet; the
    # scheduler treats them as known (the runner feeds them to the next step on the device).
    num_pending_tokens: int = 0
    # Output tokens the engine appended that the runner has not been sent yet (structured-output
    # jump-forward): the last `num_unsent_tokens` of `output_token_ids` go out with the request's
    # next CachedRequestData (a resumed request gets all its tokens in NewRequestData instead).
    num_unsent_tokens: int = 0
    # Prompt tokens found in the prefix cache at first scheduling (-1 = not scheduled yet).
    num_cached_tokens: int = -1
    stop_reason: int | str | None = None
    error: str | None = None
    # Multi-LoRA (xlaserve/lora): the LoRARequest (None = base model) and its loaded
    # LoRAAdapter; lora_slot is the device slot while the request runs (-1 otherwise).
    lora_request: Any = None
    lora_adapter: Any = None
    lora_slot: int = -1

    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0 = base model): part of the prefix-cache key."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
