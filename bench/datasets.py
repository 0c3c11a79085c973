"""Benchmark datasets: lists of `SampleRequest` built reproducibly from a seed.

- random: prompts of random token ids from the tokenizer's vocabulary (decoded to text), or random
  English words when no tokenizer is given (then `prompt_len` is the word count, an estimate).
- sharegpt: a local JSON file in ShareGPT format (`[{"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", "value": ...}, ...]}, ...]`); first human turn is the prompt, the
  reply's length is the output length. Nothing is downloaded.
- prefix-repetition: `num_prefixes` shared prefixes of `prefix_len` tokens, each followed by
  distinct random suffixes of `input_len` tokens (exercises prefix caching).
- file: JSON lines `{"prompt": str, "output_len": int (optional)}`.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any

# Common English words (mostly one BPE token each with a leading space): prompts without a
# tokenizer, and a vocabulary that any server's tokenizer handles.
WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        """the of and to in is was he for it with as his on be at by had are but from or have an they
    which one you were all we her she there would their will when who him been has more if no out
    so said what up its about than into them can only other time new some could these two may first
    then do any like my now over such our man me even most made after also did many before must
    through back years where much your way well down should because each just those people how too
    little state good very make world still own see men work long get here between both life being
    under never day same another know while last might us great old year off come since against go
    came right used take three light water house small place found world hand high year word
    river stone bread land city night green sound story city field table open morning window paper
    garden winter summer music letter number answer market bridge castle forest""".split()
    )
)


@dataclass
class SampleRequest:
    """One benchmark request."""

    prompt: str
    prompt_len: int | None  # tokens (None when unknown: no tokenizer and not counted yet)
    expected_output_len: int | None  # max_tokens to ask for (None = server default)


class BenchTokenizer:
    """The tokenizer a benchmark counts with: a `tokenizers.Tokenizer` (tokenizer.json), or
    transformers' AutoTokenizer when the directory has no tokenizer.json."""

    def __init__(self, path: str) -> None:
        self.path = path
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self._hf: Any = None
        self._tok: Any = None
        self._pool: list[int] | None = None
        if os.path.isfile(file):
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(file)
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            self.special_ids = {
                int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special
            }
        elif os.path.isdir(path):
            from transformers import AutoTokenizer  # optional, only for slow-only tokenizers

            self._hf = AutoTokenizer.from_pretrained(path)
            self.vocab_size = len(self._hf)
            self.special_ids = set(self._hf.all_special_ids)
        else:
            raise FileNotFoundError(
                f"no tokenizer at {path!r} (need a directory or tokenizer.json)"
            )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens (what a prompt contributes)."""
        if self._tok is not None:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=True)
        return self._hf.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def normal_ids(self) -> list[int]:
        """Ids random prompts draw from: not special, and decoding to whole characters (a lone
        byte of a multi-byte character decodes to U+FFFD, which re-encodes as 3 tokens)."""
        if self._pool is None:
            self._pool = []
            for i in range(self.vocab_size):
                if i in self.special_ids:
                    continue
                text = self.decode([i])
                if text and "\ufffd" not in text and text.isprintable():
                    self._pool.append(i)
        return self._pool


def _random_text(
    rng: random.Random, n: int, tokenizer: BenchTokenizer | None, pool: list[int] | None
) -> tuple[str, int]:
    """Random text of about `n` tokens -> (text, exact token count, or n words without tokenizer).

    With a tokenizer, random ids are decoded and re-encoded: decoding can merge or split tokens,
    so the text is re-cut to n ids a few times until its length is stable (or close).
    """
    if n <= 0:
        return "", 0
    if tokenizer is None:
        return " ".join(rng.choice(WORDS) for _ in range(n)), n
    assert pool
    ids = [rng.choice(pool) for _ in range(n)]
    text = tokenizer.decode(ids)
    for _ in range(10):
        enc = tokenizer.encode(text)
        if len(enc) == n:
            return text, n
        ids = enc[:n] if len(enc) > n else enc + [rng.choice(pool) for _ in range(n - len(enc))]
        text = tokenizer.decode(ids)
    return text, tokenizer.count(text)


def _lens(rng: random.Random, base: int, range_ratio: float, n: int) -> list[int]:
    """n integers uniform in [base * (1 - r), base * (1 + r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(base * (1.0 - range_ratio)))
    hi = max(lo, int(base * (1.0 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def sample_random(
    num_prompts: int,
    input_len: int,
    output_len: int,
    tokenizer: BenchTokenizer | None = None,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Random prompts; a shared random prefix of `prefix_len` tokens when > 0."""
    rng = random.Random(seed)
    pool = tokenizer.normal_ids() if tokenizer is not None else None
    prefix, plen = _random_text(rng, prefix_len, tokenizer, pool)
    in_lens = _lens(rng, input_len, range_ratio, num_prompts)
    out_lens = _lens(rng, output_len, range_ratio, num_prompts)
    reqs = []
    for il, ol in zip(in_lens, out_lens, strict=True):
        body, _ = _random_text(rng, il, tokenizer, pool)
        prompt = f"{prefix} {body}" if prefix else body
        n = tokenizer.count(prompt) if tokenizer is not None else plen + il
        reqs.append(SampleRequest(prompt, n, ol))
    return reqs


def sample_prefix_repetition(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    num_prefixes: int,
    tokenizer: BenchTokenizer | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prefixes` shared prefixes x distinct suffixes, shuffled.

    Prompts are dealt round-robin over the prefixes, so each prefix has num_prompts //
    num_prefixes or one more suffixes.
    """
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = random.Random(seed)
    pool = tokenizer.normal_ids() if tokenizer is not None else None
    prefixes = [_random_text(rng, prefix_len, tokenizer, pool)[0] for _ in range(num_prefixes)]
    reqs = []
    for i in range(num_prompts):
        suffix, _ = _random_text(rng, suffix_len, tokenizer, pool)
        prompt = f"{prefixes[i % num_prefixes]} {suffix}"
        n = tokenizer.count(prompt) if tokenizer is not None else prefix_len + suffix_len
        reqs.append(SampleRequest(prompt, n, output_len))
    rng.shuffle(reqs)
    return reqs


def sample_sharegpt(
    path: str,
    num_prompts: int,
    tokenizer: BenchTokenizer | None = None,
    output_len: int | None = None,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[SampleRequest]:
    """First (human, reply) pair of each ShareGPT conversation, shuffled with `seed`.

    The output length is `output_len` when given, else the reply's token count (its word count x
    1.3 without a tokenizer). Pairs shorter than 4 tokens or longer than the limits are skipped.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    convs = [
        d["conversations"]
        for d in data
        if isinstance(d, dict) and len(d.get("conversations") or []) >= 2
    ]
    random.Random(seed).shuffle(convs)
    reqs: list[SampleRequest] = []
    for conv in convs:
        if len(reqs) >= num_prompts:
            break
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        if tokenizer is not None:
            plen = tokenizer.count(prompt)
            olen = output_len if output_len is not None else tokenizer.count(reply)
        else:
            plen = None
            olen = output_len if output_len is not None else round(len(reply.split()) * 1.3)
        if olen < 4 or (plen is not None and plen < 4):
            continue
        if plen is not None and (plen > max_prompt_len or plen + olen > max_total_len):
            continue
        reqs.append(SampleRequest(prompt, plen, olen))
    if len(reqs) < num_prompts:
        raise ValueError(
            f"{path} has only {len(reqs)} usable conversations, {num_prompts} were asked for"
        )
    return reqs


def sample_file(
    path: str,
    num_prompts: int | None,
    tokenizer: BenchTokenizer | None = None,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """JSON lines `{"prompt": ..., "output_len": ...}`; the first `num_prompts` lines (all if None),
    cycled when the file has fewer. `output_len` overrides the file's lengths."""
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: each line needs a string 'prompt'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} has no prompts")
    n = len(rows) if num_prompts is None else num_prompts
    reqs = []
    for i in range(n):
        row = rows[i % len(rows)]
        olen = output_len if output_len is not None else row.get("output_len")
        plen = tokenizer.count(row["prompt"]) if tokenizer is not None else None
        reqs.append(SampleRequest(row["prompt"], plen, None if olen is None else int(olen)))
    return reqs


DATASETS = ("random", "sharegpt", "prefix-repetition", "file")


def get_samples(
    dataset: str,
    num_prompts: int,
    tokenizer: BenchTokenizer | None,
    *,
    dataset_path: str | None = None,
    input_len: int = 128,
    output_len: int | None = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    num_prefixes: int = 4,
    seed: int = 0,
) -> list[SampleRequest]:
    """Dispatch on the dataset name (the CLI's `--dataset`)."""
    if dataset in ("sharegpt", "file") and not dataset_path:
        raise ValueError(f"--dataset {dataset} needs --dataset-path")
    if dataset == "random":
        return sample_random(
            num_prompts, input_len, output_len or 128, tokenizer, range_ratio, prefix_len, seed
        )
    if dataset == "prefix-repetition":
        return sample_prefix_repetition(
            num_prompts,
            prefix_len or 256,
            input_len,
            output_len or 128,
            num_prefixes,
            tokenizer,
            seed,
        )
    if dataset == "sharegpt":
        assert dataset_path
        return sample_sharegpt(dataset_path, num_prompts, tokenizer, output_len, seed)
    if dataset == "file":
        assert dataset_path
        return sample_file(dataset_path, num_prompts, tokenizer, output_len)
    raise ValueError(f"unknown dataset {dataset!r}; choose from {DATASETS}")
