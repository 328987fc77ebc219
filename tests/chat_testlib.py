"""A parsed chat output written as OpenAI writes it, whole and streamed, without a server: what
the pipeline does with one choice's text (pyserve.http.pipeline)."""

from __future__ import annotations

import msgspec

from pyserve.chat.output import ChatOutput
from pyserve.http.openai_format import ChatFormat, ResponseMeta, chat_message
from pyserve.http.pipeline import ChoiceResult
from pyserve.outputs import GenerationChunk

META = ResponseMeta(id="chatcmpl-1", created=0, model="m", include_usage=False)


def openai_message(output: ChatOutput, text: str, finish_reason: str) -> tuple[dict, str | None]:
    """OpenAI's assistant message of a whole output, and its finish reason."""
    parsed = output.message(text, finish_reason)
    return chat_message(parsed), parsed.finish_reason


def openai_stream(output: ChatOutput, pieces: list[str], finish_reason: str) -> list[dict]:
    """The choice entries of the chunks the pipeline streams for one choice generated as
    ``pieces``."""
    fmt = ChatFormat(META, 1, None, parsed=True)
    assert not fmt.stateless
    parser = output.stream()
    result = ChoiceResult()
    frames = [*fmt.opening(0)]
    for piece in pieces:
        chunk = GenerationChunk(
            rid="r", text=piece, token_ids=[1], prompt_tokens=3, completion_tokens=1
        )
        result.add(chunk)
        frame = fmt.content(0, chunk, parser.feed(piece) if piece else None)
        if frame is not None:
            frames.append(frame)
    frames += fmt.closing(0, result, parser.finish(), parser.finish_reason(finish_reason))
    return [msgspec.json.decode(f.removeprefix(b"data: "))["choices"][0] for f in frames]


def openai_response(output: ChatOutput, text: str, finish_reason: str) -> dict:
    """The whole chat completion body of one choice generated as ``text``."""
    result = ChoiceResult()
    result.add(
        GenerationChunk(
            rid="r",
            text=text,
            token_ids=[1, 2],
            prompt_tokens=3,
            completion_tokens=2,
            finish_reason=finish_reason,
        )
    )
    messages = [output.message(result.text, result.finish_reason)]
    return msgspec.json.decode(ChatFormat(META, 1, None, parsed=True).response([result], messages))
