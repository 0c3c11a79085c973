"""QuantScheme: what a model's linear layers hold, resolved from the user's `quantization`
argument and the checkpoint's config.json `quantization_config` (pre-quantized checkpoints are
detected automatically)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from xlaserve.quantization.kv_quant import KV_CACHE_DTYPES
from xlaserve.quantization.numpy_quant import INT4_DEFAULT_GROUP, int4_group_size

_logger = logging.getLogger(__name__)

# "int8": weight-only int8; "int8_w8a8": int8 weights and dynamic per-token int8 activations
# (SmoothQuant-style, vLLM's compressed-tensors W8A8 int8); "fp8": fp8 weights and per-token
# fp8 activations.
METHODS = ("int8", "int8_w8a8", "int4", "fp8")
# Sources: "runtime" = quantize a float checkpoint while loading; the others are HF formats
# ("fp8-block": quant_method "fp8" with weight_block_size, DeepSeek-V3 / Qwen3-FP8).
SOURCES = ("runtime", "gptq", "awq", "compressed-tensors", "fp8-block")
# Linear layers never quantized (logits head, tiny MoE gates).
DEFAULT_IGNORE = ("lm_head", "router", "shared_expert_gate")


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "int8" | "int4" | "fp8"
    source: str = "runtime"  # see SOURCES
    # int4: requested group size (runtime: adjusted per layer by `int4_group_size`).
    group_size: int = INT4_DEFAULT_GROUP
    # GPTQ desc_act: int4 layers carry a `perm` [K] tensor.
    act_order: bool = False
    # GPTQ checkpoint_format "gptq" (v1) stores zero - 1; "gptq_v2" stores zero.
    gptq_v1: bool = True
    # Canonical-name fragments/regexes of linear layers left in float.
    ignore: tuple[str, ...] = field(default=DEFAULT_IGNORE)
    # fp8 block-wise weights: (block_n, block_k) of one weight scale; scales are then
    # [ceil(N / block_n), ceil(K / block_k)] (None: one scale per output channel).
    weight_block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization method must be one of {METHODS}, got {self.method!r}")
        if self.source not in SOURCES:
            raise ValueError(f"quantization source must be one of {SOURCES}, got {self.source!r}")
        if self.weight_block is not None and (
            self.method != "fp8"
            or len(self.weight_block) != 2
            or min(self.weight_block) < 16
            or any(b & (b - 1) for b in self.weight_block)
        ):
            raise ValueError(
                f"weight_block {self.weight_block!r}: fp8 only, two powers of two >= 16"
            )

    @property
    def prequantized(self) -> bool:
        return self.source != "runtime"

    def layer_group(self, in_features: int) -> int:
        """int4 group size of a layer with K = in_features (-1 / >= K: one group per row)."""
        if self.source == "runtime":
            return int4_group_size(in_features, self.group_size)
        g = self.group_size
        return in_features if g <= 0 or g >= in_features else g

    def skips(self, name: str) -> bool:
        """True when the linear layer `name` (canonical, e.g. "layers.0.mlp.up_proj") stays float."""
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], name) or re.match(pat[3:], "model." + name):
                    return True
            elif name == pat or name.endswith("." + pat) or f".{pat}." in f".{name}.":
                return True
        return False


def _ct_ignore(items: list[str]) -> tuple[str, ...]:
    out = list(DEFAULT_IGNORE)
    for it in items:
        out.append(it if it.startswith("re:") else it.removeprefix("model."))
    return tuple(out)


def scheme_from_hf_config(qc: dict) -> QuantScheme:
    """config.json `quantization_config` -> QuantScheme; NotImplementedError for other formats."""
    kind = str(qc.get("quant_method", "")).lower()
    if kind == "gptq":
        bits = int(qc.get("bits", 4))
        if bits != 4:
            raise NotImplementedError(f"GPTQ with bits={bits} is not supported (only 4-bit)")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise NotImplementedError(f"GPTQ checkpoint_format {fmt!r} is not supported")
        return QuantScheme(
            method="int4",
            source="gptq",
            group_size=int(qc.get("group_size", 128)),
            act_order=bool(qc.get("desc_act", False)),
            gptq_v1=fmt == "gptq",
        )
    if kind == "awq":
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise NotImplementedError(
                f"AWQ bits={bits} version={version!r} is not supported (only 4-bit GEMM)"
            )
        if not qc.get("zero_point", True):
            raise NotImplementedError("AWQ without zero points is not supported")
        ignore = _ct_ignore(list(qc.get("modules_to_not_convert") or []))
        return QuantScheme(
            method="int4",
            source="awq",
            group_size=int(qc.get("group_size", qc.get("q_group_size", 128))),
            ignore=ignore,
        )
    if kind == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    if kind == "fp8":
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise NotImplementedError(
                "fp8 checkpoints (quant_method 'fp8') are supported with weight_block_size "
                f"[block_n, block_k] only, got {block!r}"
            )
        if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise NotImplementedError("fp8 block-wise checkpoints with static activation scales")
        return QuantScheme(
            method="fp8",
            source="fp8-block",
            weight_block=(int(block[0]), int(block[1])),
            ignore=_ct_ignore(list(qc.get("modules_to_not_convert") or [])),
        )
    raise NotImplementedError(
        f"pre-quantized checkpoint format {kind!r} is not supported "
        "(supported: gptq, awq, compressed-tensors fp8 / int8, fp8 block-wise)"
    )


def _compressed_tensors_scheme(qc: dict) -> QuantScheme:
    """compressed-tensors: fp8 'float-quantized' (per-tensor / per-channel weights) or int8
    'int-quantized' (symmetric per-channel / per-tensor int8 weights; with int8
    input_activations it is W8A8, served with dynamic per-token activation scales, a static
    input_scale being dropped; without, int8 weight-only)."""
    groups = qc.get("config_groups") or {}
    if not groups:
        raise NotImplementedError("compressed-tensors config without config_groups")
    methods = set()
    for grp in groups.values():
        w = grp.get("weights") or {}
        bits, typ = int(w.get("num_bits", 0)), w.get("type")
        strategy = w.get("strategy", "tensor")
        if bits != 8 or typ not in ("float", "int"):
            raise NotImplementedError(
                f"compressed-tensors scheme {w!r} is not supported (only 8-bit 'float' / 'int')"
            )
        if strategy not in ("tensor", "channel"):
            raise NotImplementedError(
                f"compressed-tensors {typ} weight strategy {strategy!r} is not supported "
                "(tensor or channel only)"
            )
        if typ == "float":
            methods.add("fp8")
            continue
        if not w.get("symmetric", True):
            raise NotImplementedError("compressed-tensors int8 with asymmetric weights")
        act = grp.get("input_activations") or None
        if act is not None and (int(act.get("num_bits", 8)) != 8 or act.get("type") != "int"):
            raise NotImplementedError(
                f"compressed-tensors int8 weights with activations {act!r} (int8 only)"
            )
        methods.add("int8" if act is None else "int8_w8a8")
    if len(methods) != 1:
        raise NotImplementedError(f"compressed-tensors config mixes schemes {sorted(methods)}")
    return QuantScheme(
        method=methods.pop(),
        source="compressed-tensors",
        ignore=_ct_ignore(qc.get("ignore") or []),
    )


def read_quantization_config(model_dir: str | None) -> dict | None:
    """config.json's `quantization_config` (or `compression_config`), None when absent."""
    if not model_dir:
        return None
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    return cfg.get("quantization_config") or cfg.get("compression_config")


