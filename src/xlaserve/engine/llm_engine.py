"""LLMEngine: the engine core and the output processor in one process, stepped synchronously.

One `step()`: `EngineCore.step()` (schedule -> runner.execute -> scheduler.update_from_output,
token ids only) -> `OutputProcessor.process()` (detokenize, stop strings, logprobs text,
RequestOutputs) -> sequences that hit a stop string are finished in the core at once. A request
with n > 1 is fanned out into n child sequences (ids `{i}#{request_id}`) whose outputs are
aggregated under the parent id.

`LLM` (offline) and the in-process `AsyncLLM` run this; the server's default runs the same two
halves split over two processes (`engine/core_proc.py`, `engine/core_client.py`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any

from xlaserve.config import EngineConfig
from xlaserve.engine.core import EngineCore, EngineStats, load_model_info
from xlaserve.engine.output_processor import OutputProcessor, PromptType
from xlaserve.outputs import RequestOutput
from xlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["EngineStats", "LLMEngine", "PromptType"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        info = load_model_info(config)
        self.core = EngineCore(config, info)
        self.processor = OutputProcessor(info, self.core.capacity_tokens)
        self.model_dir = info.model_dir
        self.spec = info.spec
        self.tokenizer = info.tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.eos_token_ids = info.eos_token_ids
        self.backend = info.backend
        self._ids = itertools.count()

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        """The core's parts (runner, scheduler, kv_manager, num_overlapped_steps, ...) for tests
        and tools that look inside; only called for names LLMEngine itself lacks."""
        if name == "core":  # not set yet (failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.core, name)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> None:
        """Validate and queue one request (n > 1 becomes n sequences). Raises ValueError.
        `lora_request`: an xlaserve.lora.LoRARequest (None: the base model)."""
        reqs = self.processor.add_request(
            request_id, prompt, params, priority, arrival_time, cache_salt, lora_request
        )
        try:
            self.core.add_requests(reqs)
        except BaseException:
            self.core.abort_requests(self.processor.drop(request_id))
            raise

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for rid in list(request_ids):
            self.core.abort_requests(self.processor.drop(rid))

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.processor.get_num_unfinished_requests()

    # ------------------------------------------------------------------ the step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; the RequestOutputs of the requests that changed. `final_only`: only
        those of requests that finished (offline `generate` needs no others; building a
        RequestOutput per running request and step is a large part of the host time).

        Async scheduling (in the core): each call returns the outputs of the step launched by
        the previous call while the next one runs on the device."""
        outputs, stopped = self.processor.process(self.core.step(), final_only)
        if stopped:
            self.core.abort_requests(stopped, stopped=True)
        return outputs

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def wait_compiled(self) -> None:
        """Block until the runner's background compiles are done (`EngineCore.wait_compiled`)."""
        self.core.wait_compiled()

    def shutdown(self) -> None:
        self.core.shutdown()
