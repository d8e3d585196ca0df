"""DeepSeek-V4.1's image preprocessing and vision encoder against NeMo AutoModel's (the golden file written by
``tools/goldens/v41_vision_golden.py`` from ``make_tiny --vision``'s checkpoint and the PNGs beside it), plus the
inputs each part refuses."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from deepinfer.loading.model_loader import load_vision_encoder  # noqa: E402
from deepinfer.loading.model_registry import checkpoint_naming, model_config  # noqa: E402
from deepinfer.loading.weights import plan_load  # noqa: E402
from deepinfer.models.deepseek_v41.config import VisionConfig  # noqa: E402
from deepinfer.models.deepseek_v41.image_processing import (  # noqa: E402
    IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, expand_image_placeholders, image_token_types, load_image,
    plan_image_grid, preprocess_image)
from deepinfer.models.deepseek_v41.vision import VisionEncoder, merge_cells  # noqa: E402
from deepinfer.models.deepseek_v41.vision_weights import load_vision_weights  # noqa: E402
from deepinfer.runtime.quantization import dequantize, quantize_fp8  # noqa: E402
from deepinfer.testing import make_tiny  # noqa: E402
from deepinfer.testing.tiny_v41 import TINY_V41, TINY_VISION  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "v41_vision"
GOLDEN = torch.load(FIXTURE / "golden.pt", weights_only=True)
CONFIG = VisionConfig.from_dict(GOLDEN["vision_config"])
IMAGES = GOLDEN["images"]
IDS = [image["file"] for image in IMAGES]


@pytest.fixture(scope="module")
def encoder(tiny_vision_checkpoint) -> VisionEncoder:
    return load_vision_encoder(model_config(tiny_vision_checkpoint), tiny_vision_checkpoint, torch.float32)


def test_golden_was_made_from_make_tinys_vision_config():
    assert GOLDEN["vision_config"] == TINY_VISION


# -- preprocessing --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("golden", IMAGES, ids=IDS)
def test_grid_and_token_count_equal_nemos(golden):
    image = load_image(FIXTURE / golden["file"])
    grid = plan_image_grid(image.width, image.height, CONFIG)
    assert (grid.height, grid.width, grid.rows, grid.cols, grid.token_rows, grid.token_cols) == tuple(golden["grid"])
    assert grid.num_tokens == golden["num_tokens"] == len(image_token_types(grid))


@pytest.mark.parametrize("golden", IMAGES, ids=IDS)
def test_patches_equal_nemos(golden):
    processed = preprocess_image(FIXTURE / golden["file"], CONFIG)
    assert processed.patches.dtype == golden["patches"].dtype == torch.bfloat16
    torch.testing.assert_close(processed.patches, golden["patches"], rtol=0, atol=0)


def test_prompt_expansion_equals_nemos():
    prompt = GOLDEN["prompt"]
    grids = [preprocess_image(FIXTURE / g["file"], CONFIG).grid for g in IMAGES]
    ids, types = expand_image_placeholders(prompt["raw_ids"], prompt["image_token_id"], grids)
    assert ids == prompt["input_ids"]
    assert types == prompt["token_types"]


def test_span_layout_is_rows_of_tokens_each_closed_by_a_row_end():
    grid = plan_image_grid(40, 24, CONFIG)  # 3 x 5 image tokens
    assert image_token_types(grid) == [IMAGE_START, *([IMAGE] * 5 + [IMAGE_NEW_LINE]) * 3, IMAGE_END]
    ids, types = expand_image_placeholders([9, 511, 10], 511, [grid])
    assert ids == [9] + [511] * 20 + [10] and types[0] == types[-1] == TEXT


@pytest.mark.parametrize("config", [CONFIG, VisionConfig()], ids=["tiny", "release"])
def test_every_size_and_aspect_ratio_fits_the_budget(config):
    p, ratio = config.patch_size, config.downsample_ratio
    sizes = [(w, h) for w in (1, 2, 3, 7, 31, 97, 513, 1920, 4001) for h in (1, 5, 17, 64, 333, 1080, 3999)]
    for width, height in sizes:
        grid = plan_image_grid(width, height, config)
        assert grid.num_tokens <= config.max_image_tokens, (width, height)
        assert (grid.height, grid.width) == (grid.rows * p, grid.cols * p), (width, height)
        assert (grid.token_rows, grid.token_cols) == (-(-grid.rows // ratio), -(-grid.cols // ratio))


def test_a_squeezed_image_keeps_at_most_max_wh_ratio():
    grid = plan_image_grid(4000, 10, CONFIG)
    assert grid.width / grid.height <= CONFIG.max_wh_ratio + CONFIG.patch_size / grid.height


# -- the encoder --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("golden", IMAGES, ids=IDS)
def test_encoder_equals_nemos(encoder, golden):
    rows, cols = golden["grid"][2:4]
    patches = golden["patches"].float()
    with torch.no_grad():
        states = encoder.vision(patches, rows, cols)
        tokens = encoder(patches, rows, cols)
        span = encoder.span_embeddings(tokens, *golden["grid"][4:6])
    torch.testing.assert_close(states, golden["vit_states"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tokens, golden["image_tokens"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(span, golden["span_embeddings"], rtol=1e-5, atol=1e-5)


def test_merge_pads_partial_cells_with_zeros():
    states = torch.arange(3 * 3 * 2, dtype=torch.float32).view(9, 2) + 1  # 3 x 3 patches, 2 channels
    cells = merge_cells(states, 3, 3, 2)
    assert cells.shape == (4, 8)
    # cell (0, 0): channel 0 of patches (0,0) (0,1) (1,0) (1,1), then channel 1 of the same
    assert cells[0].tolist() == [1, 3, 7, 9, 2, 4, 8, 10]
    assert cells[3].tolist() == [17, 0, 0, 0, 18, 0, 0, 0]  # only patch (2, 2) is in the last cell


def test_encoder_refuses_a_patch_count_that_is_not_the_grid(encoder):
    with pytest.raises(ValueError, match="a 2x3 patch grid needs 6 patches; got 5"):
        encoder(torch.zeros(5, 3, 4, 4), 2, 3)


# -- weights and config -------------------------------------------------------------------------------------------
def test_fp8_weights_are_dequantized_with_their_scale(encoder):
    tensors = {name: value.clone() for name, value in encoder.state_dict().items()}
    weight, scale = quantize_fp8(tensors["vision.blocks.0.attn.wqkv.weight"], 32, 32)
    tensors["vision.blocks.0.attn.wqkv.weight"], tensors["vision.blocks.0.attn.wqkv.scale"] = weight, scale
    tensors["layers.0.attn_norm.weight"] = torch.ones(3)  # a text tensor: not the encoder's, ignored
    other = VisionEncoder(CONFIG, TINY_V41["hidden_size"], torch.float32)
    load_vision_weights(other, tensors)
    assert torch.equal(other.vision.blocks[0].attn.wqkv.weight, dequantize(weight, scale, torch.float32))
    assert torch.equal(other.aligner.w2.bias, encoder.aligner.w2.bias)


def test_vision_weight_problems_are_all_named(encoder):
    tensors = dict(encoder.state_dict())
    del tensors["image_end"]
    tensors["aligner.w1.weight"] = torch.zeros(3, 3)
    tensors["vision.blocks.0.mlp.w2.weight"] = tensors["vision.blocks.0.mlp.w2.weight"].to(torch.float8_e4m3fn)
    tensors["vision.blocks.9.norm1.weight"] = torch.ones(32)
    other = VisionEncoder(CONFIG, TINY_V41["hidden_size"], torch.float32)
    with pytest.raises(ValueError) as error:
        load_vision_weights(other, tensors)
    message = str(error.value)
    assert "missing image_end" in message
    assert "aligner.w1.weight: shape (3, 3), the config needs (64, 128)" in message
    assert "vision.blocks.0.mlp.w2.weight: stored as torch.float8_e4m3fn without its scale" in message
    assert "unexpected vision.blocks.9.norm1.weight" in message


def test_text_model_skips_the_vision_tensors(tiny_vision_checkpoint):
    config = model_config(tiny_vision_checkpoint)
    assert config.vision_config == CONFIG and config.image_token_id == TINY_V41["vocab_size"] - 1
    naming = checkpoint_naming(config)
    assert naming.canonical("vision.norm.weight") is None and naming.canonical("model.image_start") is None
    assert naming.canonical("layers.0.attn_norm.weight") == "layers.0.attn_norm.weight"
    expected = {"embed.weight": ((TINY_V41["vocab_size"], TINY_V41["hidden_size"]), torch.float32)}
    with pytest.raises(ValueError) as error:  # only what the text model lacks is reported, no vision tensor
        plan_load(tiny_vision_checkpoint, expected, naming=naming)
    assert "vision." not in str(error.value) and "image_start" not in str(error.value)


def test_vision_config_parsing():
    assert VisionConfig.from_dict(None) is None
    assert VisionConfig.from_dict({"num_hidden_layers": 0}) is None
    assert VisionConfig.from_dict({}) == VisionConfig()  # the release's values
    with pytest.raises(ValueError, match="head size divisible by 4"):
        VisionConfig.from_dict({**TINY_VISION, "num_attention_heads": 16})  # head_dim 2
    with pytest.raises(ValueError, match="patch_size must be an integer"):
        VisionConfig.from_dict({**TINY_VISION, "patch_size": 4.5})
    with pytest.raises(ValueError, match="max_wh_ratio"):
        VisionConfig.from_dict({**TINY_VISION, "max_wh_ratio": 0.5})


def test_make_tiny_vision_needs_v41(tmp_path, capsys):
    with pytest.raises(SystemExit):
        make_tiny.main([str(tmp_path), "--arch", "v4", "--vision"])
    assert "--vision needs --arch v41" in capsys.readouterr().err


# -- image inputs ------------------------------------------------------------------------------------------------
def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_image_form_gives_the_same_patches():
    path = FIXTURE / IMAGES[0]["file"]
    data = path.read_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    forms = [path, str(path), data, bytearray(data), url, Image.open(path)]
    for form in forms:
        assert torch.equal(preprocess_image(form, CONFIG).patches, IMAGES[0]["patches"]), type(form)


def test_modes_convert_to_rgb():
    assert load_image(Image.new("L", (3, 2), 7)).getpixel((0, 0)) == (7, 7, 7)
    assert load_image(Image.new("RGBA", (3, 2), (1, 2, 3, 0))).getpixel((0, 0)) == (1, 2, 3)
    assert load_image(Image.new("CMYK", (3, 2))).mode == "RGB"


@pytest.mark.parametrize("source, message", [
    (b"not an image at all", "the image bytes is not a readable image"),
    (_png(Image.new("RGB", (64, 64), (9, 9, 9)))[:60], "truncated or corrupt"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/png,rawbytes", "must be base64"),
    ("/no/such/image.png", "cannot read image file '/no/such/image.png'"),
    ("https://example.com/cat.png", "are not fetched"),
    (Image.new("F", (4, 4)), "mode 'F'"),
    (Image.new("I;16", (4, 4)), "mode 'I;16'"),
])
def test_bad_images_raise_a_value_error_naming_the_problem(source, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_image(source)


def test_a_truncated_file_is_named(tmp_path):
    path = tmp_path / "cut.png"
    path.write_bytes((FIXTURE / IMAGES[-1]["file"]).read_bytes()[:200])
    with pytest.raises(ValueError, match=r"image file '.*cut\.png' is not a readable image"):
        preprocess_image(path, CONFIG)


def test_other_inputs_are_type_errors():
    with pytest.raises(TypeError, match="got int"):
        load_image(3)


def test_placeholders_must_match_the_images():
    grid = plan_image_grid(40, 24, CONFIG)
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        expand_image_placeholders([511, 3, 511], 511, [grid])


def test_empty_images_are_refused():
    with pytest.raises(ValueError, match="positive size; got 0x5"):
        plan_image_grid(0, 5, CONFIG)
    with pytest.raises(ValueError, match=r"is empty \(0x5\)"):
        load_image(Image.new("RGB", (0, 5)))


def test_the_text_engine_serves_a_checkpoint_with_a_vision_tower(tiny_vision_checkpoint):
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(tiny_vision_checkpoint), dtype="float32")
    out = llm.generate([[0, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
