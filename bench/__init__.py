"""The xlaserve benchmark suite (`xlaserve bench ...`, `python -m xlaserve.bench ...`).

Modules: request_funcs (async streaming clients per API), datasets, metrics, serve (online
benchmark), offline (throughput / latency / prefix-caching on `xlaserve.LLM`), compare_hf,
plot, cli. Nothing heavy is imported here.
"""
