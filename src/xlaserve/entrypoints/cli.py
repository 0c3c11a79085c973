"""The `xlaserve` command line (click).

    xlaserve serve [MODEL] [engine and server flags]   OpenAI-compatible HTTP server
    xlaserve generate PROMPT [--max-tokens N]          one-shot generation, streamed to the terminal
    xlaserve chat [MODEL]                              interactive chat (chat template, history)
    xlaserve bench ...                                 benchmarks (xlaserve.bench.cli, lazily)

Engine and server flags are generated from the config dataclasses in `xlaserve.config`: one flag
per field (`--max-num-seqs` -> `SchedulerConfig.max_num_seqs`), its help taken from the comment
above the field, grouped by config section in `--help`. Every flag can also be given as an
environment variable `XLASERVE_<FLAG_NAME>` (`XLASERVE_MAX_NUM_SEQS=32`). With no MODEL the demo
model shipped in the package is used.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
import typing
import uuid
from collections.abc import Callable
from typing import Any

import click

from xlaserve import config as cfg

# Subcommands other modules provide, imported only when used: name -> "module:attribute".
LAZY_COMMANDS: dict[str, str] = {
    "bench": "xlaserve.bench.cli:bench",
    "convert": "xlaserve.entrypoints.convert:convert",
}

# Config sections turned into flags: (EngineConfig attribute or "server"/"engine", class, title).
_SECTIONS: list[tuple[str, type, str]] = [
    ("model", cfg.ModelConfig, "Model"),
    ("cache", cfg.CacheConfig, "KV cache"),
    ("scheduler", cfg.SchedulerConfig, "Scheduler"),
    ("parallel", cfg.ParallelConfig, "Parallelism"),
    ("load", cfg.LoadConfig, "Weight loading"),
    ("structured", cfg.StructuredOutputConfig, "Structured output"),
    ("kernels", cfg.KernelConfig, "Kernels"),
    ("lora", cfg.LoRAConfig, "LoRA"),
    ("engine", cfg.EngineConfig, "Engine"),
    ("server", cfg.ServerConfig, "Server"),
]
# Fields that are not flags (the positional MODEL, nested sections).
_SKIP = {("model", "model"), ("engine", "model"), ("engine", "cache"), ("engine", "scheduler"),
         ("engine", "parallel"), ("engine", "load"), ("engine", "structured"),
         ("engine", "kernels"), ("engine", "lora")}  # fmt: skip
# Flag names that would collide or read ambiguously without their section.
_RENAME = {
    ("structured", "backend"): "structured_output_backend",
    ("structured", "cache_size"): "structured_output_cache_size",
    ("structured", "cache_bytes"): "grammar_cache_bytes",
    ("structured", "compile_timeout"): "grammar_compile_timeout",
    ("structured", "compile_workers"): "grammar_compile_workers",
    ("structured", "jump_forward"): "structured_jump_forward",
    ("structured", "jump_forward_max_tokens"): "structured_jump_forward_max_tokens",
    ("structured", "accept_threads"): "grammar_accept_threads",
    ("engine", "speculative"): "speculative_config",
}
# Help for fields that carry no comment in config.py.
_EXTRA_HELP = {
    (
        "parallel",
        "tensor_parallel_size",
    ): "Devices each layer's weights and KV heads are split over.",
    ("parallel", "data_parallel_size"): "Independent engine replicas.",
    ("server", "host"): "Address to listen on.",
    ("server", "port"): "Port to listen on.",
    (
        "server",
        "api_key",
    ): "Require 'Authorization: Bearer KEY' (except /health, /version, /metrics); repeat for "
    "several keys. A key on the command line shows in `ps`: prefer --api-key-file or "
    "XLASERVE_API_KEY (several keys: separated by spaces).",
    ("server", "request_timeout"): "Per-request timeout in seconds (504 past it).",
    ("model", "max_logprobs"): "Most logprobs / prompt_logprobs per position a request may ask "
    "for (at most 20).",
    ("server", "log_requests"): "Log each request (its prompt and sampling parameters) and the "
    "HTTP access log (one line per request). Off by default.",
}
# vLLM's spellings kept as extra names of a flag (a bool flag: "--on/--off" pairs).
_ALIASES: dict[tuple[str, str], list[str]] = {
    ("server", "log_requests"): ["--enable-log-requests/--disable-log-requests"],
}
_CHOICES = {
    ("model", "dtype"): cfg.DTYPES,
    ("engine", "backend"): cfg.BACKENDS,
    ("scheduler", "async_scheduling"): cfg.ASYNC_SCHEDULING,
    **{
        ("kernels", n): (*cfg.TRISTATE, "1", "0")
        for n in (
            "triton_ops",
            "dense_gemv",
            "fused_greedy",
            "xla_decode_gemv",
            "ssm_prefill_triton",
        )
    },
}
# Sections whose environment variables only `KernelConfig.from_env` reads: their flags default to
# None (not given), so the variables and the config defaults apply in that one place.
_ENV_IN_CONFIG = {"kernels"}


def _field_comments(cls: type) -> dict[str, str]:
    """The `# comment` lines right above each field in the class source (its help text)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        s = line.strip()
        if s.startswith("#"):
            pending.append(s.lstrip("#").strip())
            continue
        name = s.split(":", 1)[0].strip()
        if name in names and ":" in s:
            inline = s.split("#", 1)[1].strip() if "#" in s else ""
            out[name] = " ".join(pending + ([inline] if inline else []))
        pending = []
    return out


