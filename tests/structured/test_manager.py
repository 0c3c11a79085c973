"""StructuredOutputManager against xgrammar's own matcher: bitmask bits == accept_token,
vocab padding, special tokens, drafts, async compilation + LRU cache, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from tiny_models import VOCAB, write_tokenizer

from xlaserve.config import StructuredOutputConfig
from xlaserve.sampling_params import StructuredOutputsParams as SO
from xlaserve.structured.manager import StructuredOutputManager, build_grammar, choice_to_ebnf
from xlaserve.tokenizer import Tokenizer

MODEL_VOCAB = VOCAB + 16  # lm_head larger than the tokenizer (padded ids must never be allowed)
EOS = 0  # <|endoftext|>; 1, 2 are <|im_start|>, <|im_end|> (special, never allowed)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "n", "tags"],
}
# (spec, a text the spec accepts in full)
CASES = [
    (SO(json=SCHEMA), '{"name": "Day", "n": 7, "tags": ["a", "b"]}'),
    (SO(json_object=True), '{"k": [1, 2.5, null], "o": {"t": true}}'),
    (SO(regex=r"[a-z]{2,4}-\d\d"), "dark-42"),
    (SO(choice=["light", "dark 🙂", 'say "hi"']), 'say "hi"'),
    (SO(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'), "(1,23,4)"),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer(path)
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def mgr(tok: Tokenizer) -> StructuredOutputManager:
    m = StructuredOutputManager(tok, MODEL_VOCAB, [EOS])
    yield m
    m.shutdown()


def _ready(mgr: StructuredOutputManager, req_id: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not mgr.is_ready(req_id):
        assert not mgr.poll(), "compilation failed"
        mgr.wait_pending(0.05)
        assert time.monotonic() < deadline, "grammar compilation timed out"
    mgr.poll()


def _bits(row: np.ndarray) -> np.ndarray:
    """int32 [W] -> bool [MODEL_VOCAB]."""
    u = row.astype(np.int64) & 0xFFFFFFFF
    return ((u[:, None] >> np.arange(32)) & 1).reshape(-1)[:MODEL_VOCAB].astype(bool)


def _accepts(matcher, token: int) -> bool:  # noqa: ANN001 - an xgrammar GrammarMatcher
    if not matcher.accept_token(token):
        return False
    matcher.rollback(1)
    return True


@pytest.mark.parametrize(("spec", "text"), CASES, ids=lambda x: str(x)[:24])
def test_bitmask_equals_matcher_accept(
    mgr: StructuredOutputManager, tok: Tokenizer, spec: SO, text: str
) -> None:
    """At every position along an accepted text, bit t is set iff the matcher accepts t."""
    rid = f"r-{spec.key()[0]}"
    mgr.add_request(rid, mgr.prepare(spec))
    _ready(mgr, rid)
    matcher = mgr._matchers[rid]
    tokens = tok.encode(text, add_special_tokens=False) + [EOS]
    for i, t in enumerate(tokens):
        mask = mgr.fill_bitmask(rid)
        assert mask.shape == (1, (MODEL_VOCAB + 31) // 32) and mask.dtype == np.int32
        allowed = _bits(mask[0])
        expected = np.array([_accepts(matcher, v) for v in range(MODEL_VOCAB)])
        assert (allowed == expected).all(), f"position {i}"
        assert not allowed[VOCAB:].any()  # padded lm_head rows
        assert not allowed[1] and not allowed[2]  # special, non-stop tokens
        assert allowed[t]
        assert allowed[EOS] == (i == len(tokens) - 1)  # EOS only once the text is complete
        terminated, err = mgr.accept_tokens(rid, [t])
        assert err is None and terminated == (i == len(tokens) - 1)
    mgr.remove(rid)
    assert not mgr.has_matcher(rid)


def test_draft_rows(mgr: StructuredOutputManager, tok: Tokenizer) -> None:
    """Row i is the mask after drafts[:i]; the matcher is left where it was."""
    spec = SO(regex=r"[a-z]{2,4}-\d\d")
    mgr.add_request("d", mgr.prepare(spec))
    mgr.add_request("ref", mgr.prepare(spec))  # cache hit: ready at once
    assert mgr.is_ready("ref")
    _ready(mgr, "d")
    drafts = tok.encode("dark-4", add_special_tokens=False)
    bad = tok.encode("{", add_special_tokens=False)[0]
    masks = mgr.fill_bitmask("d", drafts)
    assert masks.shape[0] == len(drafts) + 1
    for i in range(len(drafts) + 1):
        assert (masks[i] == mgr.fill_bitmask("ref")[0]).all(), f"row {i}"
        if i < len(drafts):
            mgr.accept_tokens("ref", [drafts[i]])
    assert (mgr.fill_bitmask("d")[0] == masks[0]).all()  # rolled back
    # A draft the grammar rejects: rows after it allow everything (verification stops there).
    rejected = mgr.fill_bitmask("d", [bad, drafts[0]])
    assert not _bits(rejected[0])[bad] and (rejected[1:] == -1).all()
    # A token outside the grammar is reported, not silently accepted.
    terminated, err = mgr.accept_tokens("d", [bad])
    assert not terminated and err is not None and str(bad) in err
    mgr.remove("d")
    mgr.remove("ref")


def test_fill_bitmasks_batch_equals_single(mgr: StructuredOutputManager, tok: Tokenizer) -> None:
    """One step's masks filled in one pass (xgrammar batch call + draft rows) equal the
    per-request fills, row for row; unconstrained ids are left out; matchers do not move."""
    specs = [spec for spec, _ in CASES]
    texts = [text for _, text in CASES]
    rids = [f"b{i}" for i in range(len(specs))]
    for rid, spec in zip(rids, specs, strict=True):
        mgr.add_request(rid, mgr.prepare(spec))
        _ready(mgr, rid)
    # Move the matchers to different places along their texts.
    for i, (rid, text) in enumerate(zip(rids, texts, strict=True)):
        assert mgr.accept_tokens(rid, tok.encode(text, add_special_tokens=False)[:i]) == (
            False,
            None,
        )
    drafts = {rids[1]: tok.encode('{"k', add_special_tokens=False), rids[3]: [EOS]}
    order = [rids[4], "plain", rids[0], rids[1], rids[2], rids[3]]
    before = {rid: mgr.fill_bitmask(rid, drafts.get(rid)) for rid in rids}
    masks = mgr.fill_bitmasks(order, drafts)
    assert list(masks) == [r for r in order if r != "plain"]
    base = next(iter(masks.values())).base
    for rid in rids:
        assert masks[rid].base is base  # views of one buffer
        assert masks[rid].shape == before[rid].shape
        assert (masks[rid] == before[rid]).all(), rid
    # Nothing advanced: a second pass gives the same rows.
    again = mgr.fill_bitmasks(order, drafts)
    for rid in rids:
        assert (again[rid] == masks[rid]).all(), rid
    assert mgr.fill_bitmasks(["plain"]) == {}
    for rid in rids:
        mgr.remove(rid)


def test_accept_step_batch_equals_one_by_one(mgr: StructuredOutputManager, tok: Tokenizer) -> None:
    """A step's batch accept (one token per request) gives the verdicts that accepting the
    tokens one request at a time gives: a grammar's stop token ends it, a token past the end
    is ignored, a token the grammar rejects is an error, the others go on."""
    text = "dark-42"
    ids = tok.encode(text, add_special_tokens=False)
    bad = tok.encode("{", add_special_tokens=False)[0]
    # rid -> (tokens accepted before the step, the step's token)
    plan = {
        "go": ([], ids[0]),  # accepted, grammar goes on
        "stop": (ids, EOS),  # accepted stop token: terminated
        "past": (ids + [EOS], ids[0]),  # already terminated: ignored
        "bad": ([], bad),  # rejected: error
        "go2": (ids[:1], ids[1]),
    }
    for tag in ("a", "b"):  # a: accept_step, b: accept_tokens one by one
        for rid, (pre, _) in plan.items():
            mgr.add_request(tag + rid, mgr.prepare(SO(regex=r"[a-z]{2,4}-\d\d")))
            _ready(mgr, tag + rid)
            mgr.accept_tokens(tag + rid, pre)
    got = mgr.accept_step([("a" + rid, [t]) for rid, (_, t) in plan.items()] + [("plain", [5])])
    want = {rid: mgr.accept_tokens("b" + rid, [t]) for rid, (_, t) in plan.items()}
    # Only verdicts come back from the batch (requests whose grammar goes on get no entry).
    assert {rid[1:]: v for rid, v in got.items()} == {
        rid: v for rid, v in want.items() if v != (False, None)
    }
    assert want["go"] == want["go2"] == (False, None)
    assert want["stop"] == want["past"] == (True, None)
    assert want["bad"][0] is False and "violates" in (want["bad"][1] or "")
    for tag in ("a", "b"):
        for rid in plan:
            mgr.remove(tag + rid)


def test_batch_accept_split_over_threads(tok: Tokenizer) -> None:
    """With accept_threads > 1 the batch accept runs in slices on several threads: every
    row's result, and every matcher's state after it, equal accepting one matcher at a time,
    in row order (rows of a rejected token and of an accepted one interleave unevenly, so a
    slice out of place changes the result)."""
    m = StructuredOutputManager(tok, MODEL_VOCAB, [EOS], StructuredOutputConfig(accept_threads=3))
    try:
        ids = tok.encode("dark-42", add_special_tokens=False)
        bad = tok.encode("{", add_special_tokens=False)[0]
        n = 101  # three slices of 33 / 34 rows (>= MIN_ROWS_PER_ACCEPT_THREAD each)
        spec = SO(regex=r"[a-z]{2,4}-\d\d")
        m.add_request("probe", m.prepare(spec))
        _ready(m, "probe")
        compiled = m._cache[spec.key()]
        split = [m._xgr.GrammarMatcher(compiled) for _ in range(n)]
        ref = [m._xgr.GrammarMatcher(compiled) for _ in range(n)]
        rounds = [[bad if i % 7 in (2, 5) or i > 90 else ids[0] for i in range(n)],
                  [ids[1] if i % 3 else bad for i in range(n)]]  # fmt: skip
        for toks in rounds:
            got = m.batch_accept(split, toks)
            want = [int(r.accept_token(t)) for r, t in zip(ref, toks, strict=True)]
            assert [int(x) for x in got] == want
            assert 0 < sum(want) < n  # both kinds of row in every round
        assert m._accept_pool is not None  # the split ran on the workers
        for a, b in zip(split, ref, strict=True):  # the same state: the same next mask
            ma = np.zeros((1, m.num_words), np.int32)
            mb = np.ones((1, m.num_words), np.int32)
            a.fill_next_token_bitmask(ma, 0)
            b.fill_next_token_bitmask(mb, 0)
            assert np.array_equal(ma, mb)
    finally:
        m.shutdown()


def test_async_compile_and_lru(tok: Tokenizer) -> None:
    m = StructuredOutputManager(tok, MODEL_VOCAB, [EOS], StructuredOutputConfig(cache_size=2))
    try:
        specs = [SO(regex=f"a{{{k}}}b") for k in (1, 2, 3)]
        for i, s in enumerate(specs):
            m.add_request(f"q{i}", m.prepare(s))
            assert m.is_constrained(f"q{i}")
        m.add_request("q0-twin", m.prepare(specs[0]))  # same key: one compilation
        for rid in ("q0", "q1", "q2", "q0-twin"):
            _ready(m, rid)
            assert m.has_matcher(rid)
        assert m.num_compiled == 3
        assert list(m._cache) == [s.key() for s in specs[1:]]  # q0's grammar evicted (LRU 2)
        assert m.prepare(specs[0]).grammar is not None  # evicted: parsed again
        assert m.prepare(specs[2]).grammar is None  # cached: no parse at all
        assert not m.has_pending()
    finally:
        m.shutdown()


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (SO(json="{not json"), "not valid JSON"),
        (SO(json='["a list"]'), "must be an object"),
        (SO(json={"type": "foo"}), 'Unsupported type "foo"'),
        (SO(json={"properties": {"a": {"$ref": "#/defs/x"}}}), "defs"),
        (SO(regex="(ab"), "parenthesis is not closed"),
        (SO(grammar="root ::= foo"), 'Rule "foo" is not defined'),
        (SO(grammar="root ::= "), "grammar"),
    ],
)
def test_bad_specs_raise_with_reason(spec: SO, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as ei:
        build_grammar(spec)
    assert ".cc:" not in str(ei.value)  # no C++ source locations in user-facing errors


def test_choice_ebnf_escapes() -> None:
    choices = ['a "q"', "back\\slash", "new\nline", "ünï 🙂", "[x]*"]
    assert choice_to_ebnf(choices).startswith('root ::= "a \\"q\\"" | ')
    build_grammar(SO(choice=choices))  # parses


def test_import_is_lazy() -> None:
    code = (
        "import sys, xlaserve.structured, xlaserve.structured.manager, xlaserve.engine.llm_engine;"
        "bad = [m for m in ('xgrammar', 'torch', 'jax') if m in sys.modules];"
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]


def test_schema_text_and_dict_both_work(mgr: StructuredOutputManager) -> None:
    a, b = mgr.prepare(SO(json=SCHEMA)), mgr.prepare(SO(json=json.dumps(SCHEMA)))
    assert a.key[0] == b.key[0] == "json"


def test_length_bounded_strings_reject_control_chars(mgr: StructuredOutputManager) -> None:
    """xgrammar's bounded-string rule admits raw TAB etc. (invalid JSON); ours does not."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}}
    compiled = mgr._compiler.compile_grammar(build_grammar(SO(json=schema)))
    for text, ok in [('{"s": "a\tb"}', False), ('{"s": "ab"}', True), ('{"s": "abcde"}', False)]:
        m = xgr.GrammarMatcher(compiled)
        assert (m.accept_string(text) and m.is_completed()) == ok, text


