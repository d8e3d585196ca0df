"""DeepSeek-V4.1 image inputs through the engine against NeMo AutoModel's whole model (``generation`` in the golden
file ``tools/goldens/v41_vision_golden.py`` wrote from ``make_tiny --vision``'s checkpoint): prefill logits and
greedy continuations for prompts with one and two images of different sizes and aspects, also when a prefill
chunk splits an image span, when requests are preempted, and in a batch with text-only requests; prefix-cache
sharing by image; the inputs it refuses."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.chat_encoding import IMAGE_PLACEHOLDER, encode_chat  # noqa: E402
from deepinfer.runtime.request import Request  # noqa: E402
from deepinfer.runtime.scheduled import ScheduledBatch, ScheduledRequest  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "v41_vision"
GENERATION = torch.load(FIXTURE / "golden.pt", weights_only=True)["generation"]
IDS = ["+".join(g["images"]) for g in GENERATION]
# as tests/test_parity_v41.py bounds the text model's logits (measured here: relative error <= 5e-6)
LOGITS_BOUND = 1e-3
GREEDY = SamplingParams(temperature=0, max_tokens=len(GENERATION[0]["greedy"]), ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_vision_checkpoint):
    return LLM(str(tiny_vision_checkpoint), dtype="float32", quantization="none")


@pytest.fixture(scope="module")
def small_steps(tiny_vision_checkpoint):
    """Blocks of 8 tokens, steps of at most 16: every image span is split across prefill chunks and blocks."""
    return LLM(str(tiny_vision_checkpoint), dtype="float32", quantization="none", block_size=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def short(tiny_vision_checkpoint):
    return LLM(str(tiny_vision_checkpoint), dtype="float32", quantization="none", max_model_len=64)


def image_prompt(gold: dict) -> dict:
    return {"prompt_token_ids": gold["raw_ids"], "multi_modal_data": {"image": [str(FIXTURE / f) for f in
                                                                                  gold["images"]]}}


def greedy(llm, prompts, max_tokens: int = GREEDY.max_tokens) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@torch.inference_mode()
def prefill_logits(llm, gold: dict) -> torch.Tensor:
    engine = llm.engine
    token_ids, images = engine.prepare_images(gold["raw_ids"], [FIXTURE / f for f in gold["images"]], "probe")
    assert token_ids == gold["input_ids"]
    request = Request("probe", 0, None, token_ids, SamplingParams(), (), images=images)
    assert engine.blocks.reserve(request.tables, 0, len(token_ids))
    try:
        batch = engine.batch_builder.build(ScheduledBatch([ScheduledRequest.of(request, 0, len(token_ids))]))
        return engine.model.compute_logits(engine.model(batch, engine.cache).hidden)
    finally:
        engine.blocks.free(request.tables)


@pytest.mark.parametrize("gold", GENERATION, ids=IDS)
def test_prefill_logits_match_nemo(llm, gold):
    ours = prefill_logits(llm, gold)
    rel = float((ours - gold["logits"]).norm() / gold["logits"].norm())
    assert rel < LOGITS_BOUND, f"relative error {rel:.2e}"


def test_image_tokens_route_by_bias_vl(llm):
    """Without ``bias_vl`` for image tokens the logits move far past the bound: the parity above sees routing."""
    gold = GENERATION[0]
    saved = [layer.ffn.gate.bias_vl.clone() for layer in llm.engine.model.layers]
    for layer in llm.engine.model.layers:
        layer.ffn.gate.bias_vl.copy_(layer.ffn.gate.bias)
    try:
        ours = prefill_logits(llm, gold)
    finally:
        for layer, bias in zip(llm.engine.model.layers, saved):
            layer.ffn.gate.bias_vl.copy_(bias)
    assert float((ours - gold["logits"]).norm() / gold["logits"].norm()) > 100 * LOGITS_BOUND


def test_greedy_matches_nemo_in_a_batch_with_text_only_requests(llm):
    text = [0, 9, 8, 7, 6, 5, 4, 3]
    alone = greedy(llm, [text])[0]
    outputs = greedy(llm, [image_prompt(GENERATION[0]), text, *map(image_prompt, GENERATION[1:])])
    assert outputs[1] == alone
    assert [outputs[0], *outputs[2:]] == [g["greedy"] for g in GENERATION]


def test_chunked_prefill_splitting_images_and_prefix_cache_by_image(small_steps):
    engine = small_steps.engine
    assert greedy(small_steps, [image_prompt(g) for g in GENERATION]) == [g["greedy"] for g in GENERATION]
    # a full block of text, then an image: the same ids and image again share every full block before the last
    # token; the same ids with a different image of the same size share only the block before the image
    gradient = Image.open(FIXTURE / "gradient_40x24.png")
    raw = [0, *range(20, 29), engine.model_config.image_token_id, 7, 8, 9]
    prompts = [{"prompt_token_ids": raw, "multi_modal_data": {"image": image}}
               for image in (gradient, gradient, gradient.transpose(Image.Transpose.FLIP_LEFT_RIGHT))]
    cached, encoded, tokens = [], [], []
    for prompt in prompts:
        output = small_steps.generate(prompt, GREEDY, use_tqdm=False)[0]
        cached.append(output.metrics.num_cached_tokens)
        encoded.append(engine.counters()["images_encoded"])
        tokens.append(output.outputs[0].token_ids)
    length = len(output.prompt_token_ids)
    assert cached == [0, (length - 1) // 8 * 8, 8]  # the second resumes inside the image's span
    assert tokens[1] == tokens[0] != tokens[2]
    assert encoded[1] == encoded[0] and encoded[2] == encoded[0] + 1  # the same image is encoded once


def test_preempted_requests_recompute_their_images(tiny_vision_checkpoint):
    tight = LLM(str(tiny_vision_checkpoint), dtype="float32", quantization="none", block_size=8, num_cache_tokens=96,
                enable_prefix_caching=False)
    assert greedy(tight, [image_prompt(g) for g in GENERATION]) == [g["greedy"] for g in GENERATION]
    assert tight.engine.counters()["preemptions"] > 0


def test_context_parallel_ranks_keep_image_prompts_greedy(tiny_vision_checkpoint):
    """Two context-parallel ranks (Gloo on the CPU), each computing a zigzag share of every 16-token step: each
    rank's image rows carry their embeddings, and the greedy tokens are NeMo's."""
    with LLM(str(tiny_vision_checkpoint), dtype="float32", quantization="none", device="cpu",
             context_parallel_size=2, max_num_batched_tokens=16) as ranks:
        assert greedy(ranks, [image_prompt(g) for g in GENERATION]) == [g["greedy"] for g in GENERATION]


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def test_chat_image_parts_are_placeholders_between_blank_lines(llm):
    gradient = FIXTURE / "gradient_40x24.png"
    chat = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": data_url(gradient)}}]}]
    text = encode_chat([{"role": "user", "content": f"look\n\n{IMAGE_PLACEHOLDER}"}])
    pieces = [llm.tokenizer.encode(piece, add_special_tokens=False) for piece in text.split(IMAGE_PLACEHOLDER)]
    raw = pieces[0] + [llm.engine.model_config.image_token_id] + pieces[1]
    expected = llm.generate({"prompt_token_ids": raw, "multi_modal_data": {"image": Image.open(gradient)}}, GREEDY,
                            use_tqdm=False)[0]
    answer = llm.chat(chat, GREEDY, use_tqdm=False)[0]
    assert answer.prompt_token_ids == expected.prompt_token_ids
    assert answer.outputs[0].token_ids == expected.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[0\].*content parts"):
        llm.chat([{"role": "user", "content": f"see {IMAGE_PLACEHOLDER}"}], GREEDY, use_tqdm=False)


def test_text_prompts_take_placeholders_and_bytes(llm):
    gradient = FIXTURE / "gradient_40x24.png"
    out = llm.generate({"prompt": f"a{IMAGE_PLACEHOLDER}b", "multi_modal_data": {"image": gradient.read_bytes()}},
                       GREEDY, use_tqdm=False)[0]
    image_token = llm.engine.model_config.image_token_id
    assert out.prompt_token_ids.count(image_token) == 20  # the golden's span of this image


def truncated_png() -> bytes:
    return (FIXTURE / "gradient_40x24.png").read_bytes()[:60]


def sixteen_bit() -> Image.Image:
    return Image.new("I;16", (16, 16))


@pytest.mark.parametrize("images, raw, says", [
    ([truncated_png()], None, r"prompts\[1\] image 0: .*not a readable image"),
    ([FIXTURE / "dot_1x1.png", sixteen_bit()], "two", r"prompts\[1\] image 1: .*mode 'I;16'"),
    ([FIXTURE / "dot_1x1.png"] * 2, None, r"prompts\[1\]: the prompt has 1 image placeholders but 2 images"),
    ([], "two", r"prompts\[1\]: the prompt contains the image token 511 but no image"),
    ([FIXTURE / "tall_6x400.png"] * 2, "two", r"prompts\[1\] has 99 tokens \(image 1 reaching position 97\), "
                                               r"max_model_len is 64"),
])
def test_bad_image_inputs_name_the_prompt_and_image_and_lose_nothing(short, images, raw, says):
    image_token = short.engine.model_config.image_token_id
    ids = [0, image_token, 5, image_token, 6] if raw == "two" else [0, image_token, 5]
    good = image_prompt(GENERATION[0])
    with pytest.raises(ValueError, match=says):
        short.generate([good, {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], GREEDY,
                       use_tqdm=False)
    assert not short.engine.has_unfinished()
    assert greedy(short, [good], 2) == [GENERATION[0]["greedy"][:2]]


def test_images_for_a_text_only_model_are_refused():
    text_only = LLM(str(Path(__file__).parent / "fixtures" / "v41_tiny"), dtype="float32", quantization="none")
    with pytest.raises(ValueError, match=r"prompts\[0\] image 0: .* has no vision tower"):
        text_only.generate({"prompt": "x", "multi_modal_data": {"image": FIXTURE / "dot_1x1.png"}}, use_tqdm=False)


def test_cli_generate_image(llm, tiny_vision_checkpoint, capsys):
    from deepinfer.cli import main

    dot = FIXTURE / "dot_1x1.png"
    main(["generate", "--model", str(tiny_vision_checkpoint), "--dtype", "float32", "--quantization", "none", "--max-tokens", "4",
          "--ignore-eos", "--json", "--image", str(dot), "hi"])
    printed = json.loads(capsys.readouterr().out.splitlines()[0])
    expected = greedy(llm, [{"prompt": f"{IMAGE_PLACEHOLDER}hi", "multi_modal_data": {"image": dot}}], 4)[0]
    assert printed["prompt"] == f"{IMAGE_PLACEHOLDER}hi"
    assert printed["outputs"][0]["token_ids"] == expected
    assert greedy(llm, ["hi"], 4)[0] != expected  # the image was read


def test_structured_outputs_hold_for_image_prompts(tiny_vision_checkpoint):
    plugin = pytest.importorskip("deepinfer_structured_outputs.plugin", reason="features/structured_outputs is not "
                                 "installed (build.sh installs it)")
    from deepinfer.plugins.manager import registered

    with registered(plugin, "structured_outputs"):
        llm = LLM(str(tiny_vision_checkpoint), dtype="float32", quantization="none")
        llm.engine.structured_outputs()
    params = SamplingParams(temperature=0, max_tokens=12, so_args={"schema_type": "regex", "schema": "(yes|no)!"})
    output = llm.generate(image_prompt(GENERATION[0]), params, use_tqdm=False)[0].outputs[0]
    assert output.text in ("yes!", "no!")


def test_speculative_decoding_keeps_image_prompts_lossless(tiny_vision_dspark_checkpoint):
    """DSpark drafts (random stages: they are proposed and rejected) leave the greedy outputs of image prompts, in a
    batch with a text-only one, exactly the target's."""
    plugin = pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")
    from deepinfer.plugins.manager import registered

    prompts = [image_prompt(g) for g in GENERATION] + ["a text-only prompt"]
    model = str(tiny_vision_dspark_checkpoint)
    plain = greedy(LLM(model, dtype="float32", quantization="none"), prompts, 12)
    with registered(plugin, "mtp"):
        llm = LLM(model, dtype="float32", quantization="none", enable_mtp_varlen=False)
    assert llm.engine.speculator is not None
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain
    assert all(o.metrics.num_draft_tokens > 0 for o in outputs)
