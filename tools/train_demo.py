#!/usr/bin/env python
"""Train xlaserve's shipped demo model (and its draft model) on the King James Bible.

Builds everything from scratch, offline, on CPU:

1. corpus: ``bible "gen1:1-rev22:21"`` (Debian package ``bible-kjv``; public domain), parsed into
   chapters of verses. Every 50th chapter (~2% of the text) is held out for validation.
2. tokenizer: byte-level BPE (``tokenizers``), special tokens ``<|endoftext|>`` (eos/bos/pad),
   ``<|im_start|>``, ``<|im_end|>``; a ChatML chat template.
3. training documents: each training chapter as plain text (one verse per line), plus ~10% of the
   training verses wrapped as ChatML exchanges (user asks for "Book chap:verse", the assistant
   recites the verse), shuffled and packed into one token stream separated by ``<|endoftext|>``.
4. models: a Llama (``transformers.LlamaForCausalLM``, ~2M parameters) and a much smaller draft
   Llama (~0.2M) sharing the tokenizer, trained with AdamW + warmup/cosine on random windows of the
   stream under a wall-clock budget each, then scored on the held-out chapters.
5. output: ``OUT/demo-kjv/`` and ``OUT/demo-kjv-draft/`` in HF layout plus a README.md model card.

Reproducible: data order, initialisation and window sampling are seeded. With ``--max-steps`` the
schedule depends on steps only and the run is deterministic; with only ``--minutes`` the learning
rate follows elapsed time, so the number of steps depends on the machine's speed.

Usage (the shipped assets were made with the command recorded in their README.md)::

    apt-get install -y bible-kjv
    nice -n 5 python tools/train_demo.py --out src/xlaserve/assets --minutes 11 --draft-minutes 3.5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]  # ids 0, 1, 2

# ChatML: one "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then the assistant header
# when a generation prompt is asked for. String contents only (the server flattens parts).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

USER_PROMPTS = [
    "{ref}",
    "{ref}",
    "Recite {ref}.",
    "What does {ref} say?",
    "Quote {ref}.",
    "Read {ref} to me.",
    "Please give me {ref}.",
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You recite the King James Bible.",
    "Answer in the words of the King James Bible.",
]

BIBLE_RANGE = "gen1:1-rev22:21"
HELD_OUT_EVERY = 50  # every 50th chapter (1189 chapters -> 23 held out, ~2% of the text)
SAMPLE_PROMPT = "And God said"


@dataclass
class Chapter:
    book: str
    number: int
    verses: list[tuple[int, str]] = field(default_factory=list)  # (verse number, text)


@dataclass
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


MAIN_SHAPE = ModelShape(192, 4, 4, 2, 480)
DRAFT_SHAPE = ModelShape(64, 2, 4, 2, 176)


# ----------------------------------------------------------------------------- corpus


def read_bible_text(corpus_file: str | None) -> str:
    """The KJV as printed by the ``bible`` program (or read from a file it produced earlier)."""
    if corpus_file:
        with open(corpus_file, encoding="utf-8") as f:
            return f.read()
    if shutil.which("bible") is None:
        sys.exit("the `bible` program is missing: apt-get install -y bible-kjv")
    out = subprocess.run(["bible", BIBLE_RANGE], capture_output=True, check=True)
    return out.stdout.decode("utf-8")


_HEADER = re.compile(r"^(\S.*\S) (\d+)$")
_VERSE = re.compile(r"^ +(\d+) (.*)$")


def parse_chapters(text: str) -> list[Chapter]:
    """Parse ``bible`` output: "Book N" header lines, verses "  V text" wrapped onto more lines."""
    chapters: list[Chapter] = []
    prev_blank = True
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            prev_blank = True
            continue
        m = _VERSE.match(line)
        h = _HEADER.match(line) if prev_blank and not line.startswith(" ") else None
        if h:
            chapters.append(Chapter(h.group(1), int(h.group(2))))
        elif m:
            chapters[-1].verses.append((int(m.group(1)), m.group(2).strip()))
        else:  # a wrapped continuation of the current verse
            v, t = chapters[-1].verses[-1]
            chapters[-1].verses[-1] = (v, t + " " + line.strip())
        prev_blank = False
    return chapters


def chapter_text(ch: Chapter) -> str:
    return "".join(t + "\n" for _, t in ch.verses)


def chat_example(ch: Chapter, verse: int, text: str, rng: random.Random) -> str:
    ref = f"{ch.book} {ch.number}:{verse}"
    msgs = []
    if rng.random() < 0.25:
        msgs.append(("system", rng.choice(SYSTEM_PROMPTS)))
    msgs.append(("user", rng.choice(USER_PROMPTS).format(ref=ref)))
    msgs.append(("assistant", text))
    return "".join(f"{IM_START}{r}\n{c}{IM_END}\n" for r, c in msgs)


def build_documents(
    chapters: list[Chapter], chat_frac: float, seed: int
) -> tuple[list[str], list[str]]:
    """(training documents shuffled, held-out chapter texts)."""
    rng = random.Random(seed)
    train, val = [], []
    for i, ch in enumerate(chapters):
        if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1:
            val.append(chapter_text(ch))
            continue
        train.append(chapter_text(ch))
        for v, t in ch.verses:
            if rng.random() < chat_frac:
                train.append(chat_example(ch, v, t, rng))
    rng.shuffle(train)
    return train, val


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def save_tokenizer(tok, out_dir: str, max_len: int) -> None:
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, s in enumerate(SPECIAL_TOKENS)
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": added,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), cfg)
    _write_json(
        os.path.join(out_dir, "special_tokens_map.json"),
        {
            "bos_token": EOT,
            "eos_token": EOT,
            "pad_token": EOT,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def encode_stream(tok, docs: list[str]) -> list[int]:
    """Token ids of all docs, each followed by <|endoftext|> (id 0)."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(0)
    return ids