def resolve_scheme(
    requested: str | None, model_dir: str | None, kv_cache_dtype: str = "auto"
) -> QuantScheme | None:
    """The scheme to serve with: the checkpoint's own format when pre-quantized (the request, if
    any, must agree with it), else `requested` applied at load time, else None.
    `kv_cache_dtype` does not change the weights' scheme: the quantized KV cache is the
    backends' (contract in xlaserve.quantization.kv_quant); only validated here."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto', 'int8' or 'fp8', got {kv_cache_dtype!r}")
    qc = read_quantization_config(model_dir)
    if qc is not None:
        scheme = scheme_from_hf_config(qc)
        if requested is not None and requested != scheme.method:
            raise ValueError(
                f"quantization={requested!r} conflicts with the checkpoint, which is already "
                f"quantized as {scheme.method} ({scheme.source}); omit the argument"
            )
        return scheme
    if requested is None:
        return None
    return QuantScheme(method=requested)


def check_fp8_support(
    scheme: QuantScheme | None,
    fp8_supported: Callable[[], bool],
    where: str,
    emulate: bool | None = None,
) -> QuantScheme | None:
    """Both backends' rule for fp8 where the hardware has no fp8 matmul (`fp8_supported()` False,
    asked only for an fp8 scheme; `where` names the device or platform for the messages):
    runtime fp8 raises, unless `emulate` (KernelConfig.fp8_emulation; None = its default and
    environment override) is on (tests); a pre-quantized fp8 checkpoint is emulated with a
    warning. Any other scheme passes through."""
    if scheme is None or scheme.method != "fp8" or fp8_supported():
        return scheme
    if emulate is None:
        from xlaserve.config import kernel_switch

        emulate = kernel_switch("fp8_emulation")
    if scheme.source == "runtime" and not emulate:
        raise RuntimeError(
            "quantization='fp8': fp8 needs an NVIDIA GPU with compute capability >= 8.9 "
            f"({where}); use 'int8' or 'int4' here"
        )
    _logger.warning(
        "fp8 checkpoint on %s: no fp8 matmul here, emulating it (fp8 weights and per-token "
        "activation rounding, float32 math); fp8 needs an NVIDIA GPU with compute capability "
        ">= 8.9 to run fast",
        where,
    )
    return scheme
