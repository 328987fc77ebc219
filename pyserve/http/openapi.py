"""``/openapi.json``: the API document, generated from the msgspec request types."""

from __future__ import annotations

import msgspec

from pyserve.http.anthropic_protocol import CountTokensRequest, MessagesRequest
from pyserve.http.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    GenerateRequest,
    RerankRequest,
    TokenizeRequest,
)
from pyserve.http.responses_protocol import ResponsesRequest

# (method, path, request body type, summary) of every route
ROUTES: list[tuple[str, str, type | None, str]] = [
    ("post", "/v1/chat/completions", ChatCompletionRequest, "OpenAI chat completion"),
    ("post", "/v1/completions", CompletionRequest, "OpenAI legacy completion"),
    ("get", "/v1/models", None, "The served model"),
    ("post", "/v1/messages", MessagesRequest, "Anthropic Messages API"),
    ("post", "/v1/messages/count_tokens", CountTokensRequest, "Anthropic token count"),
    ("post", "/v1/responses", ResponsesRequest, "OpenAI Responses API"),
    ("get", "/v1/responses/{id}", None, "A stored response"),
    ("delete", "/v1/responses/{id}", None, "Delete a stored response"),
    ("get", "/v1/responses/{id}/input_items", None, "A stored response's input items"),
    ("post", "/v1/responses/{id}/cancel", None, "Refused: background responses are not served"),
    ("post", "/v1/embeddings", EmbeddingRequest, "OpenAI embeddings"),
    ("post", "/v1/rerank", RerankRequest, "Rerank documents (Jina/Cohere shape)"),
    ("post", "/rerank", RerankRequest, "Rerank documents (Jina/Cohere shape)"),
    ("post", "/generate", GenerateRequest, "SGLang-style native generation"),
    ("post", "/tokenize", TokenizeRequest, "Text to token ids"),
    ("post", "/detokenize", DetokenizeRequest, "Token ids to text"),
    ("post", "/abort_request", AbortRequest, "Abort a request by its id"),
    ("post", "/flush_cache", None, "Drop every cached prefix not in use"),
    ("get", "/health", None, "200 when ready; 503 while loading, shutting down or broken"),
    ("get", "/health_generate", None, "200 once the engine generates a token; 503 otherwise"),
    ("get", "/server_info", None, "Configuration, KV pool and versions"),
    ("get", "/get_server_info", None, "/server_info under SGLang's older name"),
    ("get", "/model_info", None, "Model path, tokenizer path and type (SGLang's fields)"),
    ("get", "/get_model_info", None, "/model_info under SGLang's older name"),
    ("get", "/get_load", None, "Requests and KV tokens in use (SGLang's shape)"),
    ("get", "/metrics", None, "Prometheus metrics"),
    ("get", "/stats", None, "Per-second samples of the server's counters (the dashboard's)"),
    ("get", "/openapi.json", None, "This document"),
]

_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}


def openapi_document(version: str) -> dict:
    body_types = [t for _, _, t, _ in ROUTES if t is not None]
    schemas, components = msgspec.json.schema_components(
        body_types, ref_template="#/components/schemas/{name}"
    )
    schema_of = dict(zip(body_types, schemas, strict=True))
    components["Error"] = _ERROR_SCHEMA
    error = {
        "description": "Error",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    paths: dict[str, dict] = {}
    for method, path, body_type, summary in ROUTES:
        operation: dict = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        if body_type is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schema_of[body_type]}},
            }
            operation["responses"]["400"] = error
        paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "pyserve", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