# ----------------------------------------------------------------------------- training


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    seconds: float
    final_train_loss: float
    val_loss: float
    val_ppl: float
    val_bits_per_byte: float
    num_parameters: int


def make_model(shape: ModelShape, vocab_size: int, max_pos: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def evaluate(model, val_ids, seq_len: int, val_bytes: int) -> tuple[float, float, float]:
    """Mean next-token loss over non-overlapping windows of the held-out stream.

    Returns (loss in nats/token, perplexity, bits per UTF-8 byte of held-out text).
    """
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    n = (len(val_ids) - 1) // seq_len
    data = torch.tensor(val_ids[: n * seq_len + 1])
    with torch.no_grad():
        for b in range(0, n, 16):
            rows = range(b, min(n, b + 16))
            x = torch.stack([data[r * seq_len : (r + 1) * seq_len] for r in rows])
            y = torch.stack([data[r * seq_len + 1 : (r + 1) * seq_len + 1] for r in rows])
            logits = model(input_ids=x).logits  # [B, L, V]
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            total += loss.item()
            count += y.numel()
    model.train()
    mean = total / count
    # The scored tokens cover all but the tail of the held-out text: scale bytes accordingly.
    bpb = total / math.log(2) / (val_bytes * count / (len(val_ids) - 1))
    return mean, math.exp(mean), bpb


def train_model(
    name: str,
    model,
    train_ids: list[int],
    val_ids: list[int],
    val_bytes: int,
    *,
    minutes: float,
    max_steps: int | None,
    seq_len: int,
    batch_size: int,
    lr: float,
    seed: int,
    log_every: int = 25,
) -> TrainResult:
    """AdamW, linear warmup then cosine to 10% of lr, over max(step/max_steps, elapsed/budget)."""
    import torch
    import torch.nn.functional as F

    data = torch.tensor(train_ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    budget = minutes * 60.0
    warmup = 30
    offsets = torch.arange(seq_len + 1)
    t0 = time.time()
    step, ema = 0, None
    model.train()
    while True:
        progress = (time.time() - t0) / budget if budget > 0 else 0.0
        if max_steps:
            progress = max(progress, step / max_steps) if budget > 0 else step / max_steps
        if progress >= 1.0:
            break
        scale = min(1.0, (step + 1) / warmup) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        )
        for g in opt.param_groups:
            g["lr"] = lr * scale
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        chunk = data[starts[:, None] + offsets]  # [B, L+1]
        logits = model(input_ids=chunk[:, :-1]).logits  # [B, L, V]
        loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % log_every == 0:
            el = time.time() - t0
            print(
                f"[{name}] step {step} loss {ema:.3f} lr {lr * scale:.2e} "
                f"{el:.0f}s {step * batch_size * seq_len / el:.0f} tok/s",
                flush=True,
            )
    seconds = time.time() - t0
    val_loss, val_ppl, bpb = evaluate(model, val_ids, seq_len, val_bytes)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"[{name}] done: {step} steps, {seconds:.0f}s, train loss {ema:.3f}, "
        f"held-out loss {val_loss:.4f} ppl {val_ppl:.2f} bpb {bpb:.3f}, params {n_params}",
        flush=True,
    )
    return TrainResult(
        step, step * batch_size * seq_len, seconds, float(ema), val_loss, val_ppl, bpb, n_params
    )


