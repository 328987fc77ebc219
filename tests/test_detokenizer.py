"""The detokenizer: incremental = full decode, UTF-8 safety, stop strings, bounded state.

Unit-level tests drive ``Detokenizer`` (the socket-free part of the subprocess) with StepTokens,
one token per request per step as the worker sends them, over the real SmolLM2 tokenizer
(a byte-level BPE: emoji and CJK characters are split across tokens). One test runs the real
subprocess over IPC sockets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyserve.detokenizer.incremental import MAX_PENDING_TOKENS, PROMPT_CONTEXT_TOKENS
from pyserve.detokenizer.process import Detokenizer, DetokenizerConfig
from pyserve.detokenizer.stop import StopStringMatcher
from pyserve.model_files import load_tokenizer, resolve_model
from pyserve.wire import detok_to_main as to_main
from pyserve.wire import worker_to_detok as wire
from pyserve.wire.main_to_worker import DetokParams

EOS = 2  # <|im_end|>
IM_START = 1

# Characters that byte-level BPE splits across tokens (4-byte emoji, ZWJ sequences, skin tones,
# flags, CJK) mixed with ASCII, accents and whitespace.
ALPHABET = list("abcdefgh xyz.,!?\n\t") + list("éñüçß") + list("世界你好中文字日本語한국어")
ALPHABET += ["😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "🤖", "€", "∑", "🧪", "\u200d"]
texts = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=40).map("".join)
# The module-scoped tokenizer fixtures are read-only, so sharing them across examples is safe.
TOKENIZER_EXAMPLES = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer):
    return hf_tokenizer.backend_tokenizer


def encode(hf_tokenizer, text: str) -> list[int]:
    return hf_tokenizer.encode(text, add_special_tokens=False)


def i32(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def i64(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i8").tobytes()


@dataclass
class Stream:
    """One request as the worker would send it: its tokens, one a step, the last one finishing."""

    rid: int
    output_ids: list[int]
    params: DetokParams = field(default_factory=DetokParams)
    prompt_ids: list[int] = field(default_factory=lambda: [IM_START, 9690, 198])
    finish: int = wire.FINISH_LENGTH  # carried by the last token
    deltas: list[to_main.RequestDelta] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)


def run_streams(tokenizer, streams: list[Stream], check=None) -> Detokenizer:
    """Steps all streams together; ``check(detok)`` runs after every step."""
    detok = Detokenizer(tokenizer)
    for s in streams:
        detok.add_request(wire.DetokRequest(s.rid, i32(s.prompt_ids), s.params))
    by_rid = {s.rid: s for s in streams}
    for step in range(max(len(s.output_ids) for s in streams)):
        live = [s for s in streams if step < len(s.output_ids)]
        finish = [s.finish if step == len(s.output_ids) - 1 else 0 for s in live]
        done = detok.process_step(
            wire.StepTokens(
                step_id=step,
                rids=i64([s.rid for s in live]),
                token_ids=i32([s.output_ids[step] for s in live]),
                finish=bytes(finish),
            )
        )
        assert done.step_id == step
        assert done.rids == i64([s.rid for s in live])  # forwarded untouched for Planner.report
        for delta in done.deltas:
            stream = by_rid[delta.rid]
            assert not (stream.deltas and stream.deltas[-1].finish_reason), "delta after finish"
            stream.deltas.append(delta)
        if check is not None:
            check(detok)
    return detok


# ------------------------------------------------------------------------ incremental decoding


def test_emoji_and_cjk_really_are_split_across_tokens(hf_tokenizer, tokenizer):
    ids = encode(hf_tokenizer, "🤖 世界 👨‍👩‍👧")
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "the test text must split chars"
    stream = Stream(1, ids)
    run_streams(tokenizer, [stream])
    assert stream.text == "🤖 世界 👨‍👩‍👧"
    # one delta a token; the ones that end inside a character carry no text
    assert len(stream.deltas) == len(ids)
    assert any(d.text == "" for d in stream.deltas[:-1])


@TOKENIZER_EXAMPLES
@given(text=texts)
def test_incremental_equals_full_decode_and_never_half_a_character(hf_tokenizer, tokenizer, text):
    ids = encode(hf_tokenizer, text)
    assert tokenizer.decode(ids) == text  # byte-level BPE round-trips exactly
    stream = Stream(7, ids)
    run_streams(tokenizer, [stream])
    assert stream.text == text
    for delta in stream.deltas:
        assert "\ufffd" not in delta.text
    assert stream.deltas[-1].finish_reason == "length"
    assert [int(np.frombuffer(d.token_ids, "<i4")[0]) for d in stream.deltas] == ids


def test_batched_requests_with_mixed_settings_decode_independently(hf_tokenizer, tokenizer):
    a = encode(hf_tokenizer, "Bonjour 🇫🇷 le monde")
    b = [*encode(hf_tokenizer, "你好"), IM_START, *encode(hf_tokenizer, "世界 done")]
    c = encode(hf_tokenizer, "short 🧪")
    streams = [
        Stream(1, a),
        Stream(2, b, DetokParams(skip_special_tokens=False)),
        Stream(3, b, DetokParams(skip_special_tokens=True)),
        Stream(4, c, finish=wire.FINISH_STOP),
    ]
    run_streams(tokenizer, streams)
    assert streams[0].text == "Bonjour 🇫🇷 le monde"
    assert streams[1].text == "你好<|im_start|>世界 done"
    assert streams[2].text == "你好世界 done"
    assert streams[1].text == tokenizer.decode(b, skip_special_tokens=False)
    # FINISH_STOP on the last token: it is the EOS / stop token, whose text is not output
    assert streams[3].text == tokenizer.decode(c[:-1])
    assert streams[3].deltas[-1].finish_reason == "stop"
    assert streams[3].deltas[-1].matched_stop == c[-1]


def test_prompt_context_joins_the_first_token(hf_tokenizer, tokenizer):
    prompt = encode(hf_tokenizer, "The capital of France is")
    output = encode(hf_tokenizer, " Paris, of course.")
    stream = Stream(1, output, prompt_ids=prompt)
    run_streams(tokenizer, [stream])
    assert stream.text == " Paris, of course."


def test_eos_text_is_left_out_unless_asked_for(hf_tokenizer, tokenizer):
    ids = [*encode(hf_tokenizer, "The end."), EOS]
    plain = Stream(1, ids, DetokParams(skip_special_tokens=False), finish=wire.FINISH_STOP)
    kept = Stream(
        2,
        ids,
        DetokParams(skip_special_tokens=False, include_stop_str_in_output=True),
        finish=wire.FINISH_STOP,
    )
    run_streams(tokenizer, [plain, kept])
    assert plain.text == "The end."
    assert kept.text == "The end.<|im_end|>"
    assert plain.deltas[-1].matched_stop == EOS


def test_a_character_cut_by_the_length_limit_is_released_like_a_full_decode(
    hf_tokenizer, tokenizer
):
    ids = encode(hf_tokenizer, "ok 🤖")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    stream = Stream(1, ids[:cut])
    run_streams(tokenizer, [stream])
    assert stream.text == tokenizer.decode(ids[:cut])  # the final flush shows what is there


# ------------------------------------------------------------------------ stop strings


@TOKENIZER_EXAMPLES
@given(data=st.data(), text=texts.filter(lambda t: len(t) >= 2), include=st.booleans())
def test_stop_strings_never_leak_even_across_tokens(hf_tokenizer, tokenizer, data, text, include):
    start = data.draw(st.integers(0, len(text) - 1))
    end = data.draw(st.integers(start + 1, min(len(text), start + 6)))
    stop = text[start:end]
    at = text.find(stop)
    expected = text[: at + len(stop)] if include else text[:at]
    ids = encode(hf_tokenizer, text)
    stream = Stream(1, ids, DetokParams(stop=[stop], include_stop_str_in_output=include))

    def never_past_the_stop(detok):
        assert expected.startswith(stream.text), (stream.text, expected)

    run_streams(tokenizer, [stream], check=never_past_the_stop)
    assert stream.text == expected
    assert stream.deltas[-1].finish_reason == "stop"
    assert stream.deltas[-1].matched_stop == stop


def test_held_back_text_is_released_when_the_request_ends_otherwise(hf_tokenizer, tokenizer):
    ids = encode(hf_tokenizer, "Hello world")
    # The last token adds no text: EOS (FINISH_STOP), or a skipped special token (length).
    by_eos = Stream(1, [*ids, EOS], DetokParams(stop=["world!"]), finish=wire.FINISH_STOP)
    by_length = Stream(2, [*ids, IM_START], DetokParams(stop=["world!"]))
    seen: list[str] = []
    run_streams(tokenizer, [by_eos, by_length], check=lambda d: seen.append(by_eos.text))
    assert seen[-2] == "Hello "  # "world" was held: it could still become "world!"
    for stream in (by_eos, by_length):
        assert stream.text == "Hello world"
    assert (by_eos.deltas[-1].finish_reason, by_eos.deltas[-1].matched_stop) == ("stop", EOS)
    assert (by_length.deltas[-1].finish_reason, by_length.deltas[-1].matched_stop) == (
        "length",
        None,
    )


def test_tokens_after_a_stop_string_are_ignored_until_dropped(hf_tokenizer, tokenizer):
    ids = encode(hf_tokenizer, "one two three four")
    stream = Stream(5, ids, DetokParams(stop=["two"]))
    detok = run_streams(tokenizer, [stream])
    assert stream.text == "one "
    stop_step = next(i for i, d in enumerate(stream.deltas) if d.finish_reason)
    assert len(stream.deltas) == stop_step + 1  # the overlap's extra tokens made no delta
    assert 5 in detok.requests  # kept (finished) until main's Step drops it
    done = detok.process_step(
        wire.StepTokens(step_id=99, rids=b"", token_ids=b"", finish=b"", dropped=i64([5]))
    )
    assert done.deltas == [] and detok.requests == {}


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    text=st.text(alphabet="abcab😀", max_size=30),
    stops=st.lists(st.text(alphabet="abc😀", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_matcher_does_not_depend_on_how_text_is_cut(data, text, stops):
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    def run(parts: list[str]) -> tuple[str, str | None]:
        matcher = StopStringMatcher(stops)
        released = []
        for part in parts:
            piece, stop = matcher.feed(part)
            released.append(piece)
            assert len(matcher.held) < max(map(len, stops))
            if stop is not None:
                return "".join(released), stop
        return "".join(released) + matcher.flush(), None

    # reference: the stop that is complete earliest, reading one character at a time
    ends = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    expected = (text, None)
    if ends:
        end, neg_len, stop = min(ends)
        expected = (text[: end + neg_len], stop)
    assert run(pieces) == expected
    assert run(list(text)) == expected


# ------------------------------------------------------------------------ bounded state


def test_state_stays_bounded_over_long_outputs(hf_tokenizer, tokenizer):
    text = "Streaming 世界 text 😀 with stops! " * 120
    ids = encode(hf_tokenizer, text)
    rng = np.random.default_rng(0)
    garbage = rng.integers(0, 49152, size=len(ids)).tolist()  # random bytes, often invalid UTF-8
    streams = [Stream(1, ids, DetokParams(stop=["never appears here"])), Stream(2, garbage)]
    bound = PROMPT_CONTEXT_TOKENS + MAX_PENDING_TOKENS + 1

    def bounded(detok):
        for state in detok.requests.values():
            assert len(state.decoder.window) <= bound
            assert len(state.stop.held) < len("never appears here")

    run_streams(tokenizer, streams, check=bounded)
    assert streams[0].text == text
    assert len(streams[1].deltas) == len(garbage)


def test_logprobs_are_passed_through(hf_tokenizer, tokenizer):
    detok = Detokenizer(tokenizer)
    detok.add_request(wire.DetokRequest(1, i32([IM_START])))
    detok.add_request(wire.DetokRequest(2, i32([IM_START])))
    top = wire.TopLogprobs(1, i32([42, 43]), np.asarray([-0.5, -1.5], "<f4").tobytes())
    done = detok.process_step(
        wire.StepTokens(
            step_id=0,
            rids=i64([1, 2]),
            token_ids=i32([42, 43]),
            finish=bytes(2),
            logprobs=np.asarray([-0.25, -0.5], "<f4").tobytes(),
            top_logprobs=[top],
        )
    )
    first, second = done.deltas
    assert (first.logprob, first.top_logprobs) == (-0.25, None)
    assert second.logprob == -0.5
    assert second.top_logprobs == [(42, -0.5), (43, -1.5)]


# ------------------------------------------------------------------------ the subprocess


def test_subprocess_forwards_ready_steps_errors_and_shutdown(hf_tokenizer):
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_file = os.path.join(tmp, "tokenizer.json")
        hf_tokenizer.backend_tokenizer.save(tokenizer_file)
        config = DetokenizerConfig(
            tokenizer_file=tokenizer_file,
            in_addr=f"ipc://{tmp}/detok",
            out_addr=f"ipc://{tmp}/main",
            parent_pid=os.getpid(),
        )
        ctx = zmq.Context()
        from_detok = ctx.socket(zmq.PULL)
        from_detok.bind(config.out_addr)
        to_detok = ctx.socket(zmq.PUSH)
        to_detok.connect(config.in_addr)
        proc = subprocess.Popen(
            [sys.executable, "-m", "pyserve.detokenizer", "--config", msgspec.json.encode(config)]
        )
        try:

            def send(msg) -> None:
                to_detok.send(wire.encoder.encode(msg))

            def receive():
                assert from_detok.poll(60_000), "no answer from the detokenizer"
                return to_main.decoder.decode(from_detok.recv())

            send(wire.WorkerReady(num_blocks=8, block_size=16, dtype="float32", device="cpu"))
            assert receive() == to_main.Ready(8, 16, "float32", "cpu")
            with open(f"/proc/{proc.pid}/maps") as maps:
                assert "libtorch" not in maps.read(), "the detokenizer loaded torch"

            ids = encode(hf_tokenizer, "Hi 😀!")
            send(wire.DetokRequest(3, i32([IM_START]), DetokParams(stop=["!"])))
            text = ""
            for step, token in enumerate(ids):
                send(wire.StepTokens(step, i64([3]), i32([token]), bytes(1)))
                done = receive()
                assert isinstance(done, to_main.StepDone) and done.step_id == step
                text += "".join(d.text for d in done.deltas)
            assert text == "Hi 😀"
            assert done.deltas[-1].finish_reason == "stop"

            send(wire.WorkerError("boom", i64([3])))
            assert receive() == to_main.WorkerError("boom", i64([3]))
            send(wire.Shutdown())
            assert isinstance(receive(), to_main.Stopped)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            from_detok.close(linger=0)
            to_detok.close(linger=0)
            ctx.term()


# ------------------------------------------------------------------------ several tokens a step


def deltas_of(detok: Detokenizer, step_id: int, entries: list[tuple[int, int, int]]):
    """Processes one StepTokens of (rid, token, finish) entries; returns its StepDone."""
    return detok.process_step(
        wire.StepTokens(
            step_id=step_id,
            rids=i64([r for r, _, _ in entries]),
            token_ids=i32([t for _, t, _ in entries]),
            finish=bytes([f for _, _, f in entries]),
        )
    )


def test_a_stop_string_at_a_verified_token_ends_the_request_before_the_next(
    hf_tokenizer, tokenizer
):
    words = [encode(hf_tokenizer, w) for w in ("Hello", " world", " again")]
    assert all(len(w) == 1 for w in words), "one token a word, for this test"
    hello, world, again = (w[0] for w in words)
    other = encode(hf_tokenizer, " ok")
    detok = Detokenizer(tokenizer)
    detok.add_request(wire.DetokRequest(1, i32([IM_START]), DetokParams(stop=["o w"])))
    detok.add_request(wire.DetokRequest(2, i32([IM_START])))
    # a verify entry of rid 1 emitted three tokens; rid 2 decoded one between them
    done = deltas_of(detok, 0, [(1, hello, 0), (1, world, 0), (2, other[0], 0), (1, again, 0)])
    mine = [d for d in done.deltas if d.rid == 1]
    assert len(mine) == 2  # the third token came after the finish: no delta at all
    assert [d.finish_reason for d in mine] == [None, "stop"]
    assert mine[1].matched_stop == "o w"
    assert "".join(d.text for d in mine) == "Hell"
    ids = [int(np.frombuffer(d.token_ids, "<i4")[0]) for d in mine]
    assert ids == [hello, world] and again not in ids
    assert [d.text for d in done.deltas if d.rid == 2] == [" ok"]
    assert done.rids == i64([1, 1, 2, 1])  # forwarded untouched for Planner.report
    # later steps of the finished request produce nothing either
    assert deltas_of(detok, 1, [(1, again, 0)]).deltas == []


@TOKENIZER_EXAMPLES
@given(data=st.data(), text=texts, stop=st.sampled_from(["", "a", "世", "👍", "z."]))
def test_several_tokens_a_step_decode_exactly_like_one_a_step(
    hf_tokenizer, tokenizer, data, text, stop
):
    """A request's tokens grouped into steps of any sizes (verify entries) give the deltas of
    one token a step, one delta a token, and nothing after a stop string."""
    ids = encode(hf_tokenizer, text)
    params = DetokParams(stop=[stop] if stop else [])
    one = Stream(1, ids, params)
    run_streams(tokenizer, [one])
    detok = Detokenizer(tokenizer)
    detok.add_request(wire.DetokRequest(1, i32(one.prompt_ids), params))
    detok.add_request(wire.DetokRequest(2, i32(one.prompt_ids), params))
    got: list[to_main.RequestDelta] = []
    at = step = 0
    while at < len(ids):
        n = data.draw(st.integers(1, 4))
        group = ids[at : at + n]
        finishes = [0] * len(group)
        if at + n >= len(ids):
            finishes[-1] = wire.FINISH_LENGTH
        entries = [(1, t, f) for t, f in zip(group, finishes, strict=True)]
        entries.insert(1, (2, ids[0], 0))  # another request's token between them
        done = deltas_of(detok, step, entries)
        got += [d for d in done.deltas if d.rid == 1]
        at, step = at + n, step + 1
    assert got == one.deltas
