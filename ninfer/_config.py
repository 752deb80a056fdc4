"""Server configuration: one frozen attrs object, built once from flags, env or TOML.

Every setting is declared once, as a field of `ServerConfig` with its type, default,
bounds and help text; `SETTINGS` reads them off the class, and `ninfer serve --help`,
the `NINFER_*` environment variables and the TOML file are all generated from it, so
they cannot drift apart. A refused value raises ConfigError naming the flag.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Union

import attrs

from ninfer._errors import ConfigError
from ninfer.engine import (
    DTYPE_NAMES,
    KERNEL_MODES,
    KV_DTYPES,
    POOLINGS,
    SPEC_BACKENDS,
    WEIGHT_MODES,
    kv_dtype_conflict,
)

__all__ = [
    "SETTINGS",
    "ServerConfig",
    "Setting",
    "add_arguments",
    "build_config",
    "config_from_env",
    "config_from_namespace",
    "public_settings",
    "redacted_argv",
]


@attrs.frozen
class Setting:
    """One setting as the flags, variables and files see it: read off ServerConfig's
    field (its type and `setting(...)` declaration)."""

    name: str  # attribute name; flag is --name-with-dashes, env NINFER_NAME
    kind: type  # int, float, str, bool, list
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    optional: bool = False  # None allowed (unset)
    metavar: str | None = None
    words: tuple[str, ...] = ()  # a number setting's values that are words (auto)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "NINFER_" + self.name.upper()


def setting(
    default: Any,
    help: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] = (),
    metavar: str | None = None,
) -> Any:
    """A ServerConfig field that is a setting: its default, help text and bounds."""
    spec = {"help": help, "minimum": minimum, "maximum": maximum, "choices": choices}
    return attrs.field(default=default, metadata={"setting": {**spec, "metavar": metavar}})


@attrs.frozen(kw_only=True)
class ServerConfig:
    """The whole server configuration. Each field is a setting, declared once here with
    its default, help text and bounds (`setting`): its flag is --name-with-dashes, its
    environment variable NINFER_NAME, its TOML key the name; its type says what values
    it takes (an optional one may be unset; a Literal word, e.g. auto, beside a number)."""

    host: str = setting("127.0.0.1", "listen address")
    port: int = setting(8080, "listen port (0: any free port)", minimum=0, maximum=65535)
    model: str = setting(
        "smollm2-135m-instruct",
        "registered model name (fetched on first use: smollm2-135m-instruct, gemma3-270m) "
        "or path to a GGUF file of the llama family (llama, qwen2, qwen3, gemma3)",
    )
    served_model_name: tuple[str, ...] | None = setting(
        None,
        "the names requests may give as `model` on every protocol (aliases, e.g. "
        "gpt-4o-mini for a tool that defaults to it); the first is the one /v1/models and "
        "the logs show (default: the registered name or the file's model id)",
        metavar="NAME",
    )
    model_id: str | None = setting(
        None, "one public model name; the same as --served-model-name with one NAME"
    )
    cache_dir: str | None = setting(None, "model cache (default: $NINFER_CACHE or XDG cache)")
    device: str = setting("cpu", "torch device", choices=("cpu", "cuda"))
    dtype: str = setting(
        "float32",
        "weights and activations; float32 is batch-invariant, bfloat16 is faster but a "
        "batched row can drift from the same row alone",
        choices=DTYPE_NAMES,
    )
    kernels: str = setting(
        "auto",
        "native: ninfer's own CPU kernels run the layers (every matrix in the file's own "
        "blocks, float32 sums in one fixed order: the same bits alone or batched and on every "
        "CPU; built by ./dev.sh or `ninfer build-kernels`, else at the first start); torch: "
        "torch's kernels, with --weights; auto: native where they are built, the model and "
        "--device/--dtype allow them and the start-up self-check passes them, else torch "
        "(docs/engine.md)",
        choices=KERNEL_MODES,
    )
    self_check: str = setting(
        "cached",
        "cached: a start whose model file, engine code, kernels library, torch build, CPU "
        "and settings match an earlier start's that passed every start-up check adopts "
        "that verdict instead of checking again (kept under the cache directory's "
        'checks/); always: check at every start (docs/engine.md, "The self-check")',
        choices=("cached", "always"),
    )
    weights: str = setting(
        "int4",
        "the matrices on torch's kernels (--kernels torch, or where native ones do not run): "
        "int4 runs the GGUF's Q4_0/Q4_1/Q4_K matrices in their 4-bit blocks through torch's "
        "int4 CPU kernel (bfloat16 inside those matmuls, everything else in --dtype); dense "
        "dequantizes every matrix to --dtype",
        choices=WEIGHT_MODES,
    )
    max_context: int | None = setting(
        None, "logical context ceiling of each sequence (default: the model's)", minimum=1
    )
    kv_capacity: int | Literal["auto"] | None = setting(
        None,
        "KV-cache pool in tokens, shared by all requests, or auto: as many as fit in the "
        "memory left after the weights, 1 GiB kept free (the CPU's available memory, "
        "within a cgroup limit; on CUDA the device's free memory) (default: --max-context)",
        minimum=1,
        metavar="TOKENS|auto",
    )
    kv_dtype: str = setting(
        "auto",
        "KV-cache storage: auto (float16 beside float32 activations where the self-check "
        "passes it, else float32; beside bfloat16 activations, bfloat16), float16 (each key "
        "and value the nearest half, every sum float32: half float32's memory), float32, or "
        "int8 (8-bit integers with a float32 scale per position and head: about a quarter "
        "of float32's memory); each stays batch-invariant, answers differ between them "
        "(docs/engine.md)",
        choices=KV_DTYPES,
    )
    max_concurrency: int = setting(
        8, "requests decoding at once (one batch)", minimum=1, maximum=64
    )
    max_pending_requests: int = setting(
        16, "requests allowed to wait behind the running ones", minimum=0, maximum=4096
    )
    pending_timeout_ms: int = setting(
        30000, "absolute deadline from arrival to admission (503 request_queue_timeout)", minimum=1
    )
    prefill_chunk: int = setting(
        256,
        "prompt tokens per prefill step (fewer deep into a long prompt)",
        minimum=1,
        maximum=65536,
    )
    no_thinking: bool = setting(
        False,
        "answer without reasoning by default, on a model whose chat template can think "
        "(Qwen 3's enable_thinking, a reply that opens <think>); a request may still ask "
        "for it (docs/api.md, Thinking)",
    )
    preserve_thinking: bool = setting(
        False,
        "keep the reasoning of earlier, closed turns in the prompt by default, where the "
        "chat template takes preserve_thinking (most drop it after each user turn)",
    )
    no_packed_cache: bool = setting(
        False,
        "pack the native kernels' matrices from the model file at every start instead of "
        "keeping them under the cache directory's packed/ for the next start to map (about "
        "the model file's size again on disk, the 3 most recently used kept; engine.md, "
        "'Packed matrices kept between starts')",
    )
    no_prefix_cache: bool = setting(
        False,
        "compute every prompt whole instead of reusing the keys and values of a cached prefix: "
        "slower for shared prefixes, with the same results (a prompt served from the cache "
        "gets the bits it gets computed whole; docs/engine.md)",
    )
    spec: str = setting(
        "none",
        "speculative decoding: ngram drafts each row's next tokens from its own prompt and "
        "output (and a constrained row's from the tokens its grammar forces) and verifies "
        "them in the decode pass; the output is token for token the output without it "
        "(greedy or seeded), faster where answers repeat their prompt (docs/engine.md)",
        choices=SPEC_BACKENDS,
    )
    draft_tokens: int = setting(
        8,
        "the most tokens a row drafts a step, with --spec ngram (fewer where they are not "
        "likely to pay: docs/engine.md)",
        minimum=1,
        maximum=16,
    )
    max_request_mib: float = setting(
        4.0, "request body limit before JSON parsing (413)", minimum=0.001, maximum=1024
    )
    default_max_tokens: int = setting(
        512,
        "output limit of a /v1/generate request that names none (clamped to the context and "
        "the KV pool left); on the routes that give one naming none up to the room left (chat, "
        "Responses, /completion), the output tokens whose KV pages are held from the start",
        minimum=1,
    )
    response_store_max_records: int = setting(
        1024,
        "Responses kept for retrieval and previous_response_id (least recently used go first)",
        minimum=1,
    )
    response_store_max_mib: float = setting(
        64.0,
        "text the Responses store may hold (a response larger than this is refused)",
        minimum=0.001,
    )
    request_log_jsonl: str | None = setting(
        None, "append one JSON object per event to FILE", metavar="FILE"
    )
    chat_template: str | None = setting(
        None,
        "a chat template for the model, replacing its file's: chatml, gemma3, or a Jinja "
        "file's path (default: the file's own; a base model such as Gemma 3 270M has none)",
    )
    metrics_public: bool = setting(
        False,
        "serve GET /metrics without the API key (as vLLM allows), for a Prometheus that "
        "scrapes without credentials; the metrics hold no prompt or key",
    )
    no_access_log: bool = setting(
        False,
        "print no access line on the console for each request (method, route, status, "
        "tokens, seconds)",
    )
    log_stats_interval_ms: int = setting(
        5000,
        "interval of the console's stats line and the log's throughput record; 0 disables both",
        minimum=0,
    )
    graceful_timeout_s: float = setting(
        10.0, "on SIGTERM/SIGINT, time in-flight requests get to finish", minimum=0, maximum=3600
    )
    read_timeout_s: float = setting(
        30.0, "deadline for reading a request body (408)", minimum=0.001, maximum=3600
    )
    write_timeout_s: float = setting(
        30.0,
        "a client that stops reading is cancelled after this long without progress",
        minimum=0.001,
        maximum=3600,
    )
    stream_resume_s: float = setting(
        60.0,
        "a stream sent with X-Conversation-Id (llama.cpp's web UI) goes on this long "
        "after its client leaves, for GET /v1/stream to resume; then it is cancelled. "
        "0: streams end with their client",
        minimum=0,
        maximum=3600,
    )
    pooling: str = setting(
        "auto",
        "how an embedding's token states become its vector (/v1/embeddings, /embedding): "
        "auto (the GGUF's pooling_type where it has one, else mean), mean, last, cls, or "
        "none (one vector a token: llama-server's /embedding routes only)",
        choices=("auto", *POOLINGS),
    )
    embd_normalize: int = setting(
        2,
        "how embeddings are normalized (llama-server's): -1 none, 0 max absolute to "
        "int16's range, 1 taxicab, 2 euclidean, p > 2 the p-norm; a request's "
        "embd_normalize wins",
        minimum=-1,
        maximum=64,
    )
    api_key: str | None = setting(
        None,
        "require this key (Bearer or x-api-key) on all but /health, /ready; visible to "
        "other users in `ps`: prefer NINFER_API_KEY or --api-key-file",
        metavar="KEY",
    )
    api_key_file: str | None = setting(
        None, "read the API key from this file (its first line)", metavar="PATH"
    )
    trusted_proxies: tuple[str, ...] | None = setting(
        None,
        "addresses or networks (CIDR) of load balancers in front of the server, whose "
        "X-Forwarded-For names the client: the scheduler holds each client, known by its "
        "address, to its Retry-After promise (docs/scheduler.md); e.g. 127.0.0.1 behind "
        "deploy/nginx.conf on the same host",
        metavar="ADDRESS",
    )
    cors: str | None = setting(
        None,
        "browser CORS: --cors alone allows any origin; --cors ORIGIN[,ORIGIN...] only "
        "those (e.g. https://app.example.com)",
        metavar="ORIGINS",
    )
    seed: int | None = setting(
        None,
        "seed for requests that name none (default: a fresh one each)",
        minimum=0,
        maximum=2**31 - 1,
    )
    greedy: bool = setting(False, "force greedy decoding (temperature 0) for every request")
    temperature: float | None = setting(
        None,
        "default temperature (default: the model file's recommendation, else 0.8)",
        minimum=0,
        maximum=2,
    )
    top_p: float | None = setting(
        None,
        "default top-p (default: the model file's recommendation, else 0.95)",
        minimum=0,
        maximum=1,
    )
    top_k: int | None = setting(
        None,
        "default top-k (default: the model file's recommendation, else 40; 0 is off)",
        minimum=0,
    )
    min_p: float | None = setting(
        None,
        "default min-p (default: the model file's recommendation, else 0.05; 0 is off)",
        minimum=0,
        maximum=1,
    )
    presence_penalty: float | None = setting(
        None, "default presence penalty (default: 0.0)", minimum=-2, maximum=2
    )
    frequency_penalty: float | None = setting(
        None, "default frequency penalty (default: 0.0)", minimum=-2, maximum=2
    )
    threads: int | None = setting(
        None,
        "threads of the engine's kernels (default: the CPUs this process may use, within a "
        "cgroup's CPU quota)",
        minimum=1,
        maximum=1024,
    )

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mib * 1024 * 1024)


def _read_setting(field: attrs.Attribute[Any], hint: Any) -> Setting:
    """A field's Setting: the kind from its type (a tuple of names is a list), unset
    allowed where None is, and the words a Literal beside a number names."""
    parts = (
        typing.get_args(hint) if typing.get_origin(hint) in (types.UnionType, Union) else (hint,)
    )
    words: tuple[str, ...] = ()
    kinds = []
    for part in parts:
        if typing.get_origin(part) is Literal:
            words += typing.get_args(part)
        elif part is not type(None):
            kinds.append(list if typing.get_origin(part) is tuple else part)
    (kind,) = kinds
    return Setting(
        field.name,
        kind,
        field.default,
        optional=type(None) in parts,
        words=words,
        **field.metadata["setting"],
    )


_HINTS = typing.get_type_hints(ServerConfig)
SETTINGS: tuple[Setting, ...] = tuple(
    _read_setting(f, _HINTS[f.name]) for f in attrs.fields(ServerConfig)
)
_BY_NAME = {s.name: s for s in SETTINGS}


def _check(setting: Setting, value: Any, label: str | None = None) -> Any:
    """`value` for `setting`, checked; errors name `label` (where the value came from:
    a flag, an environment variable, a TOML file's key), else the flag."""
    flag = label or setting.flag
    if value is None:
        if setting.optional:
            return None
        raise ConfigError(f"{flag} needs a value")
    if setting.words and isinstance(value, str) and value in setting.words:
        return value
    if setting.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{flag} must be true or false")
    elif setting.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{flag} must be an integer{_or_words(setting)}")
    elif setting.kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{flag} must be a number")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{flag} must be a finite number")
    elif setting.kind is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",")]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{flag} must be a list of names")
        if not value or not all(v.strip() for v in value):
            raise ConfigError(f"{flag} needs non-empty names")
        return tuple(value)
    elif not isinstance(value, str):
        raise ConfigError(f"{flag} must be a string")
    if setting.minimum is not None and value < setting.minimum:
        raise ConfigError(f"{flag} must be at least {setting.minimum:g}, got {value}")
    if setting.maximum is not None and value > setting.maximum:
        raise ConfigError(f"{flag} must be at most {setting.maximum:g}, got {value}")
    if setting.choices and value not in setting.choices:
        raise ConfigError(f"{flag} must be one of {', '.join(setting.choices)}, got {value!r}")
    return value


