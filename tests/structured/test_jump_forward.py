"""Jump-forward decoding (StructuredOutputConfig.jump_forward): tokens the grammar forces (a
bitmask that admits exactly one token) are appended without a forward step each.

Exactness is checked against decoding token by token: the same tokens for greedy requests, on
both backends, with fewer engine steps (counted, not timed)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from optional_deps import backend_available
from tiny_models import VOCAB, write_tokenizer

from xlaserve import LLM, SamplingParams
from xlaserve.sampling_params import StructuredOutputsParams as SO
from xlaserve.structured.manager import StructuredOutputManager
from xlaserve.tokenizer import Tokenizer

EOS = 0  # <|endoftext|>
BACKENDS = ["torch"] + (["xla"] if backend_available("xla") else [])

# Long keys the schema forces (additionalProperties false, all required: the key order is fixed).
LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "description_of_the_field_with_a_long_name": {"type": "string", "maxLength": 5},
        "another_quite_long_forced_key_name": {"type": "integer", "minimum": 0, "maximum": 9},
        "flag_that_ends_the_object": {"type": "boolean"},
    },
    "required": [
        "description_of_the_field_with_a_long_name",
        "another_quite_long_forced_key_name",
        "flag_that_ends_the_object",
    ],
    "additionalProperties": False,
}
REGEX = r"qzxv-[0-9]{2}-jkqw"
PROMPTS = ["In the beginning", "And God said", "the waters", "Let there be light"]
ENGINE_KW = {
    "dtype": "float32",
    "block_size": 4,
    "num_kv_blocks": 256,
    "max_model_len": 256,
    # Few shape buckets: the XLA backend compiles each one at start.
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    # Grammars compile on a thread: no compile worker processes to start per engine.
    "compile_workers": 0,
}


def _greedy(max_tokens: int, so: SO | None = None, **kw) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)


def _steps(llm: LLM) -> int:
    """Engine steps that computed tokens so far (the tokens-per-step histogram's count)."""
    return sum(llm.llm_engine.get_stats().iteration_tokens_buckets)


# ----- the manager's rule ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mgr(tmp_path_factory: pytest.TempPathFactory) -> StructuredOutputManager:
    path = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer(path)
    m = StructuredOutputManager(Tokenizer.from_dir(path), VOCAB + 16, [EOS])
    yield m
    m.shutdown()


def _attach(mgr: StructuredOutputManager, req_id: str, so: SO) -> None:
    mgr.add_request(req_id, mgr.prepare(so))
    for _ in range(1200):  # bounded: 60 s
        if mgr.is_ready(req_id):
            break
        assert not mgr.poll(), "compilation failed"
        mgr.wait_pending(0.05)
    mgr.poll()
    assert mgr.has_matcher(req_id)


def _one_token(mask_row) -> int | None:  # noqa: ANN001 - numpy int32 [W]
    """The only token a bitmask row admits, else None."""
    bits = [32 * w + b for w, v in enumerate(mask_row.tolist()) for b in range(32) if v >> b & 1]
    return bits[0] if len(bits) == 1 else None


@pytest.mark.parametrize(
    "so",
    [SO(json=LONG_KEYS_SCHEMA), SO(regex=REGEX), SO(grammar='root ::= "qz"')],
    ids=["schema", "regex", "ebnf-then-eos"],
)
def test_forced_tokens_are_exactly_the_one_token_masks(
    mgr: StructuredOutputManager, so: SO
) -> None:
    """forced_tokens == walking the bitmask one position at a time while it admits one token
    (never the stop token); the matcher ends where the walk ends."""
    _attach(mgr, "ref", so)
    _attach(mgr, "jf", so)
    try:
        want = []
        while (tok := _one_token(mgr.fill_bitmask("ref")[0])) is not None and tok != EOS:
            assert mgr.accept_tokens("ref", [tok]) == (False, None)
            want.append(tok)
        got = mgr.forced_tokens("jf", 1000, lambda t: t == EOS)
        assert got == want and len(want) >= 2
        assert (mgr.fill_bitmask("jf") == mgr.fill_bitmask("ref")).all()
    finally:
        mgr.remove("ref")
        mgr.remove("jf")


def test_forced_tokens_limit_and_stop(mgr: StructuredOutputManager) -> None:
    _attach(mgr, "a", SO(regex=REGEX))
    _attach(mgr, "b", SO(grammar='root ::= "qz"'))
    try:
        first = mgr.forced_tokens("a", 2)
        assert len(first) == 2
        assert len(mgr.forced_tokens("a", 1000)) >= 1  # the rest of "qzxv-"
        forced = mgr.forced_tokens("b", 1000, lambda t: t == EOS)
        assert len(forced) == 2 and forced[-1] != EOS  # the stop token is left to the sampler
        assert _one_token(mgr.fill_bitmask("b")[0]) == EOS
        assert mgr.forced_tokens("b", 1000, lambda t: t == EOS) == []
    finally:
        mgr.remove("a")
        mgr.remove("b")


# ----- end to end, both backends -----------------------------------------------------------------


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest, tiny_model_dir):  # noqa: ANN001, ANN201
    """(token-by-token LLM, jump-forward LLM) on one backend, same model and shapes."""
    path = tiny_model_dir("llama")
    plain = LLM(path, backend=request.param, **ENGINE_KW)
    jf = LLM(path, backend=request.param, jump_forward=True, **ENGINE_KW)
    yield plain, jf
    plain.llm_engine.shutdown()
    jf.llm_engine.shutdown()