def greedy_sample(model, tok, prompt: str, max_new_tokens: int = 48) -> str:
    import torch

    model.eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=[0, 2],
            pad_token_id=0,
        )
    return tok.decode(out[0].tolist(), skip_special_tokens=False)


def chat_prompt(user: str) -> str:
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"


def save_model(model, out_dir: str, dtype: str) -> None:
    import torch
    from transformers import GenerationConfig

    model = model.to(getattr(torch, dtype))
    model.config.use_cache = True
    model.save_pretrained(out_dir, safe_serialization=True)
    # Older readers (and our own loader) look for torch_dtype/rope_theta at the top level.
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = dtype
    cfg["dtype"] = dtype
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    _write_json(path, cfg)
    # safetensors writes 0600 files; package data must be world-readable after install.
    os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)
    GenerationConfig(
        bos_token_id=0,
        eos_token_id=[0, 2],  # <|endoftext|>, <|im_end|>
        pad_token_id=0,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        top_k=0,
        max_new_tokens=128,
    ).save_pretrained(out_dir)


# ----------------------------------------------------------------------------- model cards

_CARD = """\
# {title}

{blurb}

A tiny Llama-architecture causal language model trained from scratch on the King James Bible. It
ships inside the `xlaserve` package so that `xlaserve serve` and `LLM()` work offline with no
download. It writes KJV-like English; it knows nothing else and is not useful for anything but
demos, smoke tests and benchmarks of the serving machinery.

## Model

| | |
|---|---|
| architecture | `LlamaForCausalLM` (transformers), tied input/output embeddings |
| parameters | {params:,} |
| hidden size / layers | {hidden_size} / {num_hidden_layers} |
| attention heads / KV heads | {num_attention_heads} / {num_key_value_heads} (grouped-query) |
| MLP intermediate size | {intermediate_size} (SwiGLU) |
| vocabulary | {vocab} byte-level BPE tokens (shared by demo-kjv and demo-kjv-draft) |
| context | {max_pos} positions (trained on {seq_len}-token windows), RoPE theta 10000 |
| weights dtype | {dtype} (`model.safetensors`, {size_mb:.2f} MB) |

Special tokens: `<|endoftext|>` (id 0: end of text, also bos and pad), `<|im_start|>` (1) and
`<|im_end|>` (2). `generation_config.json` stops on ids 0 and 2 and suggests temperature 0.8,
top_p 0.95; greedy decoding works too (it tends to repeat after a few dozen tokens).

Chat template (ChatML), in `tokenizer_config.json`:
`<|im_start|>{{role}}\\n{{content}}<|im_end|>\\n` per message, then `<|im_start|>assistant\\n` when a
generation prompt is asked for.

## Training

- Corpus: `bible "{bible_range}"` from Debian's `bible-kjv` package ({bytes:,} bytes,
  {chapters} chapters, {verses:,} verses), one verse per line, a document per chapter.
- Held out: every {every}th chapter ({held_out} chapters, {held_out_tokens:,} tokens,
  {held_out_bytes:,} bytes), never seen in tokenizer or model training.
- Chat data: ~{chat_pct:.0f}% of training verses also appear as a ChatML exchange (optional system
  message; user asks e.g. "Recite John 3:16."; the assistant answers with the verse text and
  `<|im_end|>`), so the model answers inside the template.
- Tokenizer: `tokenizers` byte-level BPE (ByteLevel pre-tokenizer and decoder, no prefix space),
  trained on the training chapters; any UTF-8 text round-trips.
- Optimisation: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), lr {lr:g} with 30 warmup
  steps then cosine to 10%, batch {batch} x {seq_len} tokens from random windows of the packed
  token stream ({train_tokens:,} tokens), gradient clipping 1.0, fp32 on CPU with {threads} threads (on a {cpu_count}-core host),
  seed {seed}, a wall-clock budget of {minutes:g} min: {steps} steps, {tokens_seen:,} tokens seen
  in {seconds:.0f} s (torch {torch}).

Exact commands:

```
apt-get install -y bible-kjv
{command}
```
{command_notes}
## Evaluation (held-out chapters, measured by the training script)

| model | parameters | held-out loss (nats/token) | perplexity | bits/byte |
|---|---|---|---|---|
{eval_rows}

## Samples (greedy, measured by the training script)

Prompt `And God said`:

```
{greedy}
```

Chat prompt (user: "John 3:16"), rendered with the chat template:

```
{chat}
```

## License

The King James Version text is in the public domain (outside the United Kingdom, where the Crown's
letters patent apply). The model weights, tokenizer and this card are part of xlaserve and are
released under the project's license (Apache-2.0).
"""