def _or_words(setting: Setting) -> str:
    return "".join(f" or {w}" for w in setting.words)


def build_config(
    values: Mapping[str, Any], sources: Mapping[str, str] | None = None
) -> ServerConfig:
    """A ServerConfig from a mapping of setting names; unknown names and bad values
    refused, naming where each came from (`sources`: name to flag, variable or key)."""
    checked: dict[str, Any] = {}
    sources = sources or {}
    if isinstance(values.get("cors"), bool):  # cors = true in a TOML file
        values = {**values, "cors": "*" if values["cors"] else None}
    for name, value in values.items():
        if name not in _BY_NAME:
            raise ConfigError(f"unknown setting {sources.get(name, repr(name))}{_close(name)}")
        checked[name] = _check(_BY_NAME[name], value, sources.get(name))
    for s in SETTINGS:
        checked.setdefault(s.name, s.default)
    if checked["api_key_file"] is not None:
        if checked["api_key"] is not None:
            raise ConfigError("--api-key and --api-key-file: give one of them")
        checked["api_key"] = _read_key(checked["api_key_file"])
    if checked["model_id"] is not None:
        if checked["served_model_name"] is not None:
            raise ConfigError("--model-id and --served-model-name: give one of them")
        checked["served_model_name"] = (checked["model_id"],)
    if checked["chat_template"] is not None:  # a name or a readable file, said at start
        from ninfer._chat_templates import chat_template_source

        chat_template_source(checked["chat_template"])
    for proxy in checked["trusted_proxies"] or ():
        try:
            ipaddress.ip_network(proxy.strip(), strict=False)
        except ValueError:
            where = sources.get("trusted_proxies", "--trusted-proxies")
            raise ConfigError(
                f"{where}: {proxy.strip()!r} is not an address or a network (CIDR)"
            ) from None
    conflict = kv_dtype_conflict(checked["kv_dtype"], checked["dtype"])
    if conflict is not None:
        raise ConfigError(conflict)
    if checked["api_key"] is not None and not checked["api_key"].strip():
        raise ConfigError("--api-key must not be empty (an empty key would let anyone in)")
    return ServerConfig(**checked)


