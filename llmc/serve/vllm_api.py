"""vLLM's utility routes, which clients written against vLLM call besides the OpenAI ones.

- ``GET /health``: 200 (no body) while the server takes requests, 503 once it drains. guidellm checks it before a
  benchmark (and stops without it); load balancers and Kubernetes probes poll it. No API key, as the KServe health.
- ``GET /version``: ``{"version": ...}``, llmc's.
- ``POST /tokenize``: the token ids a request would run on. ``prompt`` (text) as ``/v1/completions`` tokenizes it
  (the recipe's ``add_special_tokens`` unless the body sets it); ``messages`` (with ``tools`` and
  ``chat_template_kwargs``) as ``/v1/chat/completions`` renders them, the assistant's opening included unless
  ``add_generation_prompt`` is false; ``continue_final_message`` leaves the last (assistant) message open, as a
  prefill is rendered (Anthropic's Messages API). A prompt over ``max_input_len`` is counted too: clients trim
  conversations by this count, against the answer's ``max_model_len``. ``return_token_strs`` adds the tokens' strings.
- ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens kept).

Errors are OpenAI's error object, as vLLM's; none of these counts as a request in ``/metrics``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmc import __version__
from llmc.errors import RequestError, short_repr
from llmc.request.inputs import ChatPrompt, check_token_ids
from llmc.request.params import SamplingParams
from llmc.serve.engine_client import ServerDrainingError
from llmc.serve.openai_protocol import check_model, flag, parse_openai_request
from llmc.serve.state import STATE_KEY, read_json

TEXT_FIELDS = ("model", "prompt", "add_special_tokens", "return_token_strs")
CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
               "return_token_strs", "tools", "chat_template_kwargs")


@dataclass(frozen=True)
class TokenizeRequest:
    """A parsed ``/tokenize`` body: the prompt as the engine takes it (text or a :class:`ChatPrompt`), the text's
    ``add_special_tokens`` (None: the recipe's) and whether the tokens' strings are wanted."""

    prompt: str | ChatPrompt
    add_special_tokens: bool | None = None
    token_strs: bool = False


def parse_tokenize(body: Mapping[str, Any], served: tuple[str, ...], defaults: SamplingParams,
                   vocab_size: int | None = None) -> TokenizeRequest:
    """Check a ``/tokenize`` body (vLLM's two shapes: ``prompt`` or ``messages``); RequestError naming the field.
    Messages go through the chat route's own parser, so their ids are the ones a chat request runs on."""
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("prompt", 'send either "prompt" (text, tokenized as /v1/completions does) or "messages" '
                                     '(rendered as /v1/chat/completions does)')
    chat = "messages" in body
    accepted = CHAT_FIELDS if chat else TEXT_FIELDS
    for key in body:
        if key not in accepted:
            with_other = key in CHAT_FIELDS + TEXT_FIELDS
            hint = f"goes with {'prompt' if chat else 'messages'}" if with_other else "unknown field"
            raise RequestError(key, f"{hint}; /tokenize with {'messages' if chat else 'prompt'} takes "
                                    f"{', '.join(accepted)}")
    special, strs = flag(body, "add_special_tokens", None), flag(body, "return_token_strs")
    if not chat:
        check_model(body, served)
        if not isinstance(body["prompt"], str) or not body["prompt"]:
            raise RequestError("prompt", f"must be a non-empty string, got {short_repr(body['prompt'])}")
        return TokenizeRequest(body["prompt"], special, strs)
    if special:
        raise RequestError("add_special_tokens", "is for prompt; a chat template writes its own special tokens, so "
                                                 "none are added to messages (send false or leave it out)")
    keys = ("model", "messages", "tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")
    fields = {k: body[k] for k in keys if k in body}
    if body.get("tools"):
        fields["tool_choice"] = "required"  # the tools are in the prompt for every tool_choice but "none"
    prompt = parse_openai_request(fields, True, served, defaults, vocab_size).prompt
    return TokenizeRequest(prompt if isinstance(prompt, ChatPrompt) else ChatPrompt(tuple(prompt)), None, strs)


def parse_detokenize(body: Mapping[str, Any], served: tuple[str, ...], vocab_size: int) -> list[int]:
    """The ids of a ``/detokenize`` body (``model``, ``tokens``); RequestError naming the field."""
    for key in body:
        if key not in ("model", "tokens"):
            raise RequestError(key, "unknown field; /detokenize takes model, tokens")
    check_model(body, served)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RequestError("tokens", f"must be a list of token ids, got {short_repr(tokens)}")
    check_token_ids(tokens, vocab_size, "tokens")
    return tokens


# ------------------------------------------------------------------------------------------------ routes
async def health(request: web.Request) -> web.Response:
    if request.app[STATE_KEY].client.draining:
        raise ServerDrainingError()
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = parse_tokenize(await read_json(request), state.request_names(), state.defaults,
                         state.vocab_size)
    ids = list(await state.client.count(req.prompt, req.add_special_tokens))
    strs = state.client.engine.tokenizer.convert_ids_to_tokens(ids) if req.token_strs else None
    return web.json_response({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                              "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    ids = parse_detokenize(await read_json(request), state.request_names(), state.vocab_size)
    text = await asyncio.to_thread(state.client.engine.tokenizer.decode, ids)
    return web.json_response({"prompt": text})


def add_vllm_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