def write_model_cards(main_dir: str, draft_dir: str) -> None:
    """README.md model card in each model directory, from both runs' training_meta.json."""
    metas = {}
    for name, d in (("demo-kjv", main_dir), ("demo-kjv-draft", draft_dir)):
        with open(os.path.join(d, "training_meta.json"), encoding="utf-8") as f:
            metas[name] = json.load(f)
    rows = "\n".join(
        f"| {n} | {m['result']['num_parameters']:,} | {m['result']['val_loss']:.3f} | "
        f"{m['result']['val_ppl']:.1f} | {m['result']['val_bits_per_byte']:.3f} |"
        for n, m in metas.items()
    )
    commands = "\n".join(dict.fromkeys(m["command"] for m in metas.values()))
    command_notes = ""
    if "--only" in commands:
        command_notes += (
            "\nThe two models were trained by two runs at the same time; each run rebuilds the "
            "same tokenizer\nfrom the same corpus and seed.\n"
        )
    if "--corpus-file" in commands:
        command_notes += (
            f'\n`--corpus-file` is the saved output of `bible "{BIBLE_RANGE}"`; without it the '
            "script runs\n`bible` itself.\n"
        )
    blurbs = {
        "demo-kjv": "The demo model of xlaserve. Its draft model for speculative decoding is "
        "`demo-kjv-draft` (same tokenizer).",
        "demo-kjv-draft": "The draft model for speculative decoding with xlaserve's demo model "
        "`demo-kjv` (same tokenizer, much smaller).",
    }
    for (name, meta), out_dir in zip(metas.items(), (main_dir, draft_dir), strict=True):
        a, c, r, s = meta["args"], meta["corpus"], meta["result"], meta["sample"]
        minutes = a["minutes"] if name == "demo-kjv" else a["draft_minutes"]
        lr = a["lr"] if name == "demo-kjv" else a["draft_lr"]
        size = os.path.getsize(os.path.join(out_dir, "model.safetensors")) / 1e6
        text = _CARD.format(
            title=name,
            blurb=blurbs[name],
            params=r["num_parameters"],
            vocab=meta["vocab_size"],
            max_pos=512,
            seq_len=a["seq_len"],
            dtype=a["dtype"],
            size_mb=size,
            bible_range=BIBLE_RANGE,
            every=HELD_OUT_EVERY,
            held_out=c["held_out_chapters"],
            chat_pct=100 * a["chat_frac"],
            lr=lr,
            batch=a["batch_size"],
            seed=a["seed"],
            minutes=minutes,
            steps=r["steps"],
            tokens_seen=r["tokens_seen"],
            seconds=r["seconds"],
            torch=meta["torch"],
            threads=meta["threads"],
            cpu_count=meta["cpu_count"],
            command=commands,
            command_notes=command_notes,
            eval_rows=rows,
            greedy=s["greedy"],
            chat=s["chat"],
            **meta["shape"],
            **c,
        )
        with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
            f.write(text)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="writes OUT/demo-kjv and OUT/demo-kjv-draft")
    p.add_argument("--minutes", type=float, default=11.0, help="main model wall-clock budget")
    p.add_argument("--draft-minutes", type=float, default=3.5, help="draft model budget")
    p.add_argument("--max-steps", type=int, default=None, help="main model step cap")
    p.add_argument("--draft-max-steps", type=int, default=None, help="draft model step cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--draft-lr", type=float, default=5e-3)
    p.add_argument("--chat-frac", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--corpus-file", default=None, help="bible output saved earlier (else runs it)")
    p.add_argument(
        "--only",
        choices=["demo-kjv", "demo-kjv-draft"],
        default=None,
        help="train one of the two models (the tokenizer is rebuilt identically each run)",
    )
    p.add_argument(
        "--cards-only",
        action="store_true",
        help="only rewrite the README.md cards from OUT/*/training_meta.json",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    main_dir = os.path.join(args.out, "demo-kjv")
    draft_dir = os.path.join(args.out, "demo-kjv-draft")
    if args.cards_only:
        write_model_cards(main_dir, draft_dir)
        return
    import torch

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    max_pos = 512

    text = read_bible_text(args.corpus_file)
    chapters = parse_chapters(text)
    n_verses = sum(len(c.verses) for c in chapters)
    train_docs, val_docs = build_documents(chapters, args.chat_frac, args.seed)
    print(
        f"corpus: {len(text)} bytes, {len(chapters)} chapters, {n_verses} verses; "
        f"{len(val_docs)} chapters held out; {len(train_docs)} training documents",
        flush=True,
    )
    plain_train = [
        chapter_text(c) for i, c in enumerate(chapters) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1
    ]
    tok = train_tokenizer(plain_train, args.vocab_size)
    vocab = tok.get_vocab_size()
    train_ids = encode_stream(tok, train_docs)
    val_ids = encode_stream(tok, val_docs)
    val_bytes = sum(len(d.encode("utf-8")) + 1 for d in val_docs)
    print(
        f"tokenizer: vocab {vocab}; train {len(train_ids)} tokens, held-out {len(val_ids)} tokens"
    )

    corpus = {
        "bytes": len(text),
        "chapters": len(chapters),
        "verses": n_verses,
        "held_out_chapters": len(val_docs),
        "train_tokens": len(train_ids),
        "held_out_tokens": len(val_ids),
        "held_out_bytes": val_bytes,
    }
    command = "nice -n 5 python tools/train_demo.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    for name, shape, minutes, steps, lr, out_dir in [
        ("demo-kjv", MAIN_SHAPE, args.minutes, args.max_steps, args.lr, main_dir),
        (
            "demo-kjv-draft",
            DRAFT_SHAPE,
            args.draft_minutes,
            args.draft_max_steps,
            args.draft_lr,
            draft_dir,
        ),
    ]:
        if args.only and name != args.only:
            continue
        model = make_model(shape, vocab, max_pos, args.seed)
        res = train_model(
            name,
            model,
            train_ids,
            val_ids,
            val_bytes,
            minutes=minutes,
            max_steps=steps,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            lr=lr,
            seed=args.seed + 1,
        )
        sample = {
            "greedy": greedy_sample(model, tok, SAMPLE_PROMPT),
            "chat": greedy_sample(model, tok, chat_prompt("John 3:16"), 40),
        }
        print(f"[{name}] sample: {sample['greedy']!r}\n[{name}] chat: {sample['chat']!r}")
        os.makedirs(out_dir, exist_ok=True)
        save_model(model, out_dir, args.dtype)
        save_tokenizer(tok, out_dir, max_pos)
        meta = {
            "name": name,
            "command": command,
            "corpus": corpus,
            "vocab_size": vocab,
            "args": vars(args),
            "shape": asdict(shape),
            "result": asdict(res),
            "sample": sample,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
        }
        _write_json(os.path.join(out_dir, "training_meta.json"), meta)
        print(json.dumps(meta["result"], indent=2), flush=True)
    if all(os.path.exists(os.path.join(d, "training_meta.json")) for d in (main_dir, draft_dir)):
        write_model_cards(main_dir, draft_dir)


if __name__ == "__main__":
    main()