def _read_key(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({exc})") from None


# NINFER_ variables that are not settings: read by ninfer or its scripts.
OTHER_ENV = {
    "NINFER_CONFIG": "a TOML file of settings",
    "NINFER_CACHE": "the model cache",
    "NINFER_TORCH": "the torch dev.sh installs",
    "NINFER_URL": "the server the examples ask",
}


def closest(word: str, known: Iterable[str], cutoff: float = 0.75) -> str | None:
    """The known name `word` was most likely meant to be (a misspelling), if any: for
    the errors that say "did you mean" (a setting, a variable, a flag)."""
    close = difflib.get_close_matches(word, sorted(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def _close(name: str) -> str:
    """'; did you mean X?' for the known setting nearest `name`, else ''."""
    close = closest(name, _BY_NAME)
    return f"; did you mean {close!r}?" if close else ""


def check_env_names(environ: Mapping[str, str]) -> None:
    """Refuse an unknown NINFER_ variable (a misspelt one would be silently ignored),
    naming the closest known one."""
    known = {s.env for s in SETTINGS} | set(OTHER_ENV)
    for name in sorted(environ):
        if name.startswith("NINFER_") and name not in known:
            close = closest(name, known)
            hint = f"; did you mean {close}?" if close else ""
            raise ConfigError(f"unknown environment variable {name}{hint}")


def env_values(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings NINFER_CONFIG's TOML file and the NINFER_ variables give (the
    variables over the file), and where each came from."""
    check_env_names(environ)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    path = environ.get("NINFER_CONFIG")
    if path:
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"NINFER_CONFIG {path}: {exc}") from None
        for key, value in table.items():
            name = key.replace("-", "_")
            values[name] = value
            sources[name] = f"{key!r} in {path}"
    for s in SETTINGS:
        if s.env in environ:
            values[s.name] = _parse_env_value(s, environ[s.env])
            sources[s.name] = s.env
    return values, sources


def _parse_env_value(setting: Setting, raw: str) -> Any:
    if setting.name == "cors":  # NINFER_CORS=1 (any origin), or a list of origins
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on", "*"):
            return "*"
        return None if low in ("0", "false", "no", "off", "") else raw
    if setting.kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{setting.env} must be true or false")
    if raw.strip() in setting.words:
        return raw.strip()
    if setting.kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{setting.env} must be an integer{_or_words(setting)}") from None
    if setting.kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{setting.env} must be a number") from None
    return raw


def config_from_env(environ: Mapping[str, str]) -> ServerConfig:
    """For `hypercorn 'ninfer.app:create_app()'`: NINFER_CONFIG names an optional TOML
    file of settings; NINFER_<SETTING> variables override it."""
    return build_config(*env_values(environ))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for s in SETTINGS:
        help_text = s.help
        if s.choices:
            help_text += f"; one of {', '.join(s.choices)}"
        if "(default:" not in s.help:  # some say what an unset value means themselves
            help_text += f" (default: {'unset' if s.default is None else s.default})"
        if s.kind is bool:
            parser.add_argument(s.flag, action="store_true", default=s.default, help=help_text)
            continue
        if s.kind is list:
            parser.add_argument(s.flag, nargs="+", default=None, metavar=s.metavar, help=help_text)
            continue
        if s.name == "cors":  # a flag whose value is optional: alone, any origin
            parser.add_argument(
                s.flag, nargs="?", const="*", default=None, metavar=s.metavar, help=help_text
            )
            continue
        parser.add_argument(
            s.flag,
            type=str,
            default=None,
            metavar=s.metavar or s.name.upper(),
            help=help_text,
        )


def config_from_namespace(
    ns: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """`ninfer serve`'s settings: flags over NINFER_ variables over NINFER_CONFIG's
    TOML file (as under hypercorn), each refused naming where it came from."""
    values, sources = env_values(environ or {})
    if ns.api_key is not None or ns.api_key_file is not None:  # a flag's key wins whole
        for name in ("api_key", "api_key_file"):
            values.pop(name, None)
    for s in SETTINGS:
        raw = getattr(ns, s.name)
        if raw is None or (s.kind is bool and raw is False):
            continue  # not given (a boolean flag cannot say false: the lower layers may)
        sources[s.name] = s.flag
        if s.kind is bool:
            values[s.name] = bool(raw)
            continue
        if raw in s.words:
            values[s.name] = raw
        elif s.kind is int:
            try:
                values[s.name] = int(raw)
            except ValueError:
                raise ConfigError(
                    f"{s.flag} must be an integer{_or_words(s)}, got {raw!r}"
                ) from None
        elif s.kind is float:
            try:
                values[s.name] = float(raw)
            except ValueError:
                raise ConfigError(f"{s.flag} must be a number, got {raw!r}") from None
        else:
            values[s.name] = raw
    return build_config(values, sources)


def redacted_argv(argv: Sequence[str], secret: str | None = None) -> list[str]:
    """argv with the API key replaced by <redacted>: after --api-key, and wherever the
    key's value appears (whatever the flag was spelled)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if secret and secret in arg:
            out.append(arg.replace(secret, "<redacted>"))
            hide_next = False
        elif hide_next:
            out.append("<redacted>")
            hide_next = False
        elif arg == "--api-key":
            out.append(arg)
            hide_next = True
        elif arg.startswith("--api-key="):
            out.append("--api-key=<redacted>")
        else:
            out.append(arg)
    return out


def public_settings(cfg: ServerConfig) -> dict[str, Any]:
    """The configuration for logs: every setting, the API key only as set/unset."""
    out = attrs.asdict(cfg)
    if out.get("api_key") is not None:
        out["api_key"] = "<redacted>"
    return out
