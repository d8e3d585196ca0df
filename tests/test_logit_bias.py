"""SamplingParams.logit_bias (OpenAI's logit_bias): checked by name, added to the logits before sampling in the
reference sampler, greedy and seeded sampling included. Through the engine and the server (forcing, banning, seeded
runs, ids outside the vocabulary): tests/test_serve_features.py, whose engine is already loaded."""

import math

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.plugins.builtin.torch_sampler import TorchSampler
from deepinfer.runner.sampling_batch import sampling_batch, SamplingFlags
from test_sampler import VOCAB, make_batch, random_logits


@pytest.mark.parametrize("logit_bias, message", [
    ([5, 1.0], "logit_bias must be a dict"), ({"5": 1.0}, "logit_bias keys"), ({-1: 1.0}, "logit_bias keys"),
    ({True: 1.0}, "logit_bias keys"), ({5: 100.5}, r"logit_bias\[5\] must be in \[-100, 100\]"),
    ({5: -101}, r"logit_bias\[5\]"), ({5: math.nan}, r"logit_bias\[5\] must be a finite number"),
    ({5: "1"}, r"logit_bias\[5\] must be a finite number"), ({5: True}, r"logit_bias\[5\]"),
])
def test_a_bad_logit_bias_is_refused_naming_the_field(logit_bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=logit_bias)


def test_logit_bias_is_kept_as_given_in_a_copy():
    given = {5: 100, 7: -0.5}
    params = SamplingParams(logit_bias=given)
    given[9] = 1.0
    assert params.logit_bias == {5: 100, 7: -0.5} and params.logit_bias is not given


def _with_bias(rows: int, biases: list[dict], **fields):
    batch = make_batch(rows, **fields)
    batch.logit_bias = biases
    return batch


def test_greedy_takes_the_argmax_of_the_biased_logits():
    logits = random_logits(3)
    plain = logits.argmax(-1)
    forced = (plain + 1) % VOCAB
    out = TorchSampler().sample(logits, _with_bias(3, [{int(forced[0]): 100}, {}, {int(plain[2]): -100}],
                                                   temperature=0.0, num_logprobs=1))
    assert out.token_ids[0] == forced[0] and out.token_ids[1] == plain[1]  # a row without bias is left alone
    assert out.token_ids[2] != plain[2] and out.token_ids[2] == logits[2].topk(2).indices[1]
    # log-probabilities stay those of the model (raw), as with penalties
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1))


def test_a_bias_of_minus_100_bans_and_plus_100_forces_a_sampled_token():
    logits = random_logits(64, seed=3)
    banned = logits.argmax(-1)
    seeds = list(range(64))
    out = TorchSampler().sample(logits, _with_bias(64, [{int(t): -100} for t in banned], seeds=seeds))
    assert not (out.token_ids == banned).any()
    out = TorchSampler().sample(logits, _with_bias(64, [{11: 100}] * 64, seeds=seeds))
    assert (out.token_ids == 11).all()


def test_seeded_sampling_with_a_bias_is_deterministic_and_follows_the_bias():
    logits = random_logits(2, seed=5)
    batch = _with_bias(2, [{4: 3.0, 9: 2.0}, {4: 3.0, 9: 2.0}], seeds=[7, 8], positions=[2, 2])
    first, again = (TorchSampler().sample(logits, batch).token_ids for _ in range(2))
    assert torch.equal(first, again)
    # the biased draw is the unbiased draw of logits raised by the bias: the same seeded noise sees both
    raised = logits.clone()
    raised[:, 4] += 3.0
    raised[:, 9] += 2.0
    assert torch.equal(first, TorchSampler().sample(raised, make_batch(2, seeds=[7, 8], positions=[2, 2])).token_ids)


def test_sampling_batch_carries_each_rows_bias():
    flags = SamplingFlags(num_logprobs=0, all_greedy=True, any_top_k_top_p=False, any_seeded=False,
                          any_logprobs=False)
    zeros = torch.zeros(2)
    batch = sampling_batch(zeros, zeros.long(), zeros + 1, zeros, zeros.long() - 1, zeros.long(), flags,
                           logit_bias=[{3: 1.0}, {}])
    assert batch.logit_bias == [{3: 1.0}, {}]
