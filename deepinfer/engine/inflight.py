"""A step whose sampled tokens are still on the device (asynchronous scheduling).

When a step is launched, each sampling request gets a placeholder token at the end of ``token_ids`` and the sampled
values start copying to host memory without waiting. The next step is scheduled and launched at once: its input
tokens that are still placeholders are filled on the device from this step's tokens (``fill``), since positions,
block tables and slots never depend on a token's value. Only then does the host wait for this step's copies and
resolve the placeholders: detokenizing, stop checks, logprobs (``OutputProcessor``). A request found finished then
has one more step in flight; its token there is dropped, and nothing it wrote is read again (its blocks past the
last full one are never published to the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.runtime.request import Request
from deepinfer.runtime.scheduled import ScheduledBatch
from deepinfer.runtime.transfer import to_device, to_host
from deepinfer.plugins.interfaces import SamplerOutput

PLACEHOLDER = -1


@dataclass(slots=True)
class InFlight:
    requests: list[Request]
    positions: list[int]  # where each request's placeholder sits in its token_ids
    tokens: torch.Tensor  # [B] on the device: where the next step's placeholder inputs come from
    host: SamplerOutput  # the same outputs in host memory, complete once ``ready`` is
    started: torch.cuda.Event | None  # recorded before the step's first kernel (CUDA only)
    ready: torch.cuda.Event | None

    @classmethod
    def launch(cls, requests: list[Request], sampled: SamplerOutput, started, clock) -> "InFlight":
        positions = []
        for request in requests:
            if request.finished:  # found finished after this step was scheduled (structured outputs): row discarded
                positions.append(-1)
                continue
            positions.append(len(request.token_ids))
            request.token_ids.append(PLACEHOLDER)
        host = SamplerOutput(*(to_host(getattr(sampled, name)) for name in SamplerOutput.__dataclass_fields__))
        return cls(requests, positions, sampled.token_ids, host, started, clock.event())

    def fill(self, scheduled: ScheduledBatch, token_ids: torch.Tensor) -> None:
        """Writes this step's sampled tokens into ``token_ids`` (the next step's inputs, on the device) where the
        host still has placeholders for them."""
        placeholders = {id(r): (row, pos) for row, (r, pos) in enumerate(zip(self.requests, self.positions))}
        index, source, offset = [], [], 0
        for rows in scheduled:
            row, pos = placeholders.get(id(rows.request), (None, -1))
            if rows.start <= pos < rows.end:
                index.append(offset + pos - rows.start)
                source.append(row)
            offset += rows.count
        if not index:
            return
        if index == source == list(range(len(index))):  # the steady state: the same requests, one row each
            token_ids[:len(index)].copy_(self.tokens[:len(index)])
            return
        index, source = to_device(torch.tensor([index, source]), token_ids.device)
        token_ids[index] = self.tokens[source]

    def wait(self, clock) -> SamplerOutput:
        clock.wait(self.started, self.ready)
        self.ready = None  # timed once
        return self.host

    def write_tokens(self, clock) -> None:
        """Waits for the sampled tokens and writes them over the placeholders, for a next step whose host-side
        inputs need their values; logprobs, stop checks and text still wait for ``OutputProcessor.resolve``."""
        tokens = self.wait(clock).token_ids.tolist()
        for request, position, token in zip(self.requests, self.positions, tokens):
            if not request.finished:
                request.token_ids[position] = token
