"""The vision towers (pyserve.worker.vision) against transformers' own models: tiny random
Idefics3, SmolVLM, Gemma 3 and Qwen2.5-VL models are saved with save_pretrained, their vision
weights read back (through our checkpoint loader where it knows the text model), and their image
features compared with ``get_image_features`` in float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3VisionConfig,
    LlamaConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    SiglipVisionConfig,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from pyserve.worker.loading import ModelLoadError, open_checkpoint
from pyserve.worker.loading.base import StoredTensor
from pyserve.worker.vision import load_vision_weights, vision_tower_for
from pyserve.worker.vision.siglip import bucketed_position_ids

ATOL = 1e-5
TEXT_HIDDEN = 48
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=64,
    patch_size=8,
)


def tiny_llama() -> dict:
    return LlamaConfig(
        hidden_size=TEXT_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ).to_dict()


def save(model_cls, config, path):
    torch.manual_seed(0)
    model = model_cls(config).eval()
    # random init leaves some weights at exactly 0 or 1 (norms, biases); perturb everything so
    # a tensor loaded into the wrong place cannot go unnoticed
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model


class InMemory(StoredTensor):
    """A checkpoint tensor already read, for models whose text side our loader does not serve
    (yet): only the vision side is under test."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.file, self.name, self.tensor = "memory", name, tensor
        self.shape, self.type_name = tuple(tensor.shape), str(tensor.dtype)
        self.nbytes = tensor.nbytes

    def values(self) -> torch.Tensor:
        return self.tensor


def our_tower(path, *, through_loader: bool = True):
    tower = vision_tower_for(AutoConfig.from_pretrained(path), dtype=torch.float32, device="cpu")
    assert tower is not None
    if through_loader:
        tensors = open_checkpoint(str(path)).tensors
    else:
        tensors = [(n, InMemory(n, t)) for n, t in load_file(path / "model.safetensors").items()]
    load_vision_weights(tower, tensors, str(path))
    return tower


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    config = Idefics3Config(
        text_config=tiny_llama(),
        vision_config=Idefics3VisionConfig(**VISION).to_dict(),
        scale_factor=2,
    )
    model = save(Idefics3ForConditionalGeneration, config, path)
    return model, our_tower(path), path


def hf_idefics3_features(model, pixel_values, pixel_attention_mask):
    with torch.no_grad():
        out = model.model.get_image_features(
            pixel_values=pixel_values[None], pixel_attention_mask=pixel_attention_mask[None]
        )
    (features,) = out.pooler_output  # one list entry per batch row
    return features


def test_idefics3_full_tiles(idefics3):
    model, tower, _ = idefics3
    torch.manual_seed(1)
    pixels = torch.randn(2, 3, 64, 64)
    mask = torch.ones(2, 64, 64, dtype=torch.bool)
    ours = tower.encode(pixels, pixel_attention_mask=mask)
    assert ours.shape == (2 * 16, TEXT_HIDDEN)  # (64/8)**2 patches / 2**2 per token
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf_idefics3_features(model, pixels, mask), atol=ATOL, rtol=0)
    # no mask at all means every pixel is image
    torch.testing.assert_close(tower.encode(pixels), ours, atol=ATOL, rtol=0)


def test_idefics3_drops_padding_tiles(idefics3):
    model, tower, _ = idefics3
    torch.manual_seed(2)
    pixels = torch.randn(4, 3, 64, 64)
    pixels[1] = 0
    pixels[3] = 0
    mask = torch.ones(4, 64, 64, dtype=torch.bool)
    mask[1] = False
    mask[3] = False
    ours = tower.encode(pixels, pixel_attention_mask=mask)
    assert ours.shape == (2 * 16, TEXT_HIDDEN)
    torch.testing.assert_close(ours, hf_idefics3_features(model, pixels, mask), atol=ATOL, rtol=0)
    torch.testing.assert_close(ours, tower.encode(pixels[[0, 2]]), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("height", "width"), [(40, 64), (24, 56), (64, 20), (13, 37)])
