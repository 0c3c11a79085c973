"""Tensor parallelism for the Torch backend: process groups (`parallel_state`), parallel layers
(`layers`) and the executors that run one `TorchModelRunner` shard per rank (`executor`)."""
