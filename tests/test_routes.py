"""The route table: made of the server's own routes and every frontend's declared
ones, before the model loads; the contract document lists exactly these; paths
without `/v1`, path parameters, and the dialect of a path no route has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from fakeengine import FakeEngine
from server import serve_app

from ninfer._app import App, Route, RouteTable
from ninfer._config import build_config
from ninfer.frontends import FRONTENDS, FrontendRoute, Look, PathArgs, Routed
from protocols import NativeDialect, OpenAIDialect, openapi_document

MODEL = "org/tiny-model"  # a served name with a slash: /v1/models/{model} takes the rest


def _app(tmp_path: Path) -> App:
    values = {"model": "fake", "request_log_jsonl": str(tmp_path / "requests.jsonl")}
    return App(build_config(values), argv=["test"], engine=FakeEngine())


def test_the_contract_lists_exactly_the_routes_served(tmp_path: Path) -> None:
    """Built before any model loads, from FRONTENDS' declarations and the app's own."""
    app = _app(tmp_path)
    served = {path: sorted(m.lower() for m in r.methods) for path, r in app.routes.routes.items()}
    paths = openapi_document("0")["paths"]
    documented = {p: sorted(m for m in ops if m in ("get", "post", "delete"))
                  for p, ops in paths.items()}  # fmt: skip
    assert served == documented
    declared = {r.path for cls in FRONTENDS for r in cls.routes()}
    assert declared <= set(served)


def test_a_route_is_declared_once(tmp_path: Path) -> None:
    table = RouteTable(NativeDialect())
    route = Route({}, NativeDialect())
    table.add("/v1/x", route)
    with pytest.raises(ValueError, match="two routes"):
        table.add("/v1/x", route)


def test_paths_resolve_to_their_templates(tmp_path: Path) -> None:
    resolve = _app(tmp_path).routes.resolve
    assert resolve("/v1/responses/input_tokens")[0] == "/v1/responses/input_tokens"
    label, _route, _dialect, params = resolve("/v1/responses/resp_1/input_items")
    assert (label, params) == ("/v1/responses/{response_id}/input_items", {"response_id": "resp_1"})
    label, _route, _dialect, params = resolve("/models/org/tiny-model")  # unversioned alias
    assert (label, params) == ("/v1/models/{model}", {"model": "org/tiny-model"})
    assert resolve("/chat/completions")[0] == "/v1/chat/completions"
    assert resolve("/generate")[0] == "unmatched"  # the native protocol is versioned only
    assert resolve("/v1/responses/")[0] == "unmatched"  # an empty id is no id
    assert resolve("/v1/chat/completions/")[0] == "unmatched"
    # Unmatched paths speak the dialect of the routes about the same thing.
    assert resolve("/v1/messages/batches")[2].name == "anthropic"
    assert resolve("/v1/chat/nothing")[2].name == "openai"
    assert resolve("/responses/a/b/c")[2].name == "openai"
    assert resolve("/v1/nothing")[2].name == "native"


async def test_a_frontends_routes_are_served_in_its_dialect(tmp_path: Path) -> None:
    names = [MODEL, "alias"]
    async with serve_app(tmp_path, served_model_name=names) as srv, srv.client() as c:
        listing = await c.get("/models")  # the unversioned alias of /v1/models
        assert listing.status_code == 200
        # One card a model (llama-server's shape): the other names are its aliases.
        (entry,) = listing.json()["data"]
        assert (entry["id"], entry["aliases"]) == (MODEL, ["alias"])
        assert entry["meta"]["n_ctx"] == entry["meta"]["n_ctx_train"] == 512
        assert entry["meta"]["n_vocab"] == 256
        # The OpenAI SDK's reader takes it (Open WebUI reads `data[].id`, as here).
        assert openai.types.Model.model_validate(entry).id == MODEL
        card = await c.get("/v1/models/" + MODEL)
        assert (card.status_code, card.json()["id"]) == (200, MODEL)
        by_alias = (await c.get("/v1/models/alias")).json()
        assert (by_alias["id"], by_alias["aliases"]) == ("alias", [MODEL])
        missing = await c.get("/v1/models/org/other")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        wrong = await c.get("/v1/responses/resp_1/cancel")
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
        nowhere = await c.post("/v1/messages/batches", json={})
        assert nowhere.status_code == 404
        assert nowhere.json()["type"] == "error"  # Anthropic's envelope


class _Echo(Routed):
    """A protocol added as one class: its route is served with no other change."""

    dialect = OpenAIDialect()

    @classmethod
    def routes(cls) -> tuple[FrontendRoute, ...]:
        return (FrontendRoute("/v1/echo/{word}", {"GET": Look(cls.echo)}),)

    def echo(self, call: PathArgs) -> bytes:
        return orjson.dumps({"word": call.params["word"], "model": self.ctx.public_id})


async def test_a_new_frontend_is_one_class_and_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ninfer._app
    import ninfer._lifespan

    added: Any = (*FRONTENDS, _Echo)
    monkeypatch.setattr(ninfer._app, "FRONTENDS", added)
    monkeypatch.setattr(ninfer._lifespan, "FRONTENDS", added)
    async with serve_app(tmp_path, served_model_name=["m"]) as srv, srv.client() as c:
        answer = await c.get("/v1/echo/hello")
    assert (answer.status_code, answer.json()) == (200, {"word": "hello", "model": "m"})
