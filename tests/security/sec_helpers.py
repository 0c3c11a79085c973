"""Helpers shared by the attack tests (plain module: test files import it by name)."""

from __future__ import annotations

import json
from typing import Any

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


def error_of(raw: bytes) -> dict[str, Any]:
    """The inner object of OpenAI's error JSON (asserting its shape)."""
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err
