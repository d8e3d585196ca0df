import math

import pluggy
import pytest
import torch

import deepinfer.plugins.hookspecs as hookspecs
from deepinfer.plugins.builtin import torch_sampler
from deepinfer.plugins.builtin.torch_sampler import TorchSampler
from deepinfer.plugins.interfaces import SamplingBatch

VOCAB = 32


def make_batch(rows: int, **overrides) -> SamplingBatch:
    """A batch of ``rows`` plain temperature-1 rows; keyword arguments give per-row values."""

    def column(name, default, dtype):
        value = overrides.pop(name, default)
        return torch.tensor(value if isinstance(value, list) else [value] * rows, dtype=dtype)

    fields = dict(
        temperature=column("temperature", 1.0, torch.float32),
        top_k=column("top_k", 0, torch.int64),
        top_p=column("top_p", 1.0, torch.float32),
        min_p=column("min_p", 0.0, torch.float32),
        presence_penalty=column("presence_penalty", 0.0, torch.float32),
        frequency_penalty=column("frequency_penalty", 0.0, torch.float32),
        repetition_penalty=column("repetition_penalty", 1.0, torch.float32),
        seeds=column("seeds", -1, torch.int64),
        positions=column("positions", 0, torch.int64),
        prompt_token_ids=overrides.pop("prompt_token_ids", [[] for _ in range(rows)]),
        output_token_ids=overrides.pop("output_token_ids", [[] for _ in range(rows)]),
        blocked_token_ids=overrides.pop("blocked_token_ids", [[] for _ in range(rows)]),
        num_logprobs=overrides.pop("num_logprobs", 0),
    )
    assert not overrides, overrides
    fields["all_greedy"] = bool((fields["temperature"] == 0).all())
    fields["any_penalties"] = bool(
        (fields["presence_penalty"] != 0).any()
        or (fields["frequency_penalty"] != 0).any()
        or (fields["repetition_penalty"] != 1).any()
    )
    return SamplingBatch(**fields)


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_hook_deepinfer_sampler():
    pm = pluggy.PluginManager("deepinfer")
    pm.add_hookspecs(hookspecs)
    pm.register(torch_sampler)
    sampler = pm.hook.deepinfer_sampler(config=None, device="cpu")
    assert isinstance(sampler, TorchSampler)
    assert sampler.name == "torch-reference"


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    logits = random_logits(6)
    out = TorchSampler().sample(logits, make_batch(6, temperature=0.0, num_logprobs=3))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    values, ids = raw.topk(3, dim=-1)
    assert torch.equal(out.top_logprob_ids, ids)
    assert torch.allclose(out.top_logprobs, values)


def test_no_logprobs_requested_gives_none_and_minus_one_gives_whole_vocab():
    logits = random_logits(2)
    out = TorchSampler().sample(logits, make_batch(2))
    assert out.top_logprob_ids is None and out.top_logprobs is None
    out = TorchSampler().sample(logits, make_batch(2, num_logprobs=-1))
    assert out.top_logprobs.shape == (2, VOCAB)


def test_logprobs_stay_raw_when_sampling_is_filtered():
    logits = random_logits(4)
    batch = make_batch(4, temperature=0.3, top_k=2, repetition_penalty=1.5, prompt_token_ids=[[1, 2]] * 4)
    out = TorchSampler().sample(logits, batch)
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_tightest_filters_are_greedy(filters):
    logits = random_logits(64)
    out = TorchSampler().sample(logits, make_batch(64, temperature=1.5, **filters))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_and_top_p_keep_only_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    out = TorchSampler().sample(logits, make_batch(2000, top_k=[2] * 1000 + [0] * 1000, top_p=[1.0] * 1000 + [0.7] * 1000))
    assert set(out.token_ids[:1000].tolist()) == {0, 1}
    # top_p 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it.
    assert set(out.token_ids[1000:].tolist()) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_the_best():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    out = TorchSampler().sample(torch.log(probs).repeat(3000, 1), make_batch(3000, min_p=0.6))
    assert set(out.token_ids.tolist()) == {0, 1}  # 0.2 < 0.6 * 0.4 <= 0.3


def test_blocked_tokens_are_never_chosen():
    logits = torch.zeros(1, 4)
    logits[0, 3] = 10.0
    out = TorchSampler().sample(logits, make_batch(1, temperature=0.0, blocked_token_ids=[[3]]))
    assert out.token_ids.item() != 3


@pytest.mark.parametrize("edits", [{}, {"blocked_token_ids": [[3], []]}, {"repetition_penalty": 1.5,
                                                                         "output_token_ids": [[1, 2], [0]]}])