def test_idefics3_partial_tile(idefics3, height, width):
    """An image smaller than the tile: padding pixels are zero and masked out; its patches get
    bucketed positions and the padding patches are masked as keys."""
    model, tower, _ = idefics3
    torch.manual_seed(3)
    pixels = torch.zeros(2, 3, 64, 64)
    mask = torch.zeros(2, 64, 64, dtype=torch.bool)
    pixels[0] = torch.randn(3, 64, 64)
    mask[0] = True
    pixels[1, :, :height, :width] = torch.randn(3, height, width)
    mask[1, :height, :width] = True
    ours = tower.encode(pixels, pixel_attention_mask=mask)
    assert ours.shape == (2 * 16, TEXT_HIDDEN)
    torch.testing.assert_close(ours, hf_idefics3_features(model, pixels, mask), atol=ATOL, rtol=0)


def test_idefics3_processor_layout(idefics3):
    """[batch, tiles, ...] as the processor returns it, the mask as int64."""
    model, tower, _ = idefics3
    torch.manual_seed(4)
    pixels = torch.randn(1, 3, 3, 64, 64)
    pixels[0, 2] = 0
    mask = torch.ones(1, 3, 64, 64, dtype=torch.long)
    mask[0, 1, 40:] = 0
    mask[0, 2] = 0
    ours = tower.encode(pixels, pixel_attention_mask=mask)
    with torch.no_grad():
        (theirs,) = model.model.get_image_features(
            pixel_values=pixels, pixel_attention_mask=mask
        ).pooler_output
    assert ours.shape == (2 * 16, TEXT_HIDDEN)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("side", [26, 32])  # Idefics3-8B (364 / 14), SmolVLM (512 / 16)
def test_bucketed_positions_of_every_partial_tile(side):
    """Every top-left rows x cols image on a side x side patch grid gets transformers' position
    ids: its embeddings module, with zero patch weights and a table whose column 0 holds the
    row index, outputs the position ids themselves."""
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    config = Idefics3VisionConfig(hidden_size=1, image_size=side, patch_size=1)
    embeddings = Idefics3VisionEmbeddings(config)
    with torch.no_grad():
        embeddings.patch_embedding.weight.zero_()
        embeddings.patch_embedding.bias.zero_()
        embeddings.position_embedding.weight[:, 0] = torch.arange(side * side)
    mask = torch.zeros(side * side, side, side, dtype=torch.bool)
    for rows in range(side):
        for cols in range(side):
            mask[rows * side + cols, : rows + 1, : cols + 1] = True
    with torch.no_grad():
        theirs = embeddings(torch.zeros(side * side, 3, side, side), mask)[..., 0]
    assert torch.equal(bucketed_position_ids(mask, side).float(), theirs)


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_idefics3_from_its_image_processor(idefics3):
    """Two prompts' images as the processor batches them: the small image's row is padded with
    all-zero tiles up to the large one's tile count."""
    model, tower, _ = idefics3
    processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 128}, max_image_size={"longest_edge": 64}
    )
    images = [[random_image(50, 90, 0)], [random_image(90, 30, 1)]]
    inputs = processor(images=images, return_tensors="pt")
    pixels, mask = inputs["pixel_values"], inputs["pixel_attention_mask"]
    real = int((pixels.flatten(2) != 0).any(-1).sum())
    assert real < pixels.shape[0] * pixels.shape[1]  # there are padding tiles to drop
    ours = tower.encode(pixels, pixel_attention_mask=mask)
    with torch.no_grad():
        theirs = model.model.get_image_features(pixels, mask).pooler_output
    assert ours.shape == (real * 16, TEXT_HIDDEN)
    torch.testing.assert_close(ours, torch.cat(theirs), atol=ATOL, rtol=0)


def test_bucketed_positions_of_a_full_grid_are_the_table():
    for side in (4, 7, 8, 14, 24, 32, 37):
        ids = bucketed_position_ids(torch.ones(1, side, side, dtype=torch.bool), side)
        assert ids.tolist() == [list(range(side * side))], side