class _ConfigOption(click.Option):
    """A flag bound to one config field; `section` groups it in --help."""

    def __init__(
        self, *args: Any, section: str, section_title: str, field_name: str, **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self.section = section
        self.section_title = section_title
        self.field_name = field_name


class _GroupedCommand(click.Command):
    """Prints config flags under one heading per config section."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        plain: list[tuple[str, str]] = []
        grouped: dict[str, list[tuple[str, str]]] = {}
        for p in self.get_params(ctx):
            rec = p.get_help_record(ctx) if isinstance(p, click.Option) else None
            if rec is None:
                continue
            if isinstance(p, _ConfigOption):
                grouped.setdefault(p.section_title, []).append(rec)
            else:
                plain.append(rec)
        if plain:
            with formatter.section("Options"):
                formatter.write_dl(plain)
        for title, recs in grouped.items():
            with formatter.section(f"{title} options"):
                formatter.write_dl(recs)


def _click_type(tp: Any) -> tuple[Any, bool]:
    """(click type, is_bool) for a field's type hint (Optional stripped)."""
    args = (
        [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) else [tp]
    )
    base = args[0] if args else tp
    if base is bool:
        return None, True
    return {int: click.INT, float: click.FLOAT, str: click.STRING}.get(base, click.STRING), False


def _is_repeatable(tp: Any) -> bool:
    """A field typed `... | list[X]`: its flag may be given several times."""
    return any(typing.get_origin(a) is list for a in typing.get_args(tp))


# Repeatable flags that also take several values after one flag, as vLLM's nargs="+"
# (`--lora-modules a=/p b=/q`): following tokens that look like values (name=path or JSON).
_GREEDY = {("server", "lora_modules")}


class _GreedyOption(_ConfigOption):
    """A multiple=True flag that also consumes the values right after it (see _GREEDY); a
    token without '=' (e.g. the MODEL argument) or starting with '-' ends the list."""

    def add_to_parser(self, parser: Any, ctx: click.Context) -> None:  # noqa: ANN401
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            opt = parser._long_opt.get(name)
            if opt is None:
                continue
            orig = opt.process

            def process(value: Any, state: Any, orig: Any = orig) -> None:  # noqa: ANN401
                orig(value, state)
                while (
                    state.rargs
                    and not state.rargs[0].startswith("-")
                    and ("=" in state.rargs[0] or state.rargs[0].lstrip().startswith("{"))
                ):
                    orig(state.rargs.pop(0), state)

            opt.process = process


def _config_options(sections: set[str]) -> Callable[[Callable], Callable]:
    """Decorator adding one flag per field of the named config sections."""
    decorators = []
    for section, cls, title in _SECTIONS:
        if section not in sections:
            continue
        hints = typing.get_type_hints(cls)
        helps = _field_comments(cls)
        for f in dataclasses.fields(cls):
            if (section, f.name) in _SKIP:
                continue
            dest = _RENAME.get((section, f.name), f.name)
            flag = "--" + dest.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            ctype, is_bool = _click_type(hints[f.name])
            if (section, f.name) in _CHOICES:
                ctype = click.Choice(_CHOICES[(section, f.name)])
            help_ = helps.get(f.name) or _EXTRA_HELP.get((section, f.name), "")
            if dest == "speculative_config":
                ctype, default = click.STRING, None
                help_ = 'Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'.'
            kw: dict[str, Any] = dict(
                section=section,
                section_title=title,
                field_name=f.name,
                default=default,
                help=help_,
                envvar=f"XLASERVE_{dest.upper()}",
                show_default=default is not None,
            )
            if section in _ENV_IN_CONFIG:
                kw.update(default=None, envvar=None, show_default=str(default))
                kw["help"] = f"{help_} (env XLASERVE_{dest.upper()})"
            if is_bool:
                decl = [f"{flag}/--no-{flag[2:]}", *_ALIASES.get((section, f.name), []), dest]
                kw["is_flag"] = True
            elif _is_repeatable(hints[f.name]):
                decl = [flag, dest]
                kw.update(type=ctype, multiple=True, default=None)
                if (section, f.name) in _GREEDY:
                    decorators.append(_GreedyOption(decl, **kw))
                    continue
            else:
                decl = [flag, dest]
                kw["type"] = ctype
            decorators.append(_ConfigOption(decl, **kw))

    def apply(fn: Callable) -> Callable:
        fn.__click_params__ = getattr(fn, "__click_params__", []) + decorators[::-1]  # type: ignore[attr-defined]
        return fn

    return apply


def _sections_kwargs(ctx: click.Context) -> dict[str, dict[str, Any]]:
    """Flag values regrouped by config section: {"cache": {"block_size": 16, ...}, ...}."""
    out: dict[str, dict[str, Any]] = {}
    for p in ctx.command.params:
        if isinstance(p, _ConfigOption):
            value = ctx.params[p.name]
            if p.multiple:  # a repeatable flag: a tuple, () when not given
                value = list(value) or None
            out.setdefault(p.section, {})[p.field_name] = value
    return out


def build_engine_config(model: str | None, parts: dict[str, dict[str, Any]]) -> cfg.EngineConfig:
    """EngineConfig from the CLI's per-section values (ValueError on bad values)."""
    engine = dict(parts.get("engine", {}))
    if "speculative" in engine:
        engine["speculative"] = cfg.SpeculativeConfig.from_any(engine["speculative"])
    return cfg.EngineConfig(
        model=cfg.ModelConfig(model=model, **parts.get("model", {})),
        cache=cfg.CacheConfig(**parts.get("cache", {})),
        scheduler=cfg.SchedulerConfig(**parts.get("scheduler", {})),
        parallel=cfg.ParallelConfig(**parts.get("parallel", {})),
        load=cfg.LoadConfig(**parts.get("load", {})),
        structured=cfg.StructuredOutputConfig(**parts.get("structured", {})),
        lora=cfg.LoRAConfig(**parts.get("lora", {})),
        kernels=cfg.KernelConfig.from_env(
            **{k: v for k, v in parts.get("kernels", {}).items() if v is not None}
        ),
        **engine,
    )


def _engine_config(ctx: click.Context, model: str | None) -> cfg.EngineConfig:
    try:
        return build_engine_config(model, _sections_kwargs(ctx))
    except (ValueError, TypeError) as e:  # __post_init__ checks, bad speculative JSON
        raise _StartupFailure(str(e), exit_code=2) from None


_ENGINE_SECTIONS = {
    "model", "cache", "scheduler", "parallel", "load", "structured", "kernels", "lora", "engine"
}  # fmt: skip


class _LazyGroup(click.Group):
    """Adds LAZY_COMMANDS whose module is importable, importing it only when invoked."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        lazy = [n for n, target in LAZY_COMMANDS.items() if _module_exists(target.split(":")[0])]
        return sorted(set(super().list_commands(ctx)) | set(lazy))

    def invoke(self, ctx: click.Context) -> Any:
        """Start-up failures become one `Error: ...` line on stderr and a non-zero exit (a
        traceback only with XLASERVE_LOGGING_LEVEL=DEBUG)."""
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            raise click.Abort() from None
        except Exception as e:
            _fail(e)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is not None or name not in LAZY_COMMANDS:
            return cmd
        module, attr = LAZY_COMMANDS[name].split(":")
        if not _module_exists(module):
            return None
        return getattr(importlib.import_module(module), attr)


class _StartupFailure(click.ClickException):
    """Printed by click as `Error: <message>`; exit code 2 (bad argument) or 1."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _fail(e: BaseException) -> typing.NoReturn:
    """Raise `e` as one `Error:` line (StartupError keeps its exit code); with
    XLASERVE_LOGGING_LEVEL=DEBUG the traceback is printed first."""
    from xlaserve.entrypoints.checks import StartupError
    from xlaserve.logger import debug_enabled

    if debug_enabled():
        import traceback

        traceback.print_exception(e)
    if isinstance(e, StartupError):
        raise _StartupFailure(str(e), e.exit_code) from None
    detail = str(e).strip().splitlines()
    msg = detail[0] if detail else ""
    raise _StartupFailure(f"{type(e).__name__}: {msg}" if msg else type(e).__name__) from None


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


@click.group(
    cls=_LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.version_option(package_name="xlaserve", prog_name="xlaserve")
def main() -> None:
    """xlaserve: LLM inference and serving (JAX/XLA and PyTorch backends)."""


# ------------------------------------------------------------------------------- serve


def _load_config_file(ctx: click.Context, _param: click.Parameter, path: str | None) -> None:
    """`--config FILE` (vLLM's): a YAML (or JSON) mapping of flag names to values, e.g.
    `max-num-seqs: 32` or `model: /models/x`; the values become the flags' defaults, so a flag
    given on the command line (or its XLASERVE_ variable) still wins."""
    if path is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise _StartupFailure(f"--config {path}: {e.strerror or e}", exit_code=2) from None
    try:
        if path.endswith(".json"):
            import json

            data = json.loads(text)
        else:
            try:
                import yaml
            except ImportError:
                raise _StartupFailure(
                    "--config FILE.yaml needs PyYAML (pip install pyyaml), or give a .json file",
                    exit_code=2,
                ) from None
            data = yaml.safe_load(text)
    except ValueError as e:  # json.JSONDecodeError
        raise _StartupFailure(f"--config {path}: not valid JSON: {e}", exit_code=2) from None
    except Exception as e:  # yaml.YAMLError: yaml is imported lazily
        if type(e).__module__.startswith("yaml"):
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise _StartupFailure(f"--config {path}: not valid YAML: {first}", 2) from None
        raise
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _StartupFailure(f"--config {path}: must hold a mapping of flag: value", 2)
    names = {p.name for p in ctx.command.params if p.name}
    mapping: dict[str, Any] = {}
    unknown = []
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in names or name == "config":
            unknown.append(str(key))
        else:
            mapping[name] = value
    if unknown:
        raise _StartupFailure(
            f"--config {path}: unknown option(s): {', '.join(sorted(unknown))}", exit_code=2
        )
    ctx.default_map = {**(ctx.default_map or {}), **mapping}


def _config_file_option(fn: Callable) -> Callable:
    return click.option(
        "--config",
        type=click.Path(dir_okay=False),
        default=None,
        is_eager=True,  # read first: its values are the other flags' defaults
        expose_value=False,
        callback=_load_config_file,
        help="YAML (or .json) file of flag: value pairs (e.g. 'max-num-seqs: 32'); flags on "
        "the command line win over it.",
    )(fn)


@main.command(cls=_GroupedCommand)
@click.argument("model", required=False, envvar="XLASERVE_MODEL")
@_config_file_option
@_config_options(_ENGINE_SECTIONS | {"server"})
@click.pass_context
def serve(ctx: click.Context, model: str | None, **_: Any) -> None:
    """Serve MODEL (an HF-layout directory; default: the shipped demo model) over an
    OpenAI-compatible HTTP API.

    Every flag can also be set as XLASERVE_<FLAG_NAME> (e.g. XLASERVE_MAX_NUM_SEQS=32).
    """
    engine_config = _engine_config(ctx, model)
    try:
        server_config = cfg.ServerConfig(**_sections_kwargs(ctx).get("server", {}))
        server_config.api_keys()  # an unreadable or empty --api-key-file stops here
        if server_config.lora_modules:  # syntax and --enable-lora, before any loading
            from xlaserve.entrypoints.openai.serving_lora import parse_lora_module

            mods = server_config.lora_modules
            for m in [mods] if isinstance(mods, str) else mods:
                parse_lora_module(m)
            if not engine_config.lora.enable_lora:
                raise ValueError("--lora-modules needs --enable-lora")
    except ValueError as e:
        raise _StartupFailure(str(e), exit_code=2) from None
    _setup_logging()
    from xlaserve.entrypoints.checks import check_serve

    check_serve(engine_config, server_config)  # port free, model readable: before any loading
    from xlaserve.entrypoints.openai.api_server import run_server

    run_server(engine_config, server_config)


def _setup_logging(default: str = "INFO") -> None:
    """XLASERVE_LOGGING_LEVEL for the whole process (a bad value is a usage error); `default`
    when it is unset (generate / chat: WARNING, so log lines do not interleave the text)."""
    from xlaserve.logger import configure_logging

    try:
        configure_logging(root=True, default=default)
    except ValueError as e:
        raise _StartupFailure(str(e), exit_code=2) from None


# ------------------------------------------------------------------------------- generate / chat


def _stream_one(engine: Any, prompt: Any, params: Any, out: Callable[[str], None]) -> Any:
    """Run one request on a synchronous LLMEngine, writing text deltas as they arrive."""
    rid = f"cli-{uuid.uuid4().hex[:8]}"
    engine.add_request(rid, prompt, params)
    sent, final = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != rid:
                continue
            if o.error:
                raise click.ClickException(f"generation failed: {o.error}")
            text = o.outputs[0].text
            if len(text) > sent:
                out(text[sent:])
                sent = len(text)
            final = o
    return final


def _sampling_options(fn: Callable) -> Callable:
    fn = click.option(
        "--max-tokens", type=int, default=128, show_default=True, help="Most tokens to generate."
    )(fn)
    fn = click.option(
        "--temperature", type=float, default=0.8, show_default=True, help="0 = greedy."
    )(fn)
    fn = click.option(
        "--top-p", type=float, default=0.95, show_default=True, help="Nucleus sampling mass."
    )(fn)
    return fn


def _make_params(max_tokens: int, temperature: float, top_p: float) -> Any:
    """SamplingParams from the flags, checked before any model loads (bad value: usage error)."""
    from xlaserve.sampling_params import SamplingParams

    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p)
    except ValueError as e:
        raise _StartupFailure(str(e), exit_code=2) from None


def _make_engine(ctx: click.Context, model: str | None) -> Any:
    config = _engine_config(ctx, model)
    _setup_logging(default="WARNING")
    from xlaserve.entrypoints.checks import check_model

    check_model(config)  # a missing directory, unknown architecture or no weights: one line
    from xlaserve.engine.llm_engine import LLMEngine

    try:
        return LLMEngine(config)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None


@main.command(cls=_GroupedCommand)
@click.argument("prompt")
@click.option(
    "--model",
    "model",
    default=None,
    envvar="XLASERVE_MODEL",
    help="Model directory (default: demo model).",
)
@_sampling_options
@_config_options(_ENGINE_SECTIONS)
@click.pass_context
def generate(
    ctx: click.Context,
    prompt: str,
    model: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    **_: Any,
) -> None:
    """Generate a continuation of PROMPT, streamed to the terminal."""
    params = _make_params(max_tokens, temperature, top_p)
    engine = _make_engine(ctx, model)
    try:
        click.echo(prompt, nl=False)
        _stream_one(engine, prompt, params, lambda s: click.echo(s, nl=False))
        click.echo()
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    finally:
        engine.shutdown()


@main.command(cls=_GroupedCommand)
@click.argument("model", required=False, envvar="XLASERVE_MODEL")
@click.option("--system", default=None, help="System prompt.")
@_sampling_options
@_config_options(_ENGINE_SECTIONS)
@click.pass_context
def chat(
    ctx: click.Context,
    model: str | None,
    system: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    **_: Any,
) -> None:
    """Chat with MODEL in the terminal (its chat template; history kept).

    Commands: /reset clears the history, /exit (or Ctrl-D) quits.
    """
    params = _make_params(max_tokens, temperature, top_p)
    if sys.stdin.isatty():
        with_readline = importlib.util.find_spec("readline") is not None
        if with_readline:
            importlib.import_module("readline")  # line editing and history for input()
    engine = _make_engine(ctx, model)
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    try:
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                click.echo()
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = list(base)
                click.echo("(history cleared)")
                continue
            history.append({"role": "user", "content": text})
            try:
                prompt = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True)
                ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
                final = _stream_one(
                    engine,
                    {"prompt": prompt, "prompt_token_ids": ids},
                    params,
                    lambda s: click.echo(s, nl=False),
                )
            except ValueError as e:  # no chat template, context full
                history.pop()
                click.echo(f"error: {e}", err=True)
                continue
            click.echo()
            history.append({"role": "assistant", "content": final.outputs[0].text if final else ""})
    finally:
        engine.shutdown()


if __name__ == "__main__":  # pragma: no cover
    main()
