"""Sampling defaults in layers, as the seed orders them: the model file's preset, under
the process flags, under the request's fields, and --greedy over everything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from server import serve
from tinymodel import write_tiny_gguf

from ninfer._config import build_config
from ninfer.engine import SamplingPreset
from ninfer.engine._loader import sampling_preset
from ninfer.frontends._sampling import SamplingRequest, resolve_sampling, sampling_defaults

PRESET = SamplingPreset(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, source="test")
FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")


def _params(req: SamplingRequest, preset: SamplingPreset = PRESET, **flags: Any) -> Any:
    params, _warnings = resolve_sampling(req, build_config(flags), preset)
    return params


def test_each_field_takes_the_first_layer_that_names_it() -> None:
    # nothing set anywhere: the built-in defaults (llama-server's chain)
    bare = _params(SamplingRequest(), SamplingPreset())
    assert [getattr(bare, f) for f in FIELDS] == [0.8, 0.95, 40, 0.05, 0.0, 0.0]
    # the model's preset over the built-ins
    model = _params(SamplingRequest())
    assert [getattr(model, f) for f in FIELDS] == [0.6, 0.95, 20, 0.05, 0.0, 0.0]
    # process flags over the preset, field by field
    flagged = _params(SamplingRequest(), temperature=0.8, min_p=0.1, presence_penalty=1.5,
                      frequency_penalty=-0.5)  # fmt: skip
    assert [getattr(flagged, f) for f in FIELDS] == [0.8, 0.95, 20, 0.1, 1.5, -0.5]
    # the request over the flags
    asked = _params(
        SamplingRequest(temperature=0.3, top_k=5, presence_penalty=0.0), temperature=0.8,
        top_k=40, presence_penalty=1.5, frequency_penalty=0.25,
    )  # fmt: skip
    assert [getattr(asked, f) for f in FIELDS] == [0.3, 0.95, 5, 0.05, 0.0, 0.25]


def test_greedy_comes_last() -> None:
    params, warnings = resolve_sampling(
        SamplingRequest(temperature=0.9), build_config({"greedy": True, "temperature": 0.7}),
        PRESET,
    )  # fmt: skip
    assert params.temperature == 0.0
    assert warnings == ["temperature is ignored: the server forces greedy decoding"]
    assert sampling_defaults(build_config({"greedy": True}), PRESET)["temperature"] == 0.0


def test_a_chain_left_to_the_defaults_runs_in_llama_servers_order() -> None:
    """A request naming none of the filters (temperature, top-k, top-p, min-p) runs the
    defaults' chain as llama-server runs it (the filters before the temperature), from
    whichever layer its values came; naming any one of them gives ninfer's (vLLM's)
    order; a `samplers` list decides for itself. A penalty or seed is not a filter."""
    from ninfer.engine._contract import DEFAULT_ORDER, LLAMA_ORDER

    llama = ("top_k", "top_p", "min_p", "temperature")
    assert llama == LLAMA_ORDER
    assert _params(SamplingRequest(), SamplingPreset()).order == llama
    assert _params(SamplingRequest()).order == llama  # the model's preset
    assert _params(SamplingRequest(), temperature=0.7, top_p=0.8).order == llama  # flags
    assert _params(SamplingRequest(seed=3, presence_penalty=0.5)).order == llama
    for field, value in (("temperature", 0.8), ("top_k", 40), ("top_p", 0.95), ("min_p", 0.05)):
        assert _params(SamplingRequest(**{field: value})).order == DEFAULT_ORDER, field
    reordered = SamplingRequest(samplers=("top_k", "temperature", "min_p", "top_p"))
    assert _params(reordered).order == DEFAULT_ORDER


def test_the_preset_is_read_from_the_files_general_sampling_keys() -> None:
    told: list[str] = []
    preset = sampling_preset(
        {"general.sampling.temp": 0.7, "general.sampling.top_k": 40,
         "general.sampling.top_p": 7.0,  # outside what a request may send: not used
         "general.sampling.min_p": "0.1",  # not a number: not used
         "general.sampling.penalty_repeat": 1.1},  # another kind of penalty: not read
        told.append,
    )  # fmt: skip
    assert preset == SamplingPreset(temperature=0.7, top_k=40, source="gguf general.sampling")
    assert told == [
        "general.sampling.top_p = 7.0 is not used: not a number in 0.0..1.0",
        "general.sampling.min_p = '0.1' is not used: not a number in 0.0..1.0",
    ]
    assert sampling_preset({}) == SamplingPreset()
    assert sampling_preset({"general.sampling.top_k": True}) == SamplingPreset()


@pytest.fixture(scope="module")
def preset_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("preset") / "preset.gguf"
    return write_tiny_gguf(path, sampling={"temp": 0.5, "top_k": 7, "top_p": 0.75})


async def test_a_server_uses_the_layers_and_says_so(preset_gguf: Path, tmp_path: Path) -> None:
    """End to end: what /props reports, what server_start records layer by layer, and
    what each request was given (its request_start), with the model's preset, process
    flags and request fields all in play."""
    async with serve(preset_gguf, tmp_path, top_p=0.5, min_p=0.02, presence_penalty=0.4,
                     frequency_penalty=0.1, seed=11) as srv:  # fmt: skip
        async with srv.client() as c:
            props = (await c.get("/props")).json()
            bare = await c.post("/v1/generate", json={"prompt": "hi", "max_new_tokens": 2})
            told = await c.post(
                "/v1/chat/completions",
                json={"model": srv.app.lifespan.public_id, "max_tokens": 2, "temperature": 0.9,
                      "presence_penalty": -1.0, "messages": [{"role": "user", "content": "hi"}]},
            )  # fmt: skip
        assert bare.status_code == told.status_code == 200
        records = srv.log_records()
    resolved = {"temperature": 0.5, "top_p": 0.5, "top_k": 7, "min_p": 0.02,
                "presence_penalty": 0.4, "frequency_penalty": 0.1}  # fmt: skip
    params = props["default_generation_settings"]["params"]
    assert {f: params[f] for f in FIELDS} == resolved
    assert params["seed"] == 11
    assert "samplers" not in params  # (llama.cpp's web UI: _sampling.py)
    (start,) = [r for r in records if r["event"] == "server_start"]
    layers = start["sampling_defaults"]
    assert layers["model"] == {"source": "gguf general.sampling", "temperature": 0.5,
                               "top_p": 0.75, "top_k": 7}  # fmt: skip
    assert layers["process"] == {"top_p": 0.5, "min_p": 0.02, "presence_penalty": 0.4,
                                 "frequency_penalty": 0.1}  # fmt: skip
    assert (layers["greedy"], layers["seed"]) == (False, 11)
    assert layers["resolved"] == resolved
    first, second = [r["sampling"] for r in records if r["event"] == "request_start"]
    assert {f: first[f] for f in FIELDS} == resolved
    # the bare request ran the chain in llama-server's order, the one naming a
    # temperature in ninfer's
    assert first["order"] == ["top_k", "top_p", "min_p", "temperature"]
    assert second["order"] == ["temperature", "top_k", "min_p", "top_p"]
    assert {f: second[f] for f in FIELDS} == {
        **resolved,
        "temperature": 0.9,
        "presence_penalty": -1.0,
    }


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"min_p": 1.5}, "--min-p must be at most 1, got 1.5"),
        ({"presence_penalty": 2.5}, "--presence-penalty must be at most 2"),
        ({"frequency_penalty": -3}, "--frequency-penalty must be at least -2"),
    ],
)
def test_the_flags_are_checked_like_every_setting(bad: dict[str, float], said: str) -> None:
    from ninfer._config import ConfigError

    with pytest.raises(ConfigError, match=said):
        build_config(bad)
