"""How the measured draft policy's plain steps (no drafts) keep the drafter's rows during speculative decoding.

A plain step computes one row a request; the drafter must still hold it (``Drafter.store_on_device``) for drafting
to resume after the run. Where the step replays from a CUDA graph, its sampling and that store are the graph's tail
(``StepTail``): the host launches the step with one replay, as a verification step is launched, instead of the
sampler's and the store's kernels one by one (on a small model those launches cost the host more than the device's
step). A request whose sampling needs the host (a grammar, penalties, a logit bias, ``min_tokens`` not yet met)
makes its steps sample eagerly and store behind the sampling (``store``).
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.runner.cuda_graphs import StepTail
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.runner.sampling_batch import SamplingFlags, padded_sampling_rows, sampling_batch
from deepinfer.runtime.request import Request
from deepinfer.runtime.scheduled import ScheduledBatch
from deepinfer.runtime.transfer import to_device


def device_ready(request: Request) -> bool:
    """Nothing of its next steps needs the host: no grammar, no penalties or logit bias, ``min_tokens`` met."""
    p = request.params
    return (request.grammar is None and not (p.presence_penalty or p.frequency_penalty or p.logit_bias)
            and p.repetition_penalty == 1.0 and request.num_output_tokens >= p.min_tokens)


class PlainStepStore:
    """``tail(scheduled)`` for ``DecodeSteps``' graph path, ``store`` for its eager one (``after_sampling``)."""

    __slots__ = ("runner", "drafter", "_last")

    def __init__(self, runner: ModelRunner, drafter):
        self.runner, self.drafter = runner, drafter
        # the last step's requests (held, so their ids stay theirs), whether each was finished, and its tail
        self._last: tuple[list[Request], tuple[bool, ...], StepTail] | None = None

    def tail(self, scheduled: ScheduledBatch) -> StepTail | None:
        """The step's tail (one row a request, padded to the graph's batch: sampling parameters, prompt
        lengths, the drafter's slots), or None where a request needs the host's sampling. A plain run's steps
        share one (``forget`` at each run's start): what it holds is fixed per request, and rebuilding it cost
        the host ~80 us a step (CPU VM, batch 1), on the H100 in series with a batch-1 step of about 1 ms."""
        requests = scheduled.requests
        finished = tuple(r.finished for r in requests)
        if self._last is not None:
            last_requests, last_finished, last_tail = self._last
            if finished == last_finished and len(requests) == len(last_requests) and all(
                    a is b for a, b in zip(requests, last_requests)):
                return last_tail  # device_ready stays true once it is: min_tokens met is met for good
        if not all(device_ready(r) for r in requests):
            return None
        tail = self._build(requests)
        self._last = (requests, finished, tail)
        return tail

    def forget(self) -> None:
        """A plain run starts: its tail is built afresh (a request preempted and resumed since the last run, in
        the same company, may hold another drafter slot)."""
        self._last = None

    def _build(self, requests: list[Request]) -> StepTail:
        pad = self.runner.graphs.padded_requests(len(requests)) - len(requests)
        floats, ints = padded_sampling_rows(requests, pad)
        ints.append(self.slots(requests) + [-1] * pad)  # the padding requests' rows are stored nowhere read
        flags = SamplingFlags.of([r.params for r in requests], self.runner.vocab_size)
        return StepTail(lambda logits, features, inputs: self._run(logits, features, inputs, flags),
                        {"floats": torch.from_numpy(np.array(floats, dtype=np.float32)),
                         "ints": torch.from_numpy(np.array(ints, dtype=np.int64))}, ("plain", flags), one_row=True)

    def _run(self, logits: torch.Tensor, features: torch.Tensor | None, inputs, flags: SamplingFlags
             ) -> tuple[torch.Tensor | None, ...]:
        """On the device, every (padded) request's row sampled, then stored for the drafter. Returns
        ``SamplerOutput``'s fields."""
        temperature, top_p, min_p = inputs.tail["floats"]
        top_k, seeds, prompt_lengths, slots = inputs.tail["ints"]
        positions = inputs.positions
        # a row at position p samples output position p + 1 - the prompt's length
        sampled = self.runner.sampler.sample(logits, sampling_batch(temperature, top_k, top_p, min_p, seeds,
                                                                    positions + 1 - prompt_lengths, flags))
        self.drafter.store_on_device(slots, positions, sampled.token_ids, features)
        return sampled.token_ids, sampled.logprobs, sampled.top_logprob_ids, sampled.top_logprobs

    def store(self, scheduled: ScheduledBatch, sampled: torch.Tensor, features: torch.Tensor | None) -> None:
        """An eagerly sampled step's rows into the drafter's state, queued behind its sampling."""
        index = to_device(torch.tensor([self.slots(scheduled.requests), [row.start for row in scheduled]],
                                       dtype=torch.int64), sampled.device)
        self.drafter.store_on_device(index[0], index[1], sampled, features)

    def slots(self, requests: list[Request]) -> list[int]:
        """Each request's slot in the drafter's state; -1 (written nowhere a request reads) for one found
        finished after it was scheduled."""
        live = iter(self.drafter.device_slots([r for r in requests if not r.finished]))
        return [-1 if r.finished else next(live) for r in requests]
