"""A draft vocabulary (``loading/draft_vocab.py``, ``EngineConfig.draft_vocab``): DSpark drafts only its tokens,
outputs stay the target's, the whole vocabulary drafts what no file drafts, bad files and misplaced options are
refused by name, and ``deepinfer draft-vocab`` writes a corpus's most frequent tokens."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from deepinfer import LLM, SamplingParams, envs
from deepinfer.loading.draft_vocab import most_frequent_tokens, read_draft_vocab
from deepinfer.plugins.manager import PluginError, registered

mtp = pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")

PROMPTS = ["def fibonacci(n):", "import os\n", '"""Return the']
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for name in ("DEEPINFER_ENABLE_MTP_VARLEN", "DEEPINFER_DRAFT_VOCAB"):
        monkeypatch.delenv(name, raising=False)
    envs.reload()
    yield
    envs.reload()


def _embedded(**engine_args) -> LLM:
    # fp32 and dequantized weights: outputs exactly those of decoding without drafts (tests/test_dspark.py's EXACT)
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        return LLM("deepinfer-tiny-v4.1", dtype="float32", quantization="none", **engine_args)


def _run(llm: LLM) -> tuple[list[list[int]], list[list[int]], tuple[int, int]]:
    """Each prompt's tokens, every draft token proposed, and (drafts, accepted tokens)."""
    proposed = []
    drafter = llm.engine.speculator.drafter
    real = drafter._draft

    def draft(inputs):  # the host's draft passes and the overlapped steps' alike
        tokens, confidences = real(inputs)
        proposed.extend(tokens.tolist())
        return tokens, confidences

    drafter._draft = draft
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.engine.speculator.stats
    return [o.outputs[0].token_ids for o in outputs], proposed, (stats.num_drafts, stats.num_accepted_tokens)


def _vocab_file(tmp_path, ids) -> str:
    path = tmp_path / "draft_vocab.txt"
    path.write_text("# test\n" + "\n".join(map(str, ids)) + "\n")
    return str(path)


def test_the_whole_vocabulary_drafts_what_no_file_drafts(tmp_path):
    plain = _run(_embedded(enable_mtp_varlen=False))
    vocab = _embedded(enable_mtp_varlen=False).engine.model_config.vocab_size
    every = _run(_embedded(enable_mtp_varlen=False, draft_vocab=_vocab_file(tmp_path, reversed(range(vocab)))))
    assert every == plain and plain[2][1] > 0


@pytest.mark.parametrize("graphs", [{}, {"cuda_graphs": "padded-eager"}], ids=["synchronous", "overlapped"])
def test_drafts_come_from_the_file_and_outputs_stay_the_target_s(tmp_path, graphs):
    """Half the tokens the unrestricted drafter proposes are left out: no draft is one of them (in the host's
    passes and in the overlapped steps' device tails), greedy outputs are decoding without drafts', and fewer
    drafts are accepted."""
    outputs_plain = LLM("deepinfer-tiny-v4.1", dtype="float32", quantization="none").generate(
        PROMPTS, GREEDY, use_tqdm=False)
    free = _run(_embedded(enable_mtp_varlen=False, **graphs))
    proposed = sorted({t for draft in free[1] for t in draft})
    left_out = set(proposed[::2])
    vocab = _embedded(enable_mtp_varlen=False).engine.model_config.vocab_size
    kept = [t for t in range(vocab) if t not in left_out]
    restricted = _run(_embedded(enable_mtp_varlen=False, draft_vocab=_vocab_file(tmp_path, kept), **graphs))
    assert not {t for draft in restricted[1] for t in draft} & left_out
    assert restricted[0] == [o.outputs[0].token_ids for o in outputs_plain] == free[0]
    assert restricted[2][1] < free[2][1]


@pytest.mark.parametrize("content, problem", [
    ("1\n2\nx3\n", "line 3: 'x3' is not a token id"),
    ("1 2\n2\n", "line 2: token id 2 is listed twice"),
    ("5\n99999999\n", "line 2: token id 99999999 is outside the model's vocabulary"),
    ("# nothing\n", "lists no token id"),
])
def test_a_bad_file_is_refused_naming_the_line(tmp_path, content, problem):
    path = tmp_path / "vocab.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=problem):
        read_draft_vocab(path, 1000)
    with pytest.raises(PluginError, match=problem):  # the drafter plugin reads it, and names itself
        _embedded(enable_mtp_varlen=False, draft_vocab=str(path))


def test_a_missing_file_is_refused_and_a_run_without_drafts_says_it_is_unused(tmp_path, caplog):
    """Without drafts the option is a detail of nothing, as DEEPINFER_USE_NEXTN_DECODE is: the engine runs (a
    bench's run without drafts shares the others' environment) and says the file is unused."""
    with pytest.raises(PluginError, match="is not a file"):
        _embedded(enable_mtp_varlen=False, draft_vocab=str(tmp_path / "absent.txt"))
    with caplog.at_level(logging.WARNING):
        llm = _embedded(draft_vocab=_vocab_file(tmp_path, [1, 2, 3]))
    assert llm.engine.speculator is None
    assert any("is unused" in r.getMessage() and "draft_vocab" in r.getMessage() for r in caplog.records)


def test_classic_mtp_drafts_refuse_a_draft_vocabulary(tmp_path):
    from deepinfer.testing.tiny_v4 import add_mtp_layer, build_tiny_v4

    checkpoint = add_mtp_layer(build_tiny_v4(tmp_path / "tiny_v4_mtp"))
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        with pytest.raises(PluginError, match="classic MTP, which takes none"):
            LLM(str(checkpoint), dtype="float32", enable_mtp_varlen=False, num_speculative_tokens=2,
                draft_vocab=_vocab_file(tmp_path, [1, 2, 3]))


def test_the_variable_sets_the_option(monkeypatch, tmp_path):
    path = _vocab_file(tmp_path, [1, 2])
    monkeypatch.setenv("DEEPINFER_DRAFT_VOCAB", path)
    envs.reload()
    from deepinfer.engine.config import EngineConfig

    assert str(EngineConfig().draft_vocab) == path


def test_most_frequent_tokens_keep_the_always_ones_first_then_count_then_id():
    texts = ["a b b c", "c c d"]
    assert most_frequent_tokens(texts, str.split, 3) == ["c", "b", "a"]
    assert most_frequent_tokens(texts, str.split, 2, always=["z"]) == ["z", "c"]
    with pytest.raises(ValueError, match="at least one token"):
        most_frequent_tokens(texts, str.split, 0)


def test_the_command_writes_a_file_the_engine_reads(tmp_path, capsys):
    from deepinfer.cli import main

    corpus = tmp_path / "corpus.py"
    corpus.write_text("def f(x):\n    return x + 1\n\nfor i in range(3):\n    print(f(i))\n")
    out = tmp_path / "vocab.txt"
    main(["draft-vocab", "--corpus", str(corpus), "--size", "12", "--output", str(out)])
    assert "wrote 12 token ids" in capsys.readouterr().out
    ids = read_draft_vocab(out, 1 << 20)
    llm = _embedded(enable_mtp_varlen=False, draft_vocab=str(out))
    assert llm.engine.model_config.eos_token_id in ids.tolist() or llm.engine.tokenizer.eos_token_id in ids.tolist()
    assert torch.equal(llm.engine.speculator.drafter.vocabulary.cpu(), ids)
