"""`xlaserve convert MODEL OUT --to orbax`: write a model as an orbax checkpoint directory.

The XLA backend then restores it straight into the mesh's shardings (`LLM(model=OUT)`), which on
a TPU VM reads each device's shard in parallel instead of converting safetensors tensor by tensor.
JAX is imported only when the command runs.
"""

from __future__ import annotations

import time

import click

from xlaserve.config import DTYPES


@click.command(
    "convert", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
@click.argument("model")
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--to",
    "to",
    type=click.Choice(["orbax"]),
    default="orbax",
    show_default=True,
    help="Output format.",
)
@click.option(
    "--tensor-parallel-size",
    "-tp",
    type=int,
    default=1,
    show_default=True,
    help="Devices the model is loaded onto while converting (the saved checkpoint restores onto "
    "any tensor_parallel_size).",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="auto",
    show_default=True,
    help="dtype the arrays are saved in ('auto' = the checkpoint's; float16 -> float32 on CPU).",
)
def convert(model: str, out: str, to: str, tensor_parallel_size: int, dtype: str) -> None:
    """Convert MODEL (HF safetensors directory, hub id, or 'demo') into OUT."""
    from xlaserve.runner import checkpoint_converter

    t0 = time.perf_counter()
    try:  # the backend that writes the format (runner registry; orbax: backends_xla/orbax_io.py)
        convert_checkpoint = checkpoint_converter(to)
        marker = convert_checkpoint(
            None if model == "demo" else model, out, to, tensor_parallel_size, dtype
        )
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(
        f"wrote {to} checkpoint {out}: {marker['architecture']}, "
        f"{marker['num_parameters'] / 1e6:.1f}M parameters, {marker['dtype']}, "
        f"in {time.perf_counter() - t0:.1f}s"
    )
