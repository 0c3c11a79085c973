"""Run by test_xla_multihost.py: one host of a 2-process XLA engine on the CPU (1 device each,
gloo collectives), or the single-process reference.

argv: model_dir cache_dir rank|single [port]. Host 0 (and "single") print one JSON line
{"tokens", "processes", "devices", "q_spec", "q_local_rows"}; host 1 prints nothing: `LLM(...)`
runs host 0's steps and exits the process when host 0 stops.
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"


def main() -> None:
    path, cache_dir, role = sys.argv[1], sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import numpy as np

    from xlaserve import LLM, SamplingParams

    kw: dict = dict(
        backend="xla",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,  # the 20-token prompt is prefilled in chunks
        max_num_seqs=2,
        max_model_len=64,
        cpu_kv_cache_bytes=1 << 20,  # KV blocks sized per host, agreed over hosts
        enforce_eager=True,
        compilation_cache_dir=cache_dir,
    )
    if role != "single":
        kw.update(tensor_parallel_size=2, nnodes=2, node_rank=int(role),
                  master_addr="127.0.0.1", master_port=int(sys.argv[4]))  # fmt: skip
    llm = LLM(model=path, **kw)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(1, 384, n).tolist()} for n in (7, 20, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    import jax

    runner = llm.llm_engine.runner
    q = runner.state["layers"][0]["self_attn"]["q_proj"]["weight"].get_value()
    res = dict(
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        processes=jax.process_count(),
        devices=len(q.sharding.device_set),
        q_spec=[a for a in q.sharding.spec],
        q_local_rows=[s.data.shape[0] for s in q.addressable_shards],
        q_rows=q.shape[0],
        num_kv_blocks=runner.num_kv_blocks,
    )
    print(json.dumps(res), flush=True)
    # No explicit shutdown: the STOP to the follower must come from the exit hook.


if __name__ == "__main__":
    main()
