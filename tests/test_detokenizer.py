import random
import shutil

import pytest
from transformers import AutoTokenizer

from deepinfer.loading.tokenizer import IncrementalDetokenizer, load_tokenizer
from deepinfer.testing.tiny_tokenizer import build_tiny_tokenizer

MULTILINGUAL = "héllo 世界, naïve café → ✓ 日本語 done"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detokenizer, token_ids, chunk=1):
    """Feed ids ``chunk`` at a time; return the deltas and the stop string (if any)."""
    deltas = []
    for start in range(0, len(token_ids), chunk):
        step = detokenizer.update(token_ids[start : start + chunk])
        deltas.append(step.text_delta)
        if step.stop_string is not None:
            return deltas, step.stop_string
    step = detokenizer.finish()
    deltas.append(step.text_delta)
    return deltas, step.stop_string


def test_tiny_tokenizer_layout_and_bos(tokenizer):
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert len(tokenizer) == 512
    ids = tokenizer.encode("<｜User｜>hi<｜Assistant｜><think>")
    assert ids[0] == 0 and ids.count(0) == 1
    assert tokenizer.decode(ids[1:]) == "<｜User｜>hi<｜Assistant｜><think>"


def test_tiny_tokenizer_is_deterministic(tmp_path, tokenizer_dir):
    build_tiny_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


def test_load_tokenizer_from_bare_tokenizer_json(tmp_path, tokenizer_dir):
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    # A tokenizer config AutoTokenizer cannot read.
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(Exception):
        AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.decode(encode(tokenizer, MULTILINGUAL)) == MULTILINGUAL


def test_load_tokenizer_names_the_directory(tmp_path):
    with pytest.raises(ValueError) as empty_dir:
        load_tokenizer(tmp_path)
    assert str(empty_dir.value).startswith(f"cannot load a tokenizer from {tmp_path}: AutoTokenizer failed")
    assert str(empty_dir.value).endswith("and there is no tokenizer.json")
    with pytest.raises(ValueError) as missing_dir:
        load_tokenizer(tmp_path / "missing")
    assert str(missing_dir.value) == f"cannot load a tokenizer from {tmp_path / 'missing'}: not a directory"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("read_text", ["at the end", "every step"])
def test_incremental_equals_full_decode_on_random_ids(tokenizer, skip_special_tokens, read_text):
    """Without stop strings the ids wait until the text is read: read at the end (``generate``) or after every step
    (``LLM.stream``), the text is the full decode's, and what was read before is a prefix of it."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        chunk, seen = rng.randrange(1, 4), []
        for start in range(0, len(ids), chunk):
            assert detokenizer.update(ids[start:start + chunk]).stop_string is None
            if read_text == "every step":
                seen.append(detokenizer.text)
        detokenizer.finish()
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detokenizer.text == expected
        assert all(expected.startswith(text) for text in seen)
        assert seen == sorted(seen, key=len)


def test_multibyte_text_never_emits_partial_characters(tokenizer):
    prompt = encode(tokenizer, "Translate: ")
    ids = encode(tokenizer, MULTILINGUAL)
    # The vocabulary has tokens that end inside a character, so holding back is exercised.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas, _ = stream(detokenizer, ids)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == MULTILINGUAL


def test_stop_string_split_across_tokens(tokenizer):
    ids = encode(tokenizer, "Hello world, stop here please")
    assert len(encode(tokenizer, "stop here")) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["stop here"])
    deltas, stop = stream(detokenizer, ids)
    assert stop == "stop here"
    # Nothing of the stop string leaked out in an earlier delta.
    assert "".join(deltas) == detokenizer.text == "Hello world, "
    assert detokenizer.finished


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_stop_string_at_the_very_end(tokenizer, chunk):
    ids = encode(tokenizer, "answer: 世界 END")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["END"])
    deltas, stop = stream(detokenizer, ids, chunk)
    assert stop == "END"
    assert "".join(deltas) == "answer: 世界 "


def test_include_stop_str_in_output(tokenizer):
    ids = encode(tokenizer, "one, two, 世界 three")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["世界"], include_stop_str_in_output=True)
    deltas, stop = stream(detokenizer, ids)
    assert stop == "世界"
    assert "".join(deltas) == detokenizer.text == "one, two, 世界"


def test_partial_stop_prefix_is_not_a_stop_and_is_released(tokenizer):
    ids = encode(tokenizer, "abc stoa and sto")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["stop"])
    deltas, stop = stream(detokenizer, ids)
    assert stop is None
    assert "".join(deltas) == detokenizer.text == "abc stoa and sto"


def test_first_completed_stop_wins_within_one_step(tokenizer):
    ids = encode(tokenizer, "hello world")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["world", "lo w"])
    step = detokenizer.update(ids)
    assert step == ("hel", "lo w")


def test_stop_strings_in_the_prompt_are_ignored(tokenizer):
    prompt = encode(tokenizer, "say STOP now")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop=["STOP", "now"])
    deltas, stop = stream(detokenizer, encode(tokenizer, " and then STOP"))
    assert stop == "STOP"
    assert "".join(deltas) == " and then "


def test_no_tokens_after_a_stop(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["x"])
    assert detokenizer.update(encode(tokenizer, "ax")).stop_string == "x"
    with pytest.raises(RuntimeError):
        detokenizer.update(encode(tokenizer, "b"))


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = encode(tokenizer, "<think>plan</think>answer")
    skipped = IncrementalDetokenizer(tokenizer)
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream(skipped, ids)[0]) == "plananswer"
    assert "".join(stream(kept, ids)[0]) == "<think>plan</think>answer"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_ids_to_text_matches_decode_and_respects_an_overridden_decode(tokenizer, skip_special_tokens):
    """The Rust fast path gives what ``decode`` gives (the embedded model's tokenizer too), and a tokenizer class
    with its own ``_decode`` keeps it."""
    from transformers import PreTrainedTokenizerFast

    from deepinfer.loading.model_source import EMBEDDED_MODEL_DIR
    from deepinfer.loading.tokenizer import ids_to_text

    rng = random.Random(1)
    for tok in (tokenizer, load_tokenizer(EMBEDDED_MODEL_DIR)):
        decode = ids_to_text(tok, skip_special_tokens)
        for _ in range(100):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
            assert decode(ids) == tok.decode(ids, skip_special_tokens=skip_special_tokens,
                                             clean_up_tokenization_spaces=False)

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=tokenizer.backend_tokenizer)
    ids = encode(tokenizer, "hello world")
    assert ids_to_text(shouting, skip_special_tokens)(ids) == "HELLO WORLD"