def test_the_callers_logits_are_left_alone(edits):
    logits = random_logits(2, seed=4)
    kept = logits.clone()
    TorchSampler().sample(logits, make_batch(2, temperature=0.7, top_k=5, **edits))
    assert torch.equal(logits, kept)


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.5, -0.5, 0.0]])
    batch = make_batch(
        1,
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        prompt_token_ids=[[0, 1]],
        output_token_ids=[[2, 2, 4]],
    )
    expected = torch.tensor([
        [
            2.0 / 2,  # prompt token: positive logit divided
            -1.0 * 2,  # prompt token: negative logit multiplied
            0.5 / 2 - 2 * 0.5 - 0.25,  # generated twice: repetition, then frequency x2 and presence
            1.5,  # never seen
            -0.5 * 2 - 1 * 0.5 - 0.25,
            0.0,
        ]
    ])
    penalized = logits.clone()
    torch_sampler._apply_penalties(penalized, batch)
    assert torch.allclose(penalized, expected)
    # And the sampler acts on them: token 0 (2.0 raw) falls below token 3.
    assert TorchSampler().sample(logits, batch).token_ids.item() == 3


def test_seeded_rows_ignore_batch_mates_order_and_repetition():
    logits = random_logits(8, seed=1)
    seeds = [11, 22, 33, -1, 44, -1, 55, 66]
    positions = [0, 5, 9, 0, 3, 0, 7, 1]
    batch = make_batch(8, seeds=seeds, positions=positions, top_k=[0, 5, 0, 0, 3, 0, 0, 8], top_p=[1.0, 0.9] * 4)
    first = TorchSampler().sample(logits, batch).token_ids
    again = TorchSampler().sample(logits, batch).token_ids
    seeded = [i for i, s in enumerate(seeds) if s >= 0]
    assert first[seeded].tolist() == again[seeded].tolist()

    # The same rows alone, reversed, and next to unrelated rows.
    order = list(reversed(seeded))
    sub = make_batch(
        len(order) + 2,
        seeds=[seeds[i] for i in order] + [-1, 7],
        positions=[positions[i] for i in order] + [0, 0],
        top_k=[batch.top_k[i].item() for i in order] + [0, 0],
        top_p=[batch.top_p[i].item() for i in order] + [1.0, 1.0],
    )
    sub_logits = torch.cat([logits[order], random_logits(2, seed=2)])
    moved = TorchSampler().sample(sub_logits, sub).token_ids
    assert moved[: len(order)].tolist() == first[order].tolist()


def test_different_seeds_and_positions_draw_differently():
    logits = torch.zeros(200, 1000)  # uniform: 200 draws would collide only by chance
    by_seed = TorchSampler().sample(logits, make_batch(200, seeds=list(range(200)))).token_ids
    by_position = TorchSampler().sample(logits, make_batch(200, seeds=5, positions=list(range(200)))).token_ids
    assert len(set(by_seed.tolist())) > 150
    assert len(set(by_position.tolist())) > 150


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_distribution_matches_softmax(seeded):
    draws = 20_000
    probs = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    logits = (torch.log(probs) + 3.0).repeat(draws, 1)  # a shift must not matter
    seeds = list(range(draws)) if seeded else -1
    torch.manual_seed(0)
    out = TorchSampler().sample(logits, make_batch(draws, seeds=seeds, positions=3))
    counts = torch.bincount(out.token_ids, minlength=5).double()
    expected = probs.double() * draws
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 20.0  # 4 degrees of freedom: p ~ 5e-4


def test_temperature_sharpens_distribution():
    draws = 20_000
    probs = torch.tensor([0.6, 0.4])
    torch.manual_seed(0)
    out = TorchSampler().sample(torch.log(probs).repeat(draws, 1), make_batch(draws, temperature=0.5))
    share = (out.token_ids == 0).double().mean().item()
    expected = 0.36 / (0.36 + 0.16)  # p^(1/T) renormalised
    assert math.isclose(share, expected, abs_tol=0.015)


def test_seeded_noise_is_the_splitmix_reference():
    # Pins the hash so that other samplers (e.g. GPU kernels) can reproduce it bit for bit.
    mask = (1 << 64) - 1

    def splitmix(x):
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    seed, position = 2**62 + 12345, 77
    row_key = splitmix(splitmix(seed) ^ position)
    expected = []
    for token in range(16):
        uniform = ((splitmix(row_key ^ token) >> 12) + 0.5) / 2.0**52
        expected.append(-math.log(-math.log(uniform)))
    got = torch_sampler._seeded_gumbel(torch.tensor([seed]), torch.tensor([position]), 16)
    assert got[0].tolist() == expected
