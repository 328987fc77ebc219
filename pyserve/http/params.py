"""Turning validated request bodies into the pipeline's Sampling and Grammar, and the checks
of fields accepted for some values only."""

from __future__ import annotations

import msgspec

from pyserve.http.errors import APIError, bad_request
from pyserve.http.generation import Sampling
from pyserve.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateSamplingParams,
    GrammarFields,
    ImagePart,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    RefusalPart,
    ResponseFormat,
    SamplingFields,
    TextFormat,
    TextPart,
    Unsupported,
)
from pyserve.wire.main_to_worker import Grammar

_UNSUPPORTED: dict[type, list[str]] = {}


def unsupported(name: str, why: str = "") -> APIError:
    message = f"{name} is not supported by this server" + (f": {why}" if why else "")
    return bad_request(message, param=name, code="unsupported_parameter")


def refuse_unsupported(req: msgspec.Struct) -> None:
    """A 400 for the first OpenAI field that pyserve declares but does not implement."""
    names = _UNSUPPORTED.get(type(req))
    if names is None:
        fields = msgspec.structs.fields(type(req))
        names = _UNSUPPORTED[type(req)] = [f.name for f in fields if f.type == Unsupported]
    for name in names:
        if getattr(req, name) is not None:
            raise unsupported(name)


def check_chat_request(req: ChatCompletionRequest) -> None:
    """The chat fields that are accepted for some values only."""
    refuse_unsupported(req)
    for i, message in enumerate(req.messages):
        refuse_unsupported(message)
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if not isinstance(part, TextPart | RefusalPart | ImagePart):  # images: chat_images
                kind = part.__struct_config__.tag
                raise unsupported(
                    f"messages[{i}].content[{j}]", f"{kind} content: this server takes none"
                )
    if req.modalities is not None and set(req.modalities) != {"text"}:
        raise unsupported("modalities", "text output only")
    if req.service_tier not in (None, "auto", "default"):
        raise unsupported("service_tier", 'there is one tier: "auto" or "default"')


def request_grammar(
    fields: GrammarFields, response_format: ResponseFormat | None
) -> tuple[Grammar | None, str]:
    """The one constraint a request asks for, from ``response_format`` or SGLang's fields, and
    the name of the field it came from (for errors; "grammar" when there is none)."""
    given = [name for name in ("json_schema", "regex", "ebnf") if getattr(fields, name)]
    if response_format is not None and not isinstance(response_format, TextFormat):
        given.insert(0, "response_format")
    if len(given) > 1:
        raise bad_request(
            f"{' and '.join(given)} both constrain the output: give at most one", param=given[1]
        )
    return _grammar(fields, response_format), given[0] if given else "grammar"


def _grammar(fields: GrammarFields, response_format: ResponseFormat | None) -> Grammar | None:
    if isinstance(response_format, JsonObjectFormat):
        return Grammar("json_object")
    if isinstance(response_format, JsonSchemaResponseFormat):
        schema = response_format.json_schema.schema
        if schema is None:
            return Grammar("json_object")
        return Grammar("json_schema", msgspec.json.encode(schema).decode())
    if fields.json_schema is not None:
        schema = fields.json_schema
        text = schema if isinstance(schema, str) else msgspec.json.encode(schema).decode()
        return Grammar("json_schema", text)
    if fields.regex is not None:
        return Grammar("regex", fields.regex)
    if fields.ebnf is not None:
        return Grammar("ebnf", fields.ebnf)
    return None


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _or(value, default):
    return default if value is None else value


def openai_sampling(req: SamplingFields, top_logprobs: int | None) -> Sampling:
    """The sampling of an OpenAI request (chat or legacy completions): unset fields take the
    engine's defaults. ``top_logprobs``: None when logprobs were not asked for, else the
    alternatives per token."""
    return Sampling(
        temperature=_or(req.temperature, 1.0),
        top_p=_or(req.top_p, 1.0),
        top_k=_or(req.top_k, 0),
        min_p=_or(req.min_p, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        presence_penalty=_or(req.presence_penalty, 0.0),
        seed=req.seed,
        stop=_stop_list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logit_bias=dict(req.logit_bias or {}),
        top_logprobs=top_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    """``max_completion_tokens`` (the current name) wins over ``max_tokens`` (deprecated)."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def chat_top_logprobs(req: ChatCompletionRequest) -> int | None:
    if not req.logprobs:
        if req.top_logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        return None
    return req.top_logprobs or 0


def check_completion_request(req: CompletionRequest) -> None:
    """The legacy fields pyserve does not implement are refused rather than ignored."""
    if req.suffix:
        raise unsupported("suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (or be omitted)", param="best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request(
            "echo together with logprobs needs prompt logprobs, which pyserve does not compute",
            param="echo",
        )


def generate_sampling(params: GenerateSamplingParams, top_logprobs: int | None) -> Sampling:
    """The sampling of SGLang's ``sampling_params``."""
    return Sampling(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        seed=params.seed,
        stop=_stop_list(params.stop),
        stop_token_ids=list(params.stop_token_ids or []),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_new_tokens,
        logit_bias=dict(params.logit_bias or {}),
        top_logprobs=top_logprobs,
        skip_special_tokens=params.skip_special_tokens,
    )
