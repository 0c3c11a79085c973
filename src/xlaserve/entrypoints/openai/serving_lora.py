"""LoRA adapters on the server (vLLM's surface): `--lora-modules`, `/v1/models` cards, picking an
adapter by the request's `model`, and runtime loading.

- `--lora-modules name=path [name=path ...]` or vLLM's JSON form
  `{"name": ..., "path": ..., "base_model_name": ...}`; each adapter is checked at start-up
  (a bad one stops the server with its error). Needs `--enable-lora`.
- `/v1/models` lists each adapter with `parent` = the base model's served name.
- `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter`
  `{"lora_name"}` exist only when VLLM_ALLOW_RUNTIME_LORA_UPDATING or
  XLASERVE_ALLOW_RUNTIME_LORA_UPDATING is true. A bad adapter is a 400 (the server keeps
  serving); an unknown name to unload a 404.

Every registered adapter gets a fresh `lora_int_id` (never reused, so prefix-cache blocks of an
unloaded adapter can never serve a new one of the same name): `--lora-modules` ones 1, 2, ...
in order (the same in every front process), runtime ones a random id >= 2**20 (front processes
do not share runtime loads; each must be told). Unloading removes the name; the engine's host
cache forgets the adapter by LRU.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from typing import Any

from aiohttp import web

from xlaserve.lora import LoRARequest

RUNTIME_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "XLASERVE_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updates_allowed() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes") for v in RUNTIME_ENV)


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """`name=path` or `{"name": ..., "path": ..., "base_model_name": ...}` -> (name, path, base)."""
    s = text.strip()
    if s.startswith("{"):
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({e.msg})") from None
        if not isinstance(d, dict) or not d.get("name") or not d.get("path"):
            raise ValueError(f'--lora-modules {text!r}: JSON needs "name" and "path"')
        return str(d["name"]), str(d["path"]), d.get("base_model_name")
    name, sep, path = s.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return name, path, None


class LoRARegistry:
    """Served adapter names -> LoRARequest (thread-safe; ids from one counter)."""

    def __init__(self, base_name: str, spec: Any, max_lora_rank: int) -> None:  # noqa: ANN401
        self.base_name = base_name
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self._by_name: dict[str, LoRARequest] = {}
        self._created: dict[str, int] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def check(self, name: str, path: str) -> None:
        """Load the adapter once to check it (ValueError naming the problem)."""
        from xlaserve.lora.peft import load_peft_adapter

        load_peft_adapter(LoRARequest(name, 1, path), self.spec, self.max_lora_rank)

    def add(
        self, name: str, path: str, base_model_name: str | None = None, runtime: bool = False
    ) -> LoRARequest:
        """Check and register an adapter (ValueError: bad adapter or a name in use)."""
        if name == self.base_name:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        if name in self._by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        self.check(name, path)
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            if runtime:
                used = {r.lora_int_id for r in self._by_name.values()}
                aid = 2**20 + secrets.randbelow(2**31 - 2**21)
                while aid in used:
                    aid += 1
            else:
                aid, self._next_id = self._next_id, self._next_id + 1
            req = LoRARequest(name, aid, path, base_model_name)
            self._by_name[name] = req
            self._created[name] = int(time.time())
        return req

    def remove(self, name: str) -> bool:
        with self._lock:
            self._created.pop(name, None)
            return self._by_name.pop(name, None) is not None

    def cards(self, max_model_len: int) -> list[dict[str, Any]]:
        """/v1/models entries: one per adapter, parent = the base's served name."""
        return [self.card(n, max_model_len) for n in list(self._by_name)]

    def card(self, name: str, max_model_len: int) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self._created.get(name, 0),
            "owned_by": "xlaserve",
            "root": name,  # the adapter's path stays the operator's business
            "parent": self.base_name,
            "max_model_len": max_model_len,
        }


def build_registry(engine: Any, modules: list[str] | str | None) -> LoRARegistry | None:  # noqa: ANN401
    """The registry of a server over `engine` (None when LoRA is off and no module is given);
    registers `--lora-modules` (ValueError on a bad one, or without --enable-lora)."""
    config = getattr(engine, "config", None)
    enabled = config is not None and config.lora.enable_lora
    mods = [modules] if isinstance(modules, str) else list(modules or [])
    if mods and not enabled:
        raise ValueError("--lora-modules needs --enable-lora")
    if not enabled:
        return None
    spec = engine.engine.spec
    reg = LoRARegistry(engine.model_name, spec, config.lora.max_lora_rank)
    for text in mods:
        name, path, base = parse_lora_module(text)
        reg.add(name, path, base)
    return reg


def add_routes(app: web.Application, registry: LoRARegistry) -> None:
    """The runtime load / unload endpoints (only when runtime updates are allowed)."""
    if not runtime_updates_allowed():
        return
    from xlaserve.entrypoints.openai import api_server as srv

    def _field(body: Any, key: str) -> str:  # noqa: ANN401
        v = body.get(key) if isinstance(body, dict) else None
        if not isinstance(v, str) or not v:
            raise srv.APIError(400, f"'{key}' (a non-empty string) is required", param=key)
        return v

    async def load_lora_adapter(request: web.Request) -> web.Response:
        body = await srv._json_body(request)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        try:
            await srv._offload(request, registry.add, name, path, body.get("base_model_name"), True)
        except ValueError as e:
            raise srv.APIError(400, str(e), param="lora_path") from None
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(request: web.Request) -> web.Response:
        body = await srv._json_body(request)
        name = _field(body, "lora_name")
        if not registry.remove(name):
            raise srv.APIError(
                404, f"the LoRA adapter '{name}' is not loaded", param="lora_name",
                code="model_not_found",
            )  # fmt: skip
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