def test_smolvlm(tmp_path):
    config = SmolVLMConfig(
        text_config=tiny_llama(),
        vision_config=dict(VISION, model_type="smolvlm_vision"),
        scale_factor=4,
    )
    model = save(SmolVLMForConditionalGeneration, config, tmp_path)
    tower = our_tower(tmp_path)
    torch.manual_seed(5)
    pixels = torch.randn(1, 2, 3, 64, 64)
    mask = torch.ones(1, 2, 64, 64, dtype=torch.bool)
    mask[0, 1, :, 30:] = False
    pixels[0, 1, :, :, 30:] = 0
    ours = tower.encode(pixels, pixel_attention_mask=mask)
    with torch.no_grad():
        (theirs,) = model.model.get_image_features(
            pixel_values=pixels, pixel_attention_mask=mask
        ).pooler_output
    assert ours.shape == (2 * 4, TEXT_HIDDEN)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def gemma3_config() -> Gemma3Config:
    return Gemma3Config(
        text_config=Gemma3TextConfig(
            hidden_size=TEXT_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=300,
        ).to_dict(),
        vision_config=SiglipVisionConfig(**VISION, vision_use_head=False).to_dict(),
        mm_tokens_per_image=4,
    )


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    model = save(Gemma3ForConditionalGeneration, gemma3_config(), path)
    return model, our_tower(path), path


@pytest.mark.parametrize("images", [1, 2])
def test_gemma3(gemma3, images):
    model, tower, _ = gemma3
    torch.manual_seed(6 + images)
    pixels = torch.randn(images, 3, 64, 64)
    ours = tower.encode(pixels)
    with torch.no_grad():
        theirs = model.model.get_image_features(pixel_values=pixels).pooler_output
    assert ours.shape == (images * 4, TEXT_HIDDEN)
    torch.testing.assert_close(ours, theirs.reshape(-1, TEXT_HIDDEN), atol=ATOL, rtol=0)


def test_gemma3_older_checkpoint_names(gemma3):
    """Google's checkpoints say vision_tower.vision_model.*, transformers 4.5x model.*; the
    tensors land in the same place under every naming."""
    model, tower, path = gemma3
    tensors = open_checkpoint(str(path)).tensors
    pixels = torch.randn(1, 3, 64, 64)
    expected = tower.encode(pixels)
    for vision, projector in [
        ("vision_tower.vision_model.", "multi_modal_projector."),
        ("model.vision_tower.vision_model.", "model.multi_modal_projector."),
    ]:
        renamed = []
        for name, stored in tensors:
            if name.startswith("vision_tower."):
                name = vision + name[len("vision_tower.") :]
            elif name.startswith("multi_modal_projector."):
                name = projector + name[len("multi_modal_projector.") :]
            renamed.append((name, stored))
        other = vision_tower_for(model.config, dtype=torch.float32, device="cpu")
        load_vision_weights(other, renamed, str(path))
        torch.testing.assert_close(other.encode(pixels), expected, atol=0, rtol=0)


def test_bfloat16_tower(gemma3):
    model, _, path = gemma3
    tower = vision_tower_for(model.config, dtype=torch.bfloat16, device="cpu")
    load_vision_weights(tower, open_checkpoint(str(path)).tensors, str(path))
    pixels = torch.randn(2, 3, 64, 64)
    ours = tower.encode(pixels)
    assert ours.dtype == torch.bfloat16 and ours.shape == (8, TEXT_HIDDEN)
    with torch.no_grad():
        theirs = model.model.get_image_features(pixel_values=pixels).pooler_output
    torch.testing.assert_close(ours.float(), theirs.reshape(-1, TEXT_HIDDEN), atol=0.1, rtol=0.05)


