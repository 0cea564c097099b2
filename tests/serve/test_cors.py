"""Cross-origin requests (``llmc serve --allowed-origins``): preflights answered without the API key, every answer
to an allowed origin readable by its page (streams and errors too), other origins and servers without the flag
refused with the fix, and the flag's bad values named."""

from __future__ import annotations

import json
import urllib.request

import pytest
from click.testing import CliRunner

from llmc.cli import cli
from llmc.serve.cors import parse_origins
from tests.serve.conftest import _send, start_server

APP = "http://localhost:3000"


def options(server, path: str, origin: str, headers: str | None = None) -> tuple[int, dict]:
    asked = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    if headers is not None:
        asked["Access-Control-Request-Headers"] = headers
    got: dict = {}
    status, _ = _send(urllib.request.Request(server.http + path, method="OPTIONS", headers=asked), got)
    return status, got


@pytest.fixture(scope="module")
def cors_server(serve_tiny_build):
    server = start_server(serve_tiny_build, api_key="s3cret", allowed_origins=(APP, "https://ui.example"))
    yield server
    server.close()


def test_a_preflight_from_an_allowed_origin_needs_no_key(cors_server):
    status, headers = options(cors_server, "/v1/chat/completions", APP, "authorization, content-type")
    assert status == 204 and headers["Access-Control-Allow-Origin"] == APP
    assert "POST" in headers["Access-Control-Allow-Methods"] and headers["Vary"] == "Origin"
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert int(headers["Access-Control-Max-Age"]) > 0


def test_answers_to_an_allowed_origin_are_readable_errors_and_streams_too(cors_server):
    key = {"Authorization": "Bearer s3cret", "Origin": APP}
    got: dict = {}
    status, body = cors_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key, reply_headers=got)
    assert status == 200 and body["choices"] and got["Access-Control-Allow-Origin"] == APP
    got = {}
    status, body = cors_server.post("/v1/completions", {"prompt": "Hi"}, {"Origin": APP}, reply_headers=got)
    assert status == 401 and got["Access-Control-Allow-Origin"] == APP  # the page can read why
    request = urllib.request.Request(cors_server.http + "/v1/chat/completions", method="POST", headers={
        **key, "Content-Type": "application/json"}, data=json.dumps(
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.headers["Access-Control-Allow-Origin"] == APP and b"[DONE]" in reply.read()
    got = {}
    assert cors_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                            {"Authorization": "Bearer s3cret"}, reply_headers=got)[0] == 200
    assert "Access-Control-Allow-Origin" not in got  # no Origin: no CORS headers


def test_other_origins_are_refused_with_the_fix(cors_server, tiny_server):
    status, headers = options(cors_server, "/v1/models", "http://evil.example")
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    got: dict = {}
    status, body = cors_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                                    {"Authorization": "Bearer s3cret", "Origin": "http://evil.example"},
                                    reply_headers=got)
    assert status == 200 and "Access-Control-Allow-Origin" not in got  # answered, but not readable by that page
    status, body = _send(urllib.request.Request(tiny_server.http + "/v1/models", method="OPTIONS", headers={
        "Origin": APP, "Access-Control-Request-Method": "GET"}))
    assert status == 403 and "start llmc serve with --allowed-origins http://localhost:3000" in body["error"]


def test_any_origin(serve_tiny_build):
    server = start_server(serve_tiny_build, allowed_origins=("*",))
    try:
        status, headers = options(server, "/v2/models/ensemble/generate", "http://anything.example:8080")
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://anything.example:8080"
    finally:
        server.close()


def test_the_flags_values():
    assert parse_origins(None) == () and parse_origins("*") == ("*",)
    assert parse_origins(" http://localhost:3000/ , https://ui.example") == (APP, "https://ui.example")
    for bad in ("localhost:3000", "http://x/app", "ftp://x"):
        with pytest.raises(ValueError, match="is not an origin; write scheme://host"):
            parse_origins(bad)
    result = CliRunner().invoke(cli, ["serve", ".", "--allowed-origins", "localhost:3000"])
    assert result.exit_code == 2 and "'localhost:3000' is not an origin" in result.output


def test_a_preflight_sends_each_cors_header_once(cors_server):
    import http.client
    from urllib.parse import urlparse

    url = urlparse(cors_server.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("OPTIONS", "/v1/responses", headers={"Origin": APP, "Access-Control-Request-Method": "POST"})
    reply = conn.getresponse()
    names = [name.lower() for name, _ in reply.getheaders()]
    conn.close()
    assert reply.status == 204 and names.count("access-control-allow-origin") == 1 and names.count("vary") == 1
