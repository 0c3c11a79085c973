"""What the engine returns to users (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One position: token id -> Logprob (the sampled/actual token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per output token, when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first entry None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # Set when the request failed inside the engine (fault isolation); finish_reason "error".
    error: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class BeamSearchSequence:
    """One finished beam of `LLM.beam_search`: prompt + generated tokens."""

    tokens: list[int]  # prompt ids followed by the generated ids
    cum_logprob: float  # sum of the generated tokens' logprobs (raw model distribution)
    text: str | None = None  # the generated text (prompt excluded)
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # per generated token


@dataclass
class BeamSearchOutput:
    """`LLM.beam_search`'s result for one prompt: the best `beam_width` beams, best first."""

    sequences: list[BeamSearchSequence]