def test_missing_and_misshapen_tensors(idefics3, gemma3):
    _, _, path = gemma3
    tensors = open_checkpoint(str(path)).tensors
    config = AutoConfig.from_pretrained(path)

    gone = "vision_tower.encoder.layers.1.mlp.fc2.bias"
    tower = vision_tower_for(config, dtype=torch.float32, device="cpu")
    with pytest.raises(ModelLoadError, match=f"missing vision tensor.s. {gone}$"):
        load_vision_weights(tower, [(n, t) for n, t in tensors if n != gone], str(path))

    gone = "multi_modal_projector.mm_input_projection_weight"
    with pytest.raises(ModelLoadError, match=f"missing vision tensor.s. {gone}$"):
        load_vision_weights(tower, [(n, t) for n, t in tensors if n != gone], str(path))

    swapped = dict(tensors)
    fc1 = "vision_tower.encoder.layers.0.mlp.fc1.weight"
    swapped[fc1] = swapped["vision_tower.encoder.layers.0.mlp.fc2.weight"]
    with pytest.raises(ModelLoadError, match=f"{fc1} has shape"):
        load_vision_weights(tower, list(swapped.items()), str(path))

    extra = [*tensors, ("vision_tower.encoder.layers.7.mlp.fc1.weight", tensors[-1][1])]
    with pytest.raises(ModelLoadError, match=r"unexpected vision tensor.*layers\.7\."):
        load_vision_weights(tower, extra, str(path))

    _, _, path = idefics3
    tensors = open_checkpoint(str(path)).tensors
    tower = vision_tower_for(AutoConfig.from_pretrained(path), dtype=torch.float32, device="cpu")
    gone = "model.connector.modality_projection.proj.weight"
    with pytest.raises(ModelLoadError, match=f"missing vision tensor.s. {gone}$"):
        load_vision_weights(tower, [(n, t) for n, t in tensors if n != gone], str(path))


def test_text_only_models_have_no_tower():
    assert vision_tower_for(LlamaConfig(), dtype=torch.float32, device="cpu") is None
    assert vision_tower_for(Gemma3TextConfig(), dtype=torch.float32, device="cpu") is None


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=TEXT_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=200,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
            },
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            out_hidden_size=TEXT_HIDDEN,
            patch_size=4,
            temporal_patch_size=2,
            spatial_merge_size=2,
            window_size=16,  # windows of 2 x 2 merge blocks: 16 patches
            fullatt_block_indexes=[1],
        ),
    )
    model = save(Qwen2_5_VLForConditionalGeneration, config, path)
    return model, our_tower(path, through_loader=False)


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 8, 8)],  # whole windows only
        [(1, 6, 10)],  # windows cut at the right and bottom edges
        [(1, 6, 10), (1, 8, 4), (1, 2, 2)],  # several images of different sizes
        [(2, 4, 6)],  # two frames: attention stays within a frame
    ],
)
def test_qwen2_5_vl(qwen2_5_vl, grids):
    model, tower = qwen2_5_vl
    grid_thw = torch.tensor(grids)
    torch.manual_seed(8)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 4 * 4)
    ours = tower.encode(pixels, image_grid_thw=grid_thw)
    with torch.no_grad():
        theirs = model.model.get_image_features(pixels, grid_thw).pooler_output
    assert ours.shape == (int(grid_thw.prod(-1).sum()) // 4, TEXT_HIDDEN)
    torch.testing.assert_close(ours, torch.cat(theirs), atol=ATOL, rtol=0)


def test_qwen2_5_vl_from_its_image_processor(qwen2_5_vl):
    model, tower = qwen2_5_vl
    processor = Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=64 * 64
    )
    images = [random_image(50, 90, 2), random_image(30, 20, 3)]
    inputs = processor(images=images, return_tensors="pt")
    pixels, grid_thw = inputs["pixel_values"], inputs["image_grid_thw"]
    ours = tower.encode(pixels, image_grid_thw=grid_thw)
    with torch.no_grad():
        theirs = model.model.get_image_features(pixels, grid_thw).pooler_output
    assert ours.shape == (int(grid_thw.prod(-1).sum()) // 4, TEXT_HIDDEN)
    torch.testing.assert_close(ours, torch.cat(theirs), atol=ATOL, rtol=0)


def test_pooling_head_and_derived_buffers_are_skipped(gemma3):
    """SigLIP's pooling head (vision_use_head) and stored copies of derived buffers load as
    nothing: no encode uses them."""
    model, tower, path = gemma3
    tensors = open_checkpoint(str(path)).tensors
    anything = InMemory("x", torch.zeros(3))
    extra = [
        ("vision_tower.head.probe", anything),
        ("vision_tower.head.attention.in_proj_weight", anything),
        ("vision_tower.embeddings.position_ids", anything),
    ]
    other = vision_tower_for(model.config, dtype=torch.float32, device="cpu")
    load_vision_weights(other, [*tensors, *extra], str(path))
    pixels = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(other.encode(pixels), tower.encode(pixels), atol=0, rtol=0)
