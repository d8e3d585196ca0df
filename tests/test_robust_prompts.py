"""Prompts drawn by hypothesis (text with control characters, token-id lists, mixed batches; and broken ones:
out-of-vocabulary or negative ids, bools, bytes, lone surrogates, empty lists): a batch either runs, its outputs in
input order and each equal to the prompt run alone, or is refused naming the prompt, before any request starts."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
VOCAB = 3072  # the embedded model's

TEXT = st.text(st.characters(codec="utf-8", categories=("Cc", "Lu", "Ll", "Nd", "Zs", "So")), max_size=12)
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)


@pytest.fixture(scope="module")
def llm():
    # float32: the greedy comparison against single-request runs should not hinge on bf16 rounding
    return LLM("deepinfer-tiny-v4.1", dtype="float32")


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy tokens when it runs by itself (memoized: hypothesis repeats prompts)."""
    seen = {}

    def run(prompt):
        key = prompt if isinstance(prompt, str) else tuple(prompt)
        if key not in seen:
            seen[key] = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        return seen[key]
    return run


@settings(max_examples=3, deadline=None, derandomize=True)
@given(prompts=st.lists(st.one_of(TEXT, TOKEN_IDS), min_size=1, max_size=2))
def test_valid_batches_run_in_input_order(llm, alone, prompts):
    given_prompts = [p if isinstance(p, str) else list(p) for p in prompts]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert prompts == given_prompts  # the caller's lists are not changed
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        if isinstance(prompt, str):
            assert output.prompt == prompt
            assert output.prompt_token_ids == llm.tokenizer.encode(prompt)
        else:
            assert output.prompt is None and output.prompt_token_ids == prompt
        assert output.finished and len(output.outputs[0].token_ids) == 2
        assert output.outputs[0].token_ids == alone(prompt)


# (a broken prompt, a pattern its message must match once its place in the batch is known)
BROKEN = st.one_of(
    st.tuples(st.integers(0, 4), st.integers(VOCAB, 2**70)).map(
        lambda p: ([1] * p[0] + [p[1]], rf"prompts\[{{i}}\].*\({p[0]}, {p[1]}\)")),
    st.integers(-2**70, -1).map(lambda t: ([5, t], rf"prompts\[{{i}}\].*\(1, {t}\)")),
    st.just(([], r"prompts\[{i}\] is empty")),
    st.just(([3, True], r"prompts\[{i}\].*element 1 is True")),
    st.just(([3, 2.0], r"prompts\[{i}\].*element 1 is 2\.0")),
    st.just((b"abc", r"prompts\[{i}\].*bytes")),
    st.just(("ok\ud800", r"prompts\[{i}\] is not valid Unicode.*character 2")),
    st.just(([[1]], r"prompts\[{i}\].*element 0 is \[1\]")),
)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(before=st.lists(TEXT, max_size=2), broken=BROKEN, after=st.lists(TOKEN_IDS, max_size=2))
def test_a_broken_prompt_is_refused_by_index_before_any_starts(llm, before, broken, after):
    prompt, pattern = broken
    with pytest.raises(ValueError, match=pattern.format(i=len(before))):
        llm.generate(before + [prompt] + after, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the valid prompts before it were not left queued


@pytest.mark.parametrize("prompts, message", [
    (b"hello", "got bytes"),
    ([], "non-empty list"),
    (None, "non-empty list"),
    ([True, 2], r"prompts\[0\] must be .*got bool"),
])
def test_whole_prompt_argument_refused(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)


def test_prompt_longer_than_max_model_len_is_named():
    short = LLM("deepinfer-tiny-v4.1", max_model_len=8, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=re.escape("prompts[1] has 9 tokens, max_model_len is 8")):
        short.generate([[1, 2], list(range(9))], GREEDY, use_tqdm=False)
    assert not short.engine.has_unfinished()
