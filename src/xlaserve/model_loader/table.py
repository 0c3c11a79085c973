"""The README's supported-models table, rendered from the architecture registry.

A backend serves an architecture when it registers the architecture's model family. The families
are read from each backend's family table (`_FAMILIES` in backends_torch/models/__init__.py and
models_flax/__init__.py) by parsing the source, so neither torch nor jax is imported and a missing
backend simply shows "no".

    python -m xlaserve.model_loader.table            # rewrite README.md's table in place
    python -m xlaserve.model_loader.table --check    # exit 1 when README.md's table is stale
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys

from xlaserve.model_loader.registry import _ADAPTERS, supported_architectures

START, END = "<!-- models:start -->", "<!-- models:end -->"

# Backend name -> package whose __init__.py holds its `_FAMILIES` table.
BACKEND_PACKAGES = {
    "torch": "xlaserve.backends_torch.models",
    "xla": "xlaserve.models_flax",
}

# Architecture -> what sets it apart (the table's last column).
NOTES: dict[str, str] = {
    "LlamaForCausalLM": "Llama 2/3 (rope scaling: linear, dynamic, llama3, yarn)",
    "MistralForCausalLM": "sliding window",
    "Qwen2ForCausalLM": "qkv bias",
    "Qwen3ForCausalLM": "qk-norm",
    "Phi3ForCausalLM": "fused qkv / gate_up split on load, partial rotary, longrope",
    "GraniteForCausalLM": "embedding / residual / attention multipliers, logits scaling",
    "GemmaForCausalLM": "norm offset 1, sqrt(H) embedding scale, gelu-tanh",
    "Gemma2ForCausalLM": "+ sandwich norms, logit soft-caps, alternating sliding windows",
    "Gemma3ForCausalLM": "+ qk-norm, local rope theta on sliding layers (text only)",
    "Olmo2ForCausalLM": "post-norms only, qk-norm over the full projection",
    "GPT2LMHeadModel": "learned positions, LayerNorm, Conv1D weights, tied head",
    "GPTNeoXForCausalLM": "parallel residual, partial rotary, fused per-head qkv",
    "Starcoder2ForCausalLM": "LayerNorm with bias, plain GELU MLP, sliding window",
    "MixtralForCausalLM": "MoE, softmax top-k renormalised",
    "Qwen2MoeForCausalLM": "MoE + sigmoid-gated shared expert",
    "Qwen3MoeForCausalLM": "MoE, qk-norm",
    "DeepseekV3ForCausalLM": "MLA (full per-head K/V cached) + sigmoid group-limited MoE",
    # Families declared as data (model_loader/families.py: LlamaLike adapters, no backend code).
    "HeliumForCausalLM": "interleaved rope (de-interleaved on load), qkv bias",
    "SeedOssForCausalLM": "qkv bias, separate o_proj bias",
    "Ernie4_5ForCausalLM": "interleaved rope, one bias flag for all projections",
    "ArceeForCausalLM": "plain relu^2 MLP",
    "MinistralForCausalLM": "per-layer sliding / full attention",
    "SmolLM3ForCausalLM": "no rope on every 4th layer (NoPE)",
    "GlmForCausalLM": "fused gate_up, interleaved partial rope",
    "Glm4ForCausalLM": "+ sandwich norms",
    "NemotronForCausalLM": "LayerNorm1P (+1 on load), relu^2 MLP, partial rope",
    "StableLmForCausalLM": "LayerNorm, partial rope, optional parallel block",
    "CohereForCausalLM": "parallel block with one bias-free LayerNorm, interleaved rope, logit scale",
    "Cohere2ForCausalLM": "+ sliding layers, NoPE full layers",
    "Olmo3ForCausalLM": "OLMo2 + sliding layers, rope per layer type",
    "Exaone4ForCausalLM": "post-norms, per-head qk-norm, NoPE full layers",
    "OlmoeForCausalLM": "MoE, qk-norm over the full projection",
    "GraniteMoeForCausalLM": "Granite multipliers + MoE (fused input/output_linear experts)",
    "GraniteMoeSharedForCausalLM": "+ a shared expert (fused input_linear split on load)",
    "CwmForCausalLM": "Code World Model: Llama with per-layer sliding / full attention",
    "GPTJForCausalLM": "parallel block, interleaved partial rope, lm_head bias",
    "PhiForCausalLM": "parallel block, partial rope, lm_head bias",
    "OPTForCausalLM": "learned positions (offset 2), LayerNorm, ReLU MLP",
    "GPTBigCodeForCausalLM": "StarCoder 1: GPT-2 with multi-query attention",
    "FalconForCausalLM": "parallel block, fused MQA / grouped GQA qkv, ln_attn + ln_mlp",
    "Glm4MoeForCausalLM": "GQA, partial rope, qk-norm + DeepSeek-V3 routing, shared experts",
    "Dots1ForCausalLM": "qk-norm + DeepSeek-V3 routing, shared experts",
    "Ernie4_5_MoeForCausalLM": "softmax routing with a selection bias, shared experts",
    "DeepseekV2ForCausalLM": "MLA + softmax group-limited (max) routing, shared experts",
    "BloomForCausalLM": "ALiBi (reference attention: torch_batched / jnp), embedding LayerNorm",
    "MptForCausalLM": "ALiBi (MPT slopes), bias-free LayerNorm and projections",
    "GptOssForCausalLM": "attention sinks, sliding / full layers, biased clamped-SwiGLU MoE "
    "(reference attention and experts paths; bf16 checkpoints, not MXFP4)",
    "Llama4ForCausalLM": "Llama 4 text: MoE every interleave_moe_layer_step-th layer (top-k "
    "sigmoid weights scale the expert input) + shared expert; rope layers: chunked attention "
    "+ qk L2-norm; NoPE layers: attention temperature; interleaved rope, llama3 scaling",
    "Llama4ForConditionalGeneration": "Llama 4 checkpoints served text-only (text_config; the "
    "vision tower is not loaded)",
    # State-space models (issue 25): the cache kinds they use (core/cache_spec.py); every other
    # architecture uses paged attention K/V only.
    "MambaForCausalLM": "cache: recurrent state only (conv window + SSM state [I, N] per layer); "
    "no prefix caching, no speculative decoding",
    "Mamba2ForCausalLM": "cache: recurrent state only (conv window + SSD state [Hs, P, N] per "
    "layer); no prefix caching, no speculative decoding",
    "BambaForCausalLM": "cache: paged attention (attention layers) + recurrent state (Mamba2 "
    "layers), one request's blocks and state slot admitted / freed together; partial rotary 0.5",
    "GraniteMoeHybridForCausalLM": "Granite 4: cache: paged attention + recurrent state (Mamba2 "
    "layers); MoE + shared MLP, Granite multipliers, rope or no positions",
    "JambaForCausalLM": "cache: paged attention + recurrent state (Mamba layers, dt / B / C "
    "norms); MoE every other layer (softmax top-k, not renormalised); no positions",
    # Qwen3-Next (issue 25 part A).
    "Qwen3NextForCausalLM": "cache: paged attention (gated attention layers) + recurrent state "
    "(Gated DeltaNet layers: conv window + delta-rule state [Hv, dk, dv]); qk-norm, partial "
    "rotary, (1 + w) norms; MoE + sigmoid-gated shared expert; no prefix caching, no "
    "speculative decoding",
}

# Issue 25 part B (model_loader/ssm_hybrids.py).
NOTES.update(
    {
        "Lfm2ForCausalLM": "cache: paged attention + recurrent state (short-conv layers: conv "
        "window [H, L_cache-1] only); qk-norm, SwiGLU",
        "Lfm2MoeForCausalLM": "LFM2 + sigmoid-routed MoE (selection-only expert bias) after the "
        "first dense layers",
        "NemotronHForCausalLM": "cache: paged attention + recurrent state (Mamba2 layers); one "
        "mixer per layer (Mamba2 / attention without positions / relu^2 MLP: no cache); MoE "
        "layers refused",
        "FalconH1ForCausalLM": "cache: paged attention AND recurrent state in every layer "
        "(parallel attention + Mamba2); muP multipliers folded into the weights",
    }
)


def backend_families(package: str) -> set[str]:
    """Family names a backend registers: keys of its `_FAMILIES` dict literal plus names passed to
    `register_model_family("...")` in the same file. Empty when the package is absent."""
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return set()
    if found is None or not found.origin or not os.path.exists(found.origin):
        return set()
    with open(found.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names: set[str] = set()
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        if (
            isinstance(target, ast.Name)
            and target.id == "_FAMILIES"
            and isinstance(value, ast.Dict)
        ):
            names |= {k.value for k in value.keys if isinstance(k, ast.Constant)}
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None))
            == "register_model_family"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(node.args[0].value)
    return names


def render_table() -> str:
    """The markdown table (no markers), one row per registered HF architecture name."""
    fams = {b: backend_families(p) for b, p in BACKEND_PACKAGES.items()}
    rows = [
        "| Architecture (HF `architectures`) | Family | torch | xla | Notes |",
        "|---|---|---|---|---|",
    ]
    for arch in supported_architectures():
        fam = _ADAPTERS[arch].family
        yes = ["yes" if fam in fams[b] else "no" for b in BACKEND_PACKAGES]
        rows.append(f"| `{arch}` | {fam} | {' | '.join(yes)} | {NOTES.get(arch, '')} |")
    return "\n".join(rows)


def replace_section(text: str, table: str) -> str:
    """`text` with the part between the markers replaced by `table` (ValueError without markers)."""
    if START not in text or END not in text:
        raise ValueError(f"README has no {START} ... {END} section")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def readme_section(text: str) -> str:
    """The table currently between the markers."""
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    paths = [a for a in args if a != "--check"]
    path = paths[0] if paths else "README.md"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    table = render_table()
    if check:
        if readme_section(text) != table:
            print(f"{path}: supported-models table is stale; run python -m {__spec__.name}")
            return 1
        return 0
    new = replace_section(text, table)
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
