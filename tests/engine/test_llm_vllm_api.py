"""LLM's vLLM methods: chat(chat_template, continue_final_message, tools, chat_template_kwargs),
get_default_sampling_params and beam_search, on a tiny Llama (ChatML template) and the torch
backend."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator

import pytest

from xlaserve import LLM, BeamSearchParams, SamplingParams

ARGS = dict(backend="torch", dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8,
            max_num_batched_tokens=64)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | length }}|{% endif %}{% if flag %}FLAG:{{ flag }}|{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}[end]{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> Iterator[LLM]:  # noqa: ANN001
    engine = LLM(tiny_model_dir("llama"), **ARGS)
    yield engine
    engine.llm_engine.shutdown()


def _prompt(llm: LLM, messages: list[dict], **kw: object) -> str:
    return llm.chat(messages, GREEDY, use_tqdm=False, **kw)[0].prompt


def test_chat_template_tools_and_kwargs(llm: LLM, tmp_path) -> None:  # noqa: ANN001
    msgs = [{"role": "user", "content": "hi"}]
    assert _prompt(llm, msgs).startswith("<|im_start|>user\nhi<|im_end|>")  # the model's own
    assert _prompt(llm, msgs, chat_template=TEMPLATE) == "[user]hi[end][assistant]"
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    got = _prompt(
        llm, msgs, chat_template=str(path), tools=tools, chat_template_kwargs={"flag": "x"}
    )
    assert got == "TOOLS:1|FLAG:x|[user]hi[end][assistant]"
    with pytest.raises(ValueError, match="does not exist"):
        _prompt(llm, msgs, chat_template=str(tmp_path / "missing.jinja"))


def test_chat_continue_final_message(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    out = llm.chat(
        msgs, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )[0]
    assert out.prompt.endswith("<|im_start|>assistant\nOnce upon")
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
    assert (
        _prompt(
            llm,
            msgs,
            chat_template=TEMPLATE,
            add_generation_prompt=False,
            continue_final_message=True,
        )
        == "[user]hi[end][assistant]Once upon"
    )
    with pytest.raises(ValueError, match="exclude each other"):
        _prompt(llm, msgs, continue_final_message=True)


def test_get_default_sampling_params(llm: LLM, tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    src = tiny_model_dir("llama")
    with open(os.path.join(src, "generation_config.json")) as f:
        gen = json.load(f)
    p = llm.get_default_sampling_params()
    want = {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}
    assert all(getattr(p, k) == v for k, v in want.items())
    model = tmp_path / "m"
    shutil.copytree(src, model)
    gen.update(temperature=0.6, top_p=0.9, top_k=5, max_new_tokens=7, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(gen))
    other = LLM(str(model), **ARGS)
    try:
        p = other.get_default_sampling_params()
    finally:
        other.llm_engine.shutdown()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.9, 5, 7)


def test_beam_search(llm: LLM) -> None:
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    greedy = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    one = llm.beam_search(prompt, BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))
    assert one[0].sequences[0].tokens == [5, 6, 7, 8, *greedy.outputs[0].token_ids]
    outs = llm.beam_search(
        [prompt, {"prompt_token_ids": [40, 41]}],
        BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True),
    )
    assert len(outs) == 2
    for out, start in zip(outs, ([5, 6, 7, 8], [40, 41]), strict=True):
        seqs = out.sequences
        assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) == 3
        scores = [s.cum_logprob for s in seqs]
        assert scores == sorted(scores, reverse=True)  # same length: ranked by cum_logprob
        for s in seqs:
            assert s.tokens[: len(start)] == start and len(s.tokens) == len(start) + 4
            gen = s.tokens[len(start) :]
            total = sum(pos[t].logprob for pos, t in zip(s.logprobs, gen, strict=True))
            assert math.isclose(s.cum_logprob, total, rel_tol=1e-6)
            assert s.finish_reason == "length" and s.text == llm.get_tokenizer().decode(gen)
    with pytest.raises(ValueError):
        BeamSearchParams(beam_width=0, max_tokens=4)
