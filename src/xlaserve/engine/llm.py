"""`LLM`: offline batch inference (`LLM(model=...).generate(prompts, params)`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from xlaserve.config import EngineConfig, default_batch_limits
from xlaserve.engine.llm_engine import LLMEngine, PromptType
from xlaserve.outputs import RequestOutput
from xlaserve.platforms import current_platform
from xlaserve.sampling_params import SamplingParams
from xlaserve.tokenizer import Tokenizer

Messages = list[dict[str, Any]]


class LLM:
    """Batch inference over continuous batching.

    `LLM(model=None)` serves the demo model shipped in the package. Every keyword argument names one
    field of the config dataclasses (`block_size`, `max_num_seqs`, `backend`, ...; see config.py).
    `engine_process=True` runs the engine core (scheduler, KV cache, model) in a child process
    (spawned: a script needs the `if __name__ == "__main__":` guard) and detokenizes here. The
    default stays in-process: offline on the CPU the two measured the same within the noise
    (bench/RESULTS.md, "Engine core process"); `bench/serve_vs_offline.py
    --offline-engine-process` measures it on a GPU.
    """

    def __init__(
        self, model: str | None = None, engine_process: bool = False, **kwargs: Any
    ) -> None:
        from xlaserve.logger import configure_logging

        configure_logging()  # XLASERVE_LOGGING_LEVEL covers offline use too
        # Offline batches take the platform's larger step budget unless the caller sets one.
        seqs, tokens = default_batch_limits(
            current_platform, offline=True, backend=kwargs.get("backend", "auto")
        )
        if kwargs.get("max_num_seqs") is None:
            kwargs["max_num_seqs"] = seqs
        if kwargs.get("max_num_batched_tokens") is None:
            kwargs["max_num_batched_tokens"] = tokens
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        if engine_process:  # the engine core in its own process (engine/core_client.py)
            from xlaserve.engine.core_client import MPLLMEngine

            self.llm_engine: LLMEngine = MPLLMEngine(self.config)  # type: ignore[assignment]
        else:
            self.llm_engine = LLMEngine(self.config)

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def _add(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
    ) -> list[str]:
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError("need one SamplingParams per prompt, or a single one for all")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("need one priority per prompt")
        engine = self.llm_engine
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                rid = engine.new_request_id()
                engine.add_request(rid, p, sp, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        return ids

    def generate_iter(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's final output as soon as it finishes (not in input order)."""
        ids = self._add(prompts, sampling_params, priority)
        pending = set(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        engine = self.llm_engine
        t0 = time.perf_counter()
        n_in = n_out = 0
        try:
            while pending:
                for out in engine.step(final_only=True):  # only finished ones are yielded
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(o.token_ids) for o in out.outputs)
                        if bar is not None:
                            dt = max(time.perf_counter() - t0, 1e-9)
                            bar.set_postfix_str(
                                f"in: {n_in / dt:.0f} tok/s, out: {n_out / dt:.0f} tok/s"
                            )
                            bar.update(1)
                        yield out
        finally:
            if pending:  # the consumer stopped early: free the rest
                engine.abort_request(pending)
            if bar is not None:
                bar.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order given."""
        results: dict[str, RequestOutput] = {}
        for out in self.generate_iter(prompts, sampling_params, use_tqdm, priority):
            results[out.request_id] = out
        # Request ids are "req-<counter>", so their number gives the input order.
        return [results[r] for r in sorted(results, key=lambda r: int(r.rsplit("-", 1)[1]))]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = [
            {"prompt_token_ids": tok.chat_prompt_ids(c, add_generation_prompt)} for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)
