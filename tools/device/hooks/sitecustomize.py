"""Device-run hooks (tools/device/setup.sh puts this on the path): patch module tables right
after import, from env vars.

DEVRUN_LONG_DECODE=0|1      paged_attention.LONG_DECODE_ENABLED
DEVRUN_QUANT_F16=0|1        paged_attention.QUANT_F16_DOTS
DEVRUN_QUANT_DECODE_TILE=n,w,s  paged_attention.QUANT_DECODE_CONFIGS[128] = BLOCK_N n, w warps,
                            s stages (BLOCK_M 16)
DEVRUN_DECODE_TILE=n,w,s    paged_attention.ATTENTION_CONFIGS["decode"][128], the same form
DEVRUN_INT8_TILES_JSON=p    quant_matmul.INT8_DOT_TILES buckets from quant_gemm_sweep's suggest
DEVRUN_INT8_SPLIT=0|1       quant_matmul.DOT_SPLIT_ENABLED (the int8 tl.dot auto split-K)
DEVRUN_W8A8_SPLIT=0|1       scaled_mm.SCALED_MM_SPLIT_ENABLED (the w8a8 Triton GEMM's auto split-K)
DEVRUN_CUTLASS_TILES=s      cutlass_w8a16.TILE_BY_M from "max_m:tile,...,tile" (the last row: any M)
DEVRUN_W8A8_AUTO_JSON=p     scaled_mm.AUTO_LIBRARY / SCALED_MM_TILES buckets from the same
DEVRUN_CHUNK_ROUTE=r        prefill_sdpa.CHUNK_ROUTE ("split" | "pad")
"""

import importlib.abc
import importlib.util
import json
import os
import sys

_BIG = 1 << 62


def _log(msg):
    print(f"[devrun hook pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _flag(name):
    v = os.environ.get(name)
    return None if v is None else v not in ("0", "false", "off", "")


def _patch_pa(mod):
    for env, attr in (
        ("DEVRUN_LONG_DECODE", "LONG_DECODE_ENABLED"),
        ("DEVRUN_QUANT_F16", "QUANT_F16_DOTS"),
    ):
        f = _flag(env)
        if f is not None:
            setattr(mod, attr, f)
            _log(f"paged_attention.{attr} = {f}")
    for env, table in (
        ("DEVRUN_QUANT_DECODE_TILE", mod.QUANT_DECODE_CONFIGS),
        ("DEVRUN_DECODE_TILE", mod.ATTENTION_CONFIGS["decode"]),
    ):
        t = os.environ.get(env)
        if t:
            n, w, st = (int(v) for v in t.split(","))
            table[128] = {"BLOCK_M": 16, "BLOCK_N": n, "num_warps": w, "num_stages": st}
            _log(f"{env}: paged_attention decode tile [128] = {table[128]}")


def _suggest(path, fam):
    with open(path) as f:
        return json.load(f).get("suggest", {}).get(fam, {})


def _patch_qm(mod):
    f = _flag("DEVRUN_INT8_SPLIT")
    if f is not None:
        mod.DOT_SPLIT_ENABLED = f
        _log(f"quant_matmul.DOT_SPLIT_ENABLED = {f}")
    p = os.environ.get("DEVRUN_INT8_TILES_JSON")
    if not p:
        return
    sug = _suggest(p, "int8")
    table = []
    for max_m, t in mod.INT8_DOT_TILES:
        pick = sug.get(str(max_m))
        if pick and pick.get("tiles"):
            t = mod.Int8DotTiles(*pick["tiles"])
        table.append((max_m, t))
    mod.INT8_DOT_TILES = tuple(table)
    _log(f"INT8_DOT_TILES = {mod.INT8_DOT_TILES}")


def _patch_sm(mod):
    f = _flag("DEVRUN_W8A8_SPLIT")
    if f is not None:
        mod.SCALED_MM_SPLIT_ENABLED = f
        _log(f"scaled_mm.SCALED_MM_SPLIT_ENABLED = {f}")
    p = os.environ.get("DEVRUN_W8A8_AUTO_JSON")
    if not p:
        return
    for fam, fmt in (("int8_w8a8", "int8"), ("fp8", "fp8")):
        sug = _suggest(p, fam)
        if not sug:  # a sweep of other families only: this one's tables stay
            continue
        tiles, lib = [], []
        for max_m, t in mod.SCALED_MM_TILES[fmt]:
            pick = sug.get(str(max_m)) or {}
            use_lib = not pick.get("tiles")  # a bucket without tiles: the library GEMM
            if not use_lib:
                t = mod.DotTiles(*pick["tiles"])
            tiles.append((max_m, t))
            lib.append((max_m, use_lib))
        mod.SCALED_MM_TILES[fmt] = tuple(tiles)
        mod.AUTO_LIBRARY[fmt] = tuple(lib)
        _log(f"{fmt}: AUTO_LIBRARY = {mod.AUTO_LIBRARY[fmt]}; tiles = {mod.SCALED_MM_TILES[fmt]}")


def _patch_cw(mod):
    t = os.environ.get("DEVRUN_CUTLASS_TILES")  # "64:1,0": M <= 64 takes tile 1, larger tile 0
    if t:
        rows = []
        for part in t.split(","):
            max_m, _, idx = part.rpartition(":")
            rows.append((int(max_m) if max_m else 1 << 62, int(idx)))
        mod.TILE_BY_M = tuple(rows)
        _log(f"cutlass_w8a16.TILE_BY_M = {mod.TILE_BY_M}")


def _patch_ps(mod):
    r = os.environ.get("DEVRUN_CHUNK_ROUTE")
    if r:
        mod.CHUNK_ROUTE = r
        _log(f"prefill_sdpa.CHUNK_ROUTE = {r}")


_PATCHES = {
    "xlaserve.kernels_cuda.prefill_sdpa": _patch_ps,
    "xlaserve.kernels_cuda.paged_attention": _patch_pa,
    "xlaserve.kernels_cuda.quant_matmul": _patch_qm,
    "xlaserve.kernels_cuda.scaled_mm": _patch_sm,
    "xlaserve.kernels_cuda.cutlass_w8a16": _patch_cw,
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        orig = spec.loader.exec_module

        def exec_module(module, orig=orig, fn=_PATCHES[name]):
            orig(module)
            fn(module)

        spec.loader.exec_module = exec_module
        return spec


_ENV = (
    "DEVRUN_LONG_DECODE", "DEVRUN_QUANT_F16", "DEVRUN_INT8_TILES_JSON", "DEVRUN_W8A8_AUTO_JSON",
    "DEVRUN_CHUNK_ROUTE", "DEVRUN_QUANT_DECODE_TILE", "DEVRUN_DECODE_TILE", "DEVRUN_INT8_SPLIT",
    "DEVRUN_W8A8_SPLIT", "DEVRUN_CUTLASS_TILES",
)  # fmt: skip
if any(os.environ.get(k) for k in _ENV):
    sys.meta_path.insert(0, _Finder())
