"""Image content parts through ``deepinfer serve``: a V4.1 checkpoint with a vision tower answers a chat with an
image as offline ``LLM.chat`` does; a text-only model refuses the image with a 400 naming ``messages``."""

import base64
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("PIL")

from deepinfer import LLM, SamplingParams  # noqa: E402

from test_serve import _client, _serve, _stop, client, server  # noqa: E402, F401 (fixtures)

IMAGE = Path(__file__).parent / "fixtures" / "v41_vision" / "banner_120x32.png"
DATA_URL = "data:image/png;base64," + base64.b64encode(IMAGE.read_bytes()).decode()


def _image_chat(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}},
                                         {"type": "text", "text": text}]}]


def test_a_chat_image_is_answered_as_offline_chat_answers_it(tiny_vision_checkpoint):
    loop, uv, thread, url = _serve(["--model", str(tiny_vision_checkpoint)])
    try:
        reply = _client(url).chat.completions.create(model=str(tiny_vision_checkpoint), messages=_image_chat("What?"),
                                                     max_tokens=6, temperature=0)
    finally:
        _stop(uv, thread, loop)
    offline = LLM(str(tiny_vision_checkpoint), dtype="float32")
    (expected,) = offline.chat(_image_chat("What?"), SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids) > 20  # the image's span was expanded


def test_a_text_only_model_refuses_an_image_part_naming_messages(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="deepinfer-tiny-v4.1", messages=_image_chat("What?"), max_tokens=4)
    error = refused.value.body
    assert "image" in error["message"] and error["message"].startswith("messages")


def test_a_malformed_content_part_is_a_400_naming_messages(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="deepinfer-tiny-v4.1", max_tokens=4,
                                       messages=[{"role": "user", "content": [{"type": "audio", "audio": "x"}]}])
    assert refused.value.body["param"] == "messages" and "content[0]" in refused.value.body["message"]