@pytest.mark.timeout(600)  # a runner / scheduler token mismatch hangs the loop
def test_greedy_output_equals_token_by_token_in_fewer_steps(pair) -> None:  # noqa: ANN001
    """A mixed batch (long-key schema, regex, plain): the same tokens with and without
    jump-forward, valid for the schema, in fewer engine steps; the forced tokens are output
    tokens (counted in the engine's generation tokens)."""
    plain, jf = pair
    params = [
        _greedy(200, SO(json=LONG_KEYS_SCHEMA)),
        _greedy(200, SO(json=LONG_KEYS_SCHEMA)),
        _greedy(40, SO(regex=REGEX)),
        _greedy(12, ignore_eos=True),
    ]
    outs = {}
    steps = {}
    gen = {}
    for name, llm in (("plain", plain), ("jf", jf)):
        s0, g0 = _steps(llm), llm.llm_engine.get_stats().generation_tokens_total
        outs[name] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        steps[name] = _steps(llm) - s0
        gen[name] = llm.llm_engine.get_stats().generation_tokens_total - g0
    for w, g in zip(outs["plain"], outs["jf"], strict=True):
        assert g.token_ids == w.token_ids
        assert g.text == w.text and g.finish_reason == w.finish_reason
    for o in outs["jf"][:2]:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), LONG_KEYS_SCHEMA)
    assert re.fullmatch(REGEX, outs["jf"][2].text)
    assert gen["jf"] == gen["plain"] == sum(len(o.token_ids) for o in outs["jf"])
    assert jf.llm_engine.num_jump_forward_tokens > 0
    assert plain.llm_engine.num_jump_forward_tokens == 0
    # the long keys take most of the tokens: far fewer steps
    assert steps["jf"] < steps["plain"] * 0.6, steps


@pytest.mark.timeout(600)  # a runner / scheduler token mismatch hangs the loop
def test_logprobs_requests_decode_token_by_token(pair) -> None:  # noqa: ANN001
    """A request that asks for logprobs gets one real entry per token (no jump for it)."""
    plain, jf = pair
    params = _greedy(200, SO(json=LONG_KEYS_SCHEMA), logprobs=1)
    before = jf.llm_engine.num_jump_forward_tokens
    got = jf.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    want = plain.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert jf.llm_engine.num_jump_forward_tokens == before
    assert got.token_ids == want.token_ids
    assert len(got.logprobs) == len(got.token_ids)


@pytest.mark.timeout(600)  # a runner / scheduler token mismatch hangs the loop
def test_speculative_ngram_with_jump_forward(pair, tiny_model_dir) -> None:  # noqa: ANN001
    """n-gram drafts and jump-forward together: the same greedy tokens as token by token."""
    plain, _ = pair
    llm = LLM(
        tiny_model_dir("llama"),
        backend=plain.llm_engine.backend,
        jump_forward=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        **ENGINE_KW,
    )
    try:
        prompt = '{"description_of_the_field_with_a_long_name": "a", "flag": true}'
        params = [_greedy(150, SO(json=LONG_KEYS_SCHEMA)), _greedy(40, SO(regex=REGEX))]
        want = plain.generate([prompt, prompt], params, use_tqdm=False)
        got = llm.generate([prompt, prompt], params, use_tqdm=False)
        assert llm.llm_engine.num_jump_forward_tokens > 0
        for w, g in zip(want, got, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
    finally:
        llm.llm_engine.shutdown()


def test_draft_model_with_jump_forward_is_refused(tiny_model_dir) -> None:  # noqa: ANN001
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="jump-forward works with speculative method 'ngram'"):
        LLM(
            path,
            backend="torch",
            jump_forward=True,
            speculative_config={"method": "draft_model", "model": path},
            **ENGINE_KW,
        )


@pytest.mark.timeout(600)  # a runner / scheduler token mismatch hangs the loop
def test_preemption_and_chunks_with_jump_forward(tiny_model_dir) -> None:  # noqa: ANN001
    """A tiny KV cache (preemption by recompute, also of a request whose forced tokens the
    runner has not been sent yet) and a small token budget (a jump split over chunks): the
    same tokens as token by token."""
    kw = {**ENGINE_KW, "num_kv_blocks": 64, "max_num_batched_tokens": 16}
    path = tiny_model_dir("llama")
    prompts = [" ".join(PROMPTS * 2), PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    params = [_greedy(200, SO(json=LONG_KEYS_SCHEMA)) for _ in range(3)] + [
        _greedy(40, SO(regex=REGEX))
    ]
    outs = {}
    for jf in (False, True):
        llm = LLM(path, backend="torch", jump_forward=jf, **kw)
        try:
            outs[jf] = [
                o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
            ]
            assert llm.llm_engine.get_stats().num_preemptions_total > 0
            assert (llm.llm_engine.num_jump_forward_tokens > 0) == jf
        finally:
            llm.llm_engine.shutdown()
    assert outs[True] == outs[False]


def test_cli_flag_maps_onto_config() -> None:
    """`--structured-jump-forward` (off by default) and its max-tokens flag reach
    StructuredOutputConfig; a bad max is refused."""
    from xlaserve.entrypoints import cli

    def parse(args: list[str]):  # noqa: ANN202 - an EngineConfig
        ctx = cli.serve.make_context("serve", args)
        return cli.build_engine_config(None, cli._sections_kwargs(ctx))

    assert parse([]).structured.jump_forward is False
    on = parse(["--structured-jump-forward", "--structured-jump-forward-max-tokens", "8"])
    assert on.structured.jump_forward is True and on.structured.jump_forward_max_tokens == 8
    with pytest.raises(ValueError, match="jump_forward_max_tokens"):
        parse(["--structured-jump-forward-max-tokens", "0"])
