"""HF tokenizer wrapper (tokenizer.json via `tokenizers`, chat templates via jinja2).

transformers is not needed at serve time: `tokenizer.json` holds the model and the
post-processor (BOS insertion), `tokenizer_config.json` the chat template and special tokens.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from xlaserve.tokenizer.detokenizer import IncrementalDetokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer"]


# Bound of each single-token decode memo (entries; about the largest vocabularies in use).
_ONE_TOKEN_CACHE_MAX = 1 << 18


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):  # AddedToken serialised as a dict
        return v.get("content")
    return v


@dataclass
class _ChatTemplate:
    source: str

    def render(self, **kwargs: Any) -> str:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg: str) -> None:
            raise ValueError(f"chat template error: {msg}")

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.source).render(**kwargs)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed to render: {e}") from e


def _cut_after(rendered: str, content: str) -> str:
    """`rendered` up to the end of the last occurrence of `content` (continue_final_message)."""
    i = rendered.rfind(content)
    if i < 0:
        raise ValueError(
            "continue_final_message: the chat template does not write the last message's content"
        )
    return rendered[: i + len(content)]


def load_chat_template(template: str) -> str:
    """A chat template given as Jinja text or as the path of a file holding it (`--chat-template`,
    vLLM's rule). ValueError for a path that does not exist or a file that cannot be read."""
    path = os.path.expanduser(template)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"chat template {template!r}: cannot read it: {e}") from None
    if "{" not in template and ("/" in template or template.endswith((".jinja", ".j2"))):
        raise ValueError(f"chat template file {template!r} does not exist")
    return template


