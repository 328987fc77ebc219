"""The worker's side of images, piece by piece: the request table turns a request's image
positions into the embedding rows of the prefill chunks that cover them (a chunk may cover part
of an image), embeds ids beyond the vocabulary (an image's, or drafts copied from them) as 0
while verification keeps the drafts, marks Gemma 3's two-way runs, and lays out Qwen2.5-VL's
multimodal rope positions; the encoder runs a tower once per image and keeps its outputs within
a byte budget; EntrySplit turns a two-way run into decode rows that read to the run's end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from worker_testlib import i32, make_step

from pyserve.engine.image_prompts import MAX_TOKEN_ID, with_image_ids
from pyserve.wire.main_to_worker import ImageInput, NewRequest, SamplingParams, WireTensor
from pyserve.worker.backends.common import EntrySplit
from pyserve.worker.image_encoder import ImageEncoder, RequestImage, VisionModel, image_slices
from pyserve.worker.mrope import mrope_positions
from pyserve.worker.state import RequestTable

VOCAB = 100
IMAGE_TOKEN = 99


def image(positions: list[int], key: bytes = b"k" * 16, grid: list[int] | None = None):
    tensors = {"pixel_values": WireTensor("<f4", [1], np.float32([1.0]).tobytes())}
    if grid is not None:
        tensors["image_grid_thw"] = WireTensor("<i8", [1, 3], np.int64([grid]).tobytes())
    return ImageInput(key=key, positions=i32(positions), tensors=tensors)


def request(rid: int, prompt: list[int], images: list[ImageInput]) -> NewRequest:
    ids = with_image_ids(prompt, images, VOCAB)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    return NewRequest(rid=rid, prompt_ids=i32(ids), sampling=greedy, images=images)


def table(**vision) -> RequestTable:
    """A request table of a vision model (``vision``: VisionModel's settings)."""
    encoder = ImageEncoder(CountingTower(rows=1), device="cpu", dtype=torch.float32)
    model = VisionModel(encoder, IMAGE_TOKEN, **vision)
    return RequestTable(block_size=4, eos_token_ids=[2], vocab_size=VOCAB, vision=model)


def test_image_ids_are_above_the_vocabulary_and_differ_between_images() -> None:
    prompt = [5, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 6]
    one = with_image_ids(prompt, [image([1, 2, 3], b"a" * 16)], VOCAB)
    other = with_image_ids(prompt, [image([1, 2, 3], b"b" * 16)], VOCAB)
    assert one[0] == 5 and one[4] == 6
    assert all(VOCAB <= t < MAX_TOKEN_ID for t in one[1:4])
    assert len(set(one[1:4])) == 3  # each position its own id
    assert one[1:4] != other[1:4]


def test_chunks_take_the_rows_of_the_image_positions_they_cover() -> None:
    """A prompt of 8 with an image at 2..5 prefilled in chunks of 4: rows 2, 3 of the first,
    rows 0, 1 of the second; the ids there are embedded as 0, penalties see the image token."""
    t = table()
    state = t.add(request(1, [5, 6, *[IMAGE_TOKEN] * 4, 7, 8], [image([2, 3, 4, 5])]))
    assert state.prompt_ids.tolist() == [5, 6, 99, 99, 99, 99, 7, 8]
    ids = _ids(t, 1)
    first = t.prepare(make_step(0, [dict(rid=1, n=4, ids=ids[:4], blocks=[0], sample=0)]))
    assert first.batch.input_ids.tolist() == [5, 6, 0, 0]
    assert [(s.lo, s.hi, s.batch_rows.tolist()) for s in first.images] == [(0, 2, [2, 3])]
    chunk = dict(rid=1, start=4, n=4, ids=ids[4:], blocks=[1], offset=1)
    second = t.prepare(make_step(1, [chunk]))
    assert [(s.lo, s.hi, s.batch_rows.tolist()) for s in second.images] == [(2, 4, [0, 1])]
    assert second.batch.bidirectional == []  # causal over images unless the model says


def _ids(t: RequestTable, rid: int) -> list[int]:
    """The prompt as the core holds it (the image's positions with their own ids)."""
    state = t.get(rid)
    ids = state.prompt_ids.tolist()
    return with_image_ids(ids, [item.image for item in state.images], VOCAB)


def test_drafts_beyond_the_vocabulary_are_embedded_as_0_and_kept_for_verification() -> None:
    t = table()
    t.add(NewRequest(rid=1, prompt_ids=i32([5, 6, 7]), sampling=SamplingParams(max_new_tokens=4)))
    t.get(1).last_token, t.get(1).block_table = 40, [0, 1]
    prepared = t.prepare(make_step(0, [dict(rid=1, start=3, n=3, decode=1, ids=[41, 4000])]))
    assert prepared.batch.input_ids.tolist() == [40, 41, 0]
    assert prepared.verify == {0: [41, 4000]}  # never equal to a sample: rejected there


def test_two_way_runs_are_the_image_rows_of_each_chunk() -> None:
    t = table(bidirectional=True)
    prompt = [5, *[IMAGE_TOKEN] * 3, 6, *[IMAGE_TOKEN] * 2, 7]
    t.add(request(1, prompt, [image([1, 2, 3]), image([5, 6], b"z" * 16)]))
    prepared = t.prepare(make_step(0, [dict(rid=1, start=0, n=8, ids=_ids(t, 1), blocks=[0, 1])]))
    assert prepared.batch.bidirectional == [(0, 1, 3), (0, 5, 2)]
    split = EntrySplit.of(prepared.batch)
    assert split.spans == [(0, 1, 0), (4, 1, 4), (7, 1, 7)]  # the text around the images
    assert split.decode_rows == [1, 2, 3, 5, 6]
    assert split.decode_contexts == [4, 4, 4, 7, 7]  # each row reads to its image's end
    assert split.decode_positions == [1, 2, 3, 5, 6]  # its window ends where it is


def test_multimodal_rope_lays_an_image_on_its_grid_and_shifts_what_follows() -> None:
    # text 0, 1; a 1 x 4 x 6 grid merged by 2: 2 x 3 patches at 2 + (t, h, w); text from 2 + 3
    positions, delta = mrope_positions(11, [(np.arange(2, 8), (1, 4, 6))], 2)
    assert positions[:, :2].tolist() == [[0, 1]] * 3
    assert positions[0, 2:8].tolist() == [2] * 6
    assert positions[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert positions[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert positions[:, 8:].tolist() == [[5, 6, 7]] * 3
    assert delta == 8 - 11
    with pytest.raises(ValueError, match="grid"):
        mrope_positions(11, [(np.arange(2, 7), (1, 4, 6))], 2)


def test_rope_positions_of_a_step_past_the_prompt_add_the_delta() -> None:
    t = table(mrope_merge=2)
    prompt = [5, 6, *[IMAGE_TOKEN] * 6, 7, 8, 9]
    t.add(request(1, prompt, [image(list(range(2, 8)), grid=[1, 4, 6])]))
    t.add(NewRequest(rid=2, prompt_ids=i32([5, 6]), sampling=SamplingParams(max_new_tokens=4)))
    for rid, blocks in ((1, [0, 1, 2, 3]), (2, [4])):
        t.get(rid).last_token, t.get(rid).block_table = 40, blocks
    decodes = [dict(rid=1, start=11, n=1, decode=1), dict(rid=2, start=2, n=1, decode=1)]
    prepared = t.prepare(make_step(0, decodes))
    rope = prepared.batch.rope_positions
    assert rope is not None and rope.tolist() == [[8, 2]] * 3  # 11 - 3; a text request as is


class CountingTower:
    def __init__(self, rows: int) -> None:
        self.rows, self.calls = rows, 0

    def encode(self, pixel_values: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.full((self.rows, 2), float(self.calls))


def test_the_encoder_runs_once_an_image_and_keeps_outputs_within_its_budget() -> None:
    tower = CountingTower(rows=4)
    encoder = ImageEncoder(tower, device="cpu", dtype=torch.float32, cache_bytes=2 * 4 * 2 * 4)
    a, b, c = (RequestImage.of(image([0, 1, 2, 3], key * 16), 8) for key in (b"a", b"b", b"c"))
    rows, _ = encoder.embeddings(image_slices([a], 0, 2, 0) + image_slices([a], 2, 2, 10))
    assert rows.tolist() == [0, 1, 10, 11] and tower.calls == 1
    encoder.embeddings(image_slices([b], 0, 4, 0))
    encoder.embeddings(image_slices([c], 0, 4, 0))  # a is evicted: two fit
    encoder.embeddings(image_slices([b, a], 0, 4, 0))
    assert tower.calls == 4 and encoder.encoded == 4
    wrong = CountingTower(rows=3)
    with pytest.raises(ValueError, match="3 rows for an image with 4 placeholders"):
        ImageEncoder(wrong, device="cpu", dtype=torch.float32).embeddings(
            image_slices([a], 0, 4, 0)
        )


def test_a_request_with_images_is_refused_by_a_text_worker() -> None:
    t = RequestTable(block_size=4, eos_token_ids=[2], vocab_size=VOCAB)
    with pytest.raises(ValueError, match="takes none"):
        t.add(request(1, [5, IMAGE_TOKEN, 6], [image([1])]))


def test_an_unknown_vision_dtype_is_refused_before_anything_loads() -> None:
    from pyserve.worker.settings import WorkerSettings

    with pytest.raises(ValueError, match="vision_dtype 'int4'"):
        WorkerSettings(vision_dtype="int4").validate()
