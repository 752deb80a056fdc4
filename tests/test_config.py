"""Configuration: flags, environment and TOML agree; bad values name the flag."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import attrs
import pytest

from ninfer._cli import build_parser, main
from ninfer._config import (
    SETTINGS,
    ServerConfig,
    add_arguments,
    build_config,
    config_from_env,
    config_from_namespace,
    redacted_argv,
)
from ninfer._errors import ConfigError


def test_each_setting_is_read_off_its_field() -> None:
    """Declared once, on ServerConfig: the kind, whether it may be unset and its words
    come from the field's type; the help and bounds from its `setting(...)`."""
    assert [s.name for s in SETTINGS] == [f.name for f in attrs.fields(ServerConfig)]
    by = {s.name: s for s in SETTINGS}
    capacity = by["kv_capacity"]
    assert (capacity.kind, capacity.words, capacity.optional) == (int, ("auto",), True)
    assert (by["served_model_name"].kind, by["served_model_name"].optional) == (list, True)
    assert (by["greedy"].kind, by["greedy"].default, by["greedy"].optional) == (bool, False, False)
    assert (by["port"].kind, by["port"].minimum, by["port"].maximum) == (int, 0, 65535)
    assert (by["max_request_mib"].kind, by["cors"].kind) == (float, str)
    assert by["spec"].choices == ("none", "ngram")
    assert all(s.help for s in SETTINGS)


def _parse(*argv: str) -> ServerConfig:
    return config_from_namespace(build_parser().parse_args(["serve", *argv]))


def test_flags_build_the_config() -> None:
    cfg = _parse("--max-concurrency", "4", "--cors", "--temperature", "0.5", "--api-key", "k")
    assert (cfg.max_concurrency, cfg.cors, cfg.temperature, cfg.api_key) == (4, "*", 0.5, "k")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--max-concurrency", "0"), "--max-concurrency"),
        (("--max-concurrency", "65"), "--max-concurrency"),
        (("--max-concurrency", "two"), "--max-concurrency"),
        (("--port", "70000"), "--port"),
        (("--dtype", "float16"), "--dtype"),
        (("--temperature", "nan"), "--temperature"),
        (("--pending-timeout-ms", "0"), "--pending-timeout-ms"),
        (("--max-request-mib", "-1"), "--max-request-mib"),
        (("--kv-dtype", "float16", "--dtype", "bfloat16"), "--kv-dtype"),
        (("--kv-dtype", "float32", "--dtype", "bfloat16"), "--kv-dtype"),
    ],
)
def test_bad_values_name_the_flag(argv: tuple[str, ...], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        _parse(*argv)


def test_environment_and_toml(tmp_path: Path) -> None:
    toml = tmp_path / "ninfer.toml"
    toml.write_text('max_pending_requests = 3\nmodel-id = "m"\ngreedy = true\n')
    cfg = config_from_env({"NINFER_CONFIG": str(toml), "NINFER_MAX_PENDING_REQUESTS": "5"})
    assert (cfg.max_pending_requests, cfg.model_id, cfg.greedy) == (5, "m", True)
    with pytest.raises(ConfigError, match="NINFER_MAX_CONCURRENCY"):
        config_from_env({"NINFER_MAX_CONCURRENCY": "lots"})
    bad = tmp_path / "bad.toml"
    bad.write_text("max_widgets = 1\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        config_from_env({"NINFER_CONFIG": str(bad)})


def test_serve_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for s in SETTINGS:
        assert s.flag in text
    assert "(default: 8)" in text
    flat = " ".join(text.split())
    assert "(default: 1.0) (default" not in flat  # each default said once
    assert "one of float32, bfloat16" in flat
    assert "one of int4, dense" in flat


def test_unopenable_log_stops_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "serve",
            "--model",
            str(tmp_path / "x.gguf"),
            "--request-log-jsonl",
            "/nonexistent/dir/log",
            "--port",  # any free one: the default (8080) fails when a server runs there
            "0",
        ]
    )
    assert code == 2
    assert "error" in capsys.readouterr().err