def test_fill_threads_auto_rule() -> None:
    from xlaserve.config import fill_threads

    assert [fill_threads(0, n) for n in (None, 1, 2, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    assert fill_threads(3, 2) == 3  # a configured count is kept


def test_threaded_batch_fill_equals_one_thread(tok: Tokenizer) -> None:
    """A step with >= MIN_ROWS_THREADED_FILL rows takes the threaded fill; its masks equal the
    one-thread fill's, row for row, for matchers at different positions of a grammar."""
    from xlaserve.structured.manager import MIN_ROWS_THREADED_FILL

    n = MIN_ROWS_THREADED_FILL + 5
    masks = {}
    for threads in (1, 3):
        m = StructuredOutputManager(
            tok, MODEL_VOCAB, [EOS], config=StructuredOutputConfig(bitmask_fill_threads=threads)
        )
        try:
            assert m.fill_threads == threads
            grammar = m.prepare(SO(json=SCHEMA))
            text = '{"name": "Day", "n": 7, "tags": ["a", "b"]}'
            ids = tok.encode(text, add_special_tokens=False)
            for i in range(n):
                m.add_request(f"r{i}", grammar)
                _ready(m, f"r{i}")
                terminated, err = m.accept_tokens(f"r{i}", ids[: i % len(ids)])
                assert err is None
            masks[threads] = m.fill_bitmasks([f"r{i}" for i in range(n)])
        finally:
            m.shutdown()
    assert len(masks[1]) == n
    for rid, row in masks[1].items():
        assert np.array_equal(row, masks[3][rid]), rid
    # Rows differ across positions (the check compares real masks, not n copies of one).
    assert len({masks[1][f"r{i}"].tobytes() for i in range(n)}) > 5