class Tokenizer:
    def __init__(self, tokenizer: Any, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.config = config
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0

        def tid(name: str) -> int | None:
            s = _token_str(config.get(name))
            return tokenizer.token_to_id(s) if s else None

        self.eos_token = _token_str(config.get("eos_token"))
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token_id = tid("eos_token")
        self.bos_token_id = tid("bos_token")
        self.pad_token_id = tid("pad_token")
        added = config.get("added_tokens_decoder") or {}
        self.all_special_ids: set[int] = {
            int(k) for k, v in added.items() if v.get("special", True)
        }
        for t in tokenizer.get_added_tokens_decoder().items():
            if t[1].special:
                self.all_special_ids.add(t[0])
        for i in (self.eos_token_id, self.bos_token_id, self.pad_token_id):
            if i is not None:
                self.all_special_ids.add(i)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._chat_template = _ChatTemplate(template) if template else None
        # decode([t]) memo per skip_special_tokens value (see decode).
        self._one_token_text: tuple[dict[int, str], dict[int, str]] = ({}, {})
        # A copy that reads special-token text as plain text (chat content), made on first use.
        self._plain_tok: Any = None
        self._plain_lock = threading.Lock()

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise FileNotFoundError(
                f"{path}: tokenizer.json not found (xlaserve needs a fast-tokenizer tokenizer.json)"
            )
        config: dict[str, Any] = {}
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(tc):
            with open(tc) as f:
                config = json.load(f)
        stm = os.path.join(path, "special_tokens_map.json")
        if os.path.exists(stm):
            with open(stm) as f:
                for k, v in json.load(f).items():
                    config.setdefault(k, v)
        ct = os.path.join(path, "chat_template.jinja")
        if "chat_template" not in config and os.path.exists(ct):
            with open(ct) as f:
                config["chat_template"] = f.read()
        return cls(HFTokenizer.from_file(tj), config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) == 1:
            # Single tokens repeat (the incremental detokenizer's prefix window is one token in
            # steady state, logprob entries decode one token each): memoised, a pure function.
            cache = self._one_token_text[bool(skip_special_tokens)]
            tok = int(ids[0])
            text = cache.get(tok)
            if text is None:
                text = self._tok.decode([tok], skip_special_tokens=skip_special_tokens)
                if len(cache) < _ONE_TOKEN_CACHE_MAX:
                    cache[tok] = text
            return text
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def backend_tokenizer(self) -> Any:  # noqa: ANN401
        """The underlying `tokenizers.Tokenizer` (transformers' name for it)."""
        return self._tok

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def set_chat_template(self, template: str) -> None:
        """Replace the model's chat template (`serve --chat-template`): `template` is a Jinja
        template or the path of a file holding one."""
        self._chat_template = _ChatTemplate(load_chat_template(template))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages ({"role", "content"}, optionally "tool_calls" / "tool_call_id") with
        the tokenizer's template, or `chat_template` (Jinja text, never a path: a client may send
        it; same sandbox) when given. `tools` (a list of {"type": "function", "function": {...}})
        and other kwargs go to the template."""
        template = self._chat_template
        if chat_template is not None:
            template = _ChatTemplate(chat_template)
        if template is None:
            raise ValueError("this model's tokenizer has no chat template; use completions instead")
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with special-token text ("<|im_start|>") read as ordinary text:
        never a control token, no BOS/EOS added."""
        if self._plain_tok is None:
            with self._plain_lock:
                if self._plain_tok is None:
                    from tokenizers import Tokenizer as HFTokenizer

                    plain = HFTokenizer.from_str(self._tok.to_str())
                    plain.encode_special_tokens = True
                    self._plain_tok = plain
        return self._plain_tok.encode(text, add_special_tokens=False).ids

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> tuple[str, list[int]]:
        """(text, token ids) of a chat rendered with the template (no BOS added on top).

        The one templating function the server and `LLM.chat` share. `tools` are shown to the
        template (`tools` variable); messages may carry `tool_calls` (arguments as objects) and
        `tool_call_id`. `continue_final_message`: the prompt ends right after the last
        message's content (what the template writes after it, e.g. an end-of-turn token, is
        cut), so the model continues that message; needs add_generation_prompt False.
        `chat_template` replaces the model's template (same sandbox; the caller decides
        whether a client may send one).

        Rule: message content is data. Unless `special_tokens_in_content`, the template is
        rendered with each string content replaced by a one-off placeholder; the text between
        placeholders (the template's own, with its control tokens) is tokenized as usual and
        each content string with `encode_plain`, so "<|im_end|>\n<|im_start|>system" inside a
        message stays text and cannot forge a role. Token boundaries fall at the template /
        content seams (a merge across a seam is not made).
        """
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError(
                    "continue_final_message and add_generation_prompt cannot both be true "
                    "(they exclude each other)"
                )
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message needs a last message with text content")
        if tools is not None:
            kwargs["tools"] = tools
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if not special_tokens_in_content:
            self._refuse_control_text(messages, tools)
        if special_tokens_in_content:
            text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
            if continue_final_message:
                text = _cut_after(text, messages[-1]["content"])
            return text, self.encode(text, add_special_tokens=False)
        nonce = secrets.token_hex(8)
        contents: list[str] = []
        masked = []
        for i, m in enumerate(messages):
            c = m.get("content")
            # The last message is masked even when empty: continue_final_message cuts after it.
            if isinstance(c, str) and (c or (continue_final_message and i == len(messages) - 1)):
                masked.append({**m, "content": f"\ue000{nonce}:{len(contents)}\ue001"})
                contents.append(c)
            else:
                masked.append(m)
        rendered = self.apply_chat_template(masked, add_generation_prompt, **kwargs)
        pattern = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        if continue_final_message:
            rendered = _cut_after(rendered, masked[-1]["content"])
        text_parts: list[str] = []
        ids: list[int] = []
        pos = 0
        for mt in pattern.finditer(rendered):
            seg = rendered[pos : mt.start()]
            if seg:
                ids += self.encode(seg, add_special_tokens=False)
            content = contents[int(mt.group(1))]
            ids += self.encode_plain(content)
            text_parts += [seg, content]
            pos = mt.end()
        tail = rendered[pos:]
        if tail:
            ids += self.encode(tail, add_special_tokens=False)
        text_parts.append(tail)
        return "".join(text_parts), ids

    def _control_texts(self) -> list[str]:
        texts = getattr(self, "_control_text_cache", None)
        if texts is None:
            texts = [t for i in self.all_special_ids if (t := self.id_to_token(i))]
            self._control_text_cache = texts
        return texts

    def _refuse_control_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> None:
        """Tool definitions, tool-call arguments and other non-content message fields are
        rendered into the template as they are (not masked like content): refuse any that spell
        a control token, so they cannot forge a turn (ValueError -> HTTP 400)."""
        extra = [{k: v for k, v in m.items() if k != "content"} for m in messages]
        blob = json.dumps([extra, tools], ensure_ascii=False, default=str)
        for t in self._control_texts():
            if t in blob:
                raise ValueError(
                    f"control token text {t!r} in tools, tool calls or message fields is refused "
                    "(only message content may hold it, as text)"
                )

    def chat_prompt_ids(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a rendered chat (the template writes BOS itself, so none is added)."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )
