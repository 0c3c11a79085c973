"""`LLM`: offline batch inference (`LLM(model=...).generate(prompts, params)`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from xlaserve.config import EngineConfig, default_batch_limits
from xlaserve.engine.llm_engine import LLMEngine, PromptType
from xlaserve.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from xlaserve.platforms import current_platform
from xlaserve.sampling_params import BeamSearchParams, SamplingParams
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
        lora_request: Any = None,
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
        if isinstance(lora_request, Sequence):
            if len(lora_request) != len(prompts):
                raise ValueError("need one lora_request per prompt, or a single one for all")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompts)
        engine = self.llm_engine
        ids = []
        # An engine core process checks constrained / LoRA adds: one round trip for the batch.
        batched = getattr(engine, "batched_adds", contextlib.nullcontext)
        try:
            with batched():
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                    rid = engine.new_request_id()
                    engine.add_request(
                        rid, p, sp, priority=priority[i] if priority else 0, lora_request=loras[i]
                    )
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
        lora_request: Any = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's final output as soon as it finishes (not in input order).
        `lora_request`: a LoRARequest for every prompt, or a list (one per prompt, None = base)."""
        ids = self._add(prompts, sampling_params, priority, lora_request)
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
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order given. `lora_request`: a
        LoRARequest for every prompt, or a list of them (one per prompt, None = the base)."""
        results: dict[str, RequestOutput] = {}
        for out in self.generate_iter(prompts, sampling_params, use_tqdm, priority, lora_request):
            results[out.request_id] = out
        # Request ids are "req-<counter>", so their number gives the input order.
        return [results[r] for r in sorted(results, key=lambda r: int(r.rsplit("-", 1)[1]))]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation, then generate (vLLM's signature).

        `chat_template`: a Jinja template (or its file path) instead of the model's;
        `continue_final_message`: the last message stays open for the model to continue (pass
        add_generation_prompt=False with it); `tools`: tool definitions (OpenAI format) handed
        to the template as `tools`; `chat_template_kwargs`: extra template variables. Rendered
        by `Tokenizer.chat_prompt`, the function the server uses; content is trusted here
        (special-token text in it is read as tokens, as with a plain prompt)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
        if chat_template is not None:  # offline: a path is the caller's own file
            from xlaserve.tokenizer import load_chat_template

            kwargs["chat_template"] = load_chat_template(chat_template)
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if tools is not None:
            kwargs["tools"] = tools
        prompts = []
        for c in convs:
            text, ids = tok.chat_prompt(
                c, add_generation_prompt, special_tokens_in_content=True, **kwargs
            )
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of the model's generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens -> max_tokens);
        plain SamplingParams() when it has none (vLLM's rule)."""
        import json
        import os

        path = os.path.join(self.llm_engine.model_dir, "generation_config.json")
        if not os.path.exists(path):
            return SamplingParams()
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
        keys = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
        args: dict[str, Any] = {k: gen[k] for k in keys if gen.get(k) is not None}
        if gen.get("max_new_tokens") is not None:
            args["max_tokens"] = gen["max_new_tokens"]
        if gen.get("do_sample") is False:
            args["temperature"] = 0.0  # transformers' greedy flag
        return SamplingParams(**args)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`): each step every live beam is extended by one
        token with its top 2 x beam_width logprobs (capped at max_logprobs), and the best
        beam_width candidates by cumulative logprob go on; a beam ending in EOS (unless
        ignore_eos) is finished. Beams share their prefix's KV blocks through prefix caching.
        Returns per prompt the best beam_width sequences by
        cum_logprob / generated_len ** length_penalty, best first."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        tok = self.get_tokenizer()
        engine = self.llm_engine
        eos = set() if params.ignore_eos else set(engine.eos_token_ids)
        k = min(2 * params.beam_width, self.config.model.max_logprobs)
        if k < 1:
            raise ValueError("beam_search needs max_logprobs >= 1")
        step = SamplingParams(
            max_tokens=1, logprobs=k, temperature=params.temperature, ignore_eos=True
        )
        starts = [engine.processor.prompt_ids(p)[1] for p in prompts]
        live: list[list[BeamSearchSequence]] = [
            [BeamSearchSequence(list(ids), 0.0)] for ids in starts
        ]
        done: list[list[BeamSearchSequence]] = [[] for _ in starts]
        for _ in range(params.max_tokens):
            flat = [(i, b) for i, beams in enumerate(live) for b in beams]
            if not flat:
                break
            outs = self.generate(
                [{"prompt_token_ids": b.tokens} for _, b in flat], step, use_tqdm=False
            )
            cands: list[list[BeamSearchSequence]] = [[] for _ in starts]
            for (i, beam), out in zip(flat, outs, strict=True):
                for tid, lp in (out.outputs[0].logprobs or [{}])[0].items():
                    cands[i].append(
                        BeamSearchSequence(
                            beam.tokens + [tid],
                            beam.cum_logprob + lp.logprob,
                            logprobs=beam.logprobs + [out.outputs[0].logprobs[0]],
                        )
                    )
            for i, cs in enumerate(cands):
                cs.sort(key=lambda b: b.cum_logprob, reverse=True)
                live[i] = []
                for b in cs[: params.beam_width]:
                    if b.tokens[-1] in eos:
                        b.finish_reason = "stop"
                        done[i].append(b)
                    else:
                        live[i].append(b)
        results = []
        for i, ids in enumerate(starts):
            for b in live[i]:
                b.finish_reason = "length"
            n = len(ids)

            def score(b: BeamSearchSequence, n: int = n) -> float:
                return b.cum_logprob / max(len(b.tokens) - n, 1) ** params.length_penalty

            best = sorted(done[i] + live[i], key=score, reverse=True)[: params.beam_width]
            for b in best:
                gen = b.tokens[n:]
                if b.finish_reason == "stop" and not params.include_stop_str_in_output:
                    gen = gen[:-1]
                b.text = tok.decode(gen)
            results.append(BeamSearchOutput(best))
        return results