def test_flags_are_never_abbreviated() -> None:
    """`--api SECRET` must not be taken for --api-key (it was, and was then logged)."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--api", "SECRET"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "http://127.0.0.1:1", "--cli", "2"])


def test_the_api_key_from_env_or_file_never_empty_and_redacted_by_value(
    tmp_path: Path,
) -> None:
    serve_args = build_parser().parse_args(["serve"])
    assert config_from_namespace(serve_args, {"NINFER_API_KEY": "from-env"}).api_key == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("  from-file \n")
    with_file = build_parser().parse_args(["serve", "--api-key-file", str(key_file)])
    assert config_from_namespace(with_file, {}).api_key == "from-file"
    both = build_parser().parse_args(["serve", "--api-key-file", str(key_file), "--api-key", "k"])
    with pytest.raises(ConfigError, match="give one of them"):
        config_from_namespace(both, {})
    for empty in ("", "   "):
        with pytest.raises(ConfigError, match="must not be empty"):
            config_from_namespace(build_parser().parse_args(["serve", "--api-key", empty]), {})
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="must not be empty"):
        config_from_namespace(with_file, {})
    argv = ["ninfer", "serve", "--api-key=s3cret", "--model-id", "x-s3cret-y"]
    assert "s3cret" not in " ".join(redacted_argv(argv, "s3cret"))


def test_served_model_names_from_flags_env_and_toml(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--served-model-name", "smollm2", "gpt-4o-mini"])
    assert config_from_namespace(ns).served_model_name == ("smollm2", "gpt-4o-mini")
    env = config_from_env({"NINFER_SERVED_MODEL_NAME": "a, b"})
    assert env.served_model_name == ("a", "b")
    toml = tmp_path / "c.toml"
    toml.write_text('served-model-name = ["x", "y"]\n')
    assert config_from_env({"NINFER_CONFIG": str(toml)}).served_model_name == ("x", "y")
    assert build_config({"model_id": "m"}).served_model_name == ("m",)
    with pytest.raises(ConfigError, match="give one of them"):
        build_config({"model_id": "m", "served_model_name": ["n"]})
    with pytest.raises(ConfigError, match="non-empty"):
        build_config({"served_model_name": "a,,b"})


def test_one_rule_for_flags_variables_and_the_file(tmp_path: Path) -> None:
    """`ninfer serve` reads NINFER_ variables and NINFER_CONFIG's file as hypercorn does:
    flags over variables over the file (before, it ignored both); a bad value names the
    variable or key that carried it; an unknown NINFER_ name is refused with the
    closest known one (a misspelt one was silently ignored)."""
    toml = tmp_path / "ninfer.toml"
    toml.write_text("max-concurrency = 2\nmax_pending_requests = 7\n")

    def config(argv: list[str], env: dict[str, str]) -> Any:
        return config_from_namespace(build_parser().parse_args(["serve", *argv]), env)

    env = {"NINFER_CONFIG": str(toml)}
    assert (config([], env).max_concurrency, config([], env).max_pending_requests) == (2, 7)
    env["NINFER_MAX_CONCURRENCY"] = "3"
    assert config([], env).max_concurrency == 3
    assert config(["--max-concurrency", "5"], env).max_concurrency == 5
    assert config(["--greedy"], {"NINFER_GREEDY": "0"}).greedy is True
    assert config([], {"NINFER_GREEDY": "1"}).greedy is True
    for bad, named in (
        ({"NINFER_MAX_CONCURRENCY": "abc"}, "NINFER_MAX_CONCURRENCY must be an integer"),
        ({"NINFER_DEVICE": "gpu"}, "NINFER_DEVICE must be one of"),
        ({"NINFER_MAX_CONCURENCY": "4"},
         "unknown environment variable NINFER_MAX_CONCURENCY; did you mean "
         "NINFER_MAX_CONCURRENCY?"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=named):
            config([], bad)
    toml.write_text("max-concurrency = 'two'\n")
    with pytest.raises(ConfigError, match=f"'max-concurrency' in {toml}"):
        config([], {"NINFER_CONFIG": str(toml)})
    with pytest.raises(ConfigError, match="--device must be one of"):
        config(["--device", "gpu"], {})


def test_a_misspelt_flag_is_told_the_one_it_meant(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-concurency", "4"])
    assert "did you mean --max-concurrency?" in capsys.readouterr().err


def test_trusted_proxies_are_addresses_or_networks() -> None:
    """--trusted-proxies takes addresses and CIDR networks (flag, variable or file) and
    refuses anything else by name."""
    config = build_config({"trusted_proxies": ("127.0.0.1", "10.0.0.0/8", "::1")})
    assert config.trusted_proxies == ("127.0.0.1", "10.0.0.0/8", "::1")
    with pytest.raises(ConfigError, match="'nginx' is not an address or a network"):
        build_config({"trusted_proxies": ("nginx",)}, {"trusted_proxies": "NINFER_TRUSTED_PROXIES"})


@pytest.mark.parametrize(
    ("peer", "forwarded", "trusted", "client"),
    [
        ("192.0.2.7", None, (), "192.0.2.7"),  # no proxy: the peer
        ("192.0.2.7", "198.51.100.1", (), "192.0.2.7"),  # an untrusted peer's header: no
        ("127.0.0.1", "198.51.100.1", ("127.0.0.1",), "198.51.100.1"),  # nginx's
        # a client that wrote its own header before the trusted proxy added its address
        ("127.0.0.1", "203.0.113.9, 198.51.100.1", ("127.0.0.1",), "198.51.100.1"),
        # two trusted proxies: the last address that is none of them
        ("10.0.0.2", "198.51.100.1, 10.0.0.1", ("10.0.0.0/8",), "198.51.100.1"),
        ("127.0.0.1", "not-an-address", ("127.0.0.1",), "127.0.0.1"),  # malformed: the peer
        ("127.0.0.1", None, ("127.0.0.1",), "127.0.0.1"),  # no header: the proxy itself
        ("::1", "2001:db8::5", ("::1",), "2001:db8::5"),
    ],
)
def test_a_client_is_known_by_its_address_or_a_trusted_proxys_word(
    peer: str, forwarded: str | None, trusted: tuple[str, ...], client: str
) -> None:
    """Who the scheduler holds to a promise (docs/scheduler.md, "Clients"): the peer's
    address, or, from a trusted proxy, the last X-Forwarded-For address that is not a
    trusted proxy's."""
    from ninfer._http import client_address, trusted_networks

    headers = [(b"x-forwarded-for", forwarded.encode())] if forwarded else []
    scope: Any = {"client": (peer, 40000), "headers": headers}
    assert client_address(scope, trusted_networks(trusted)) == client
    assert client_address({"client": None, "headers": []}, ()) is None  # type: ignore[typeddict-item]
