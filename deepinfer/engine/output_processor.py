"""After sampling: append tokens, detokenize, record logprobs, and decide who stops and why."""

from __future__ import annotations

import time

from deepinfer.runtime.request import Request
from deepinfer.loading.tokenizer import IncrementalDetokenizer
from deepinfer.outputs import Logprob
from deepinfer.plugins.interfaces import SamplerOutput


def host_lists(sampled: SamplerOutput) -> dict[str, list | None]:
    """The sampler's outputs (in host memory) as lists, by field name: what ``OutputProcessor.extend`` reads."""
    return {name: None if (t := getattr(sampled, name)) is None else t.tolist()
            for name in SamplerOutput.__dataclass_fields__}


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids, max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def start(self, request: Request) -> None:
        params = request.params
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            stop=params.stop or (),
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )

    def resolve(self, requests: list[Request], positions: list[int], sampled: SamplerOutput) -> list[Request]:
        """Puts each request's sampled token at ``positions`` (its placeholder), records logprobs and text, and
        returns the requests that finished; a finished one loses any later placeholder (a step already in flight)."""
        token_ids = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_ids = sampled.top_logprob_ids.tolist() if sampled.top_logprob_ids is not None else None
        top_values = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        now = time.monotonic()
        finished = []
        for row, (request, position) in enumerate(zip(requests, positions)):
            if request.finished:  # found finished one step earlier, while this step was already running
                continue
            request.token_ids[position] = token_ids[row]
            if self._record(request, position, logprobs, top_ids, top_values, row, now):
                finished.append(request)
        return finished

    def extend(self, request: Request, rows: list[int], sampled: dict, now: float) -> bool:
        """Appends the tokens of sampler ``rows`` (verified speculative decoding), stopping where the request
        does; ``sampled`` holds the sampler's outputs as host lists. Returns whether the request finished."""
        for row in rows:
            request.token_ids.append(sampled["token_ids"][row])
            if self._record(request, len(request.token_ids) - 1, sampled["logprobs"], sampled["top_logprob_ids"],
                            sampled["top_logprobs"], row, now):
                return True
        return False

    def _record(self, request: Request, position: int, logprobs, top_ids, top_values, row: int, now: float) -> bool:
        """Books the token at ``position`` (logprobs, text, stops); on a stop drops what follows it. ``logprobs``,
        ``top_ids``, ``top_values``: the sampler's per-row host lists (None where no row asked for them)."""
        token = request.token_ids[position]
        if request.grammar is not None and not request.grammar.accept(token):
            raise RuntimeError(f"request {request.request_id}: sampled token {token}, which its grammar forbids "
                               "(the mask was not applied)")
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        if request.logprobs is not None:
            request.cumulative_logprob += logprobs[row]
            request.logprobs.append(self._logprobs(request, token, logprobs[row], top_ids, top_values, row))
        if not self._check_stop(request, token, position + 1):
            return False
        del request.token_ids[position + 1 :]
        request.metrics.finished_time = now
        request.metrics.num_generated_tokens = request.num_output_tokens
        return True

    def _logprobs(self, request, token, logprob, top_ids, top_values, row) -> dict[int, Logprob]:
        wanted = request.params.logprobs
        ids = top_ids[row][: len(top_ids[row]) if wanted == -1 else wanted] if top_ids else []
        values = top_values[row][: len(ids)] if top_values else []
        entry = {tid: Logprob(value, rank + 1, self.tokenizer.decode([tid])) for rank, (tid, value) in enumerate(zip(ids, values))}
        if token not in entry:
            entry[token] = Logprob(logprob, None, self.tokenizer.decode([token]))
        return entry

    def _check_stop(self, request: Request, token: int, length: int) -> bool:
        """Sets ``finish_reason``/``stop_reason`` and returns True when the request is done with ``length`` tokens
        (a step may already be running with a placeholder after them)."""
        params = request.params
        # min_tokens is enforced by the sampler, which cannot pick EOS or a stop token before it.
        if not params.ignore_eos and token in self.eos_token_ids:
            return self._finish(request, "stop", None)
        if params.stop_token_ids and token in params.stop_token_ids:
            return self._finish(request, "stop", token)
        step = request.detokenizer.update([token])
        if step.stop_string is not None:
            return self._finish(request, "stop", step.stop_string)
        if request.grammar is not None and request.grammar.terminated:
            return self._finish(request, "stop", None)
        if length - len(request.prompt_token_ids) >= params.max_tokens or length >= self.max_model_len:
            return self._finish(request, "length", None)
        return False

    def _finish(self, request: Request, reason: str, stop_reason) -> bool:
        request.detokenizer.finish()  # releases held-back text; a no-op after a stop string
        request.finish_reason, request.stop_reason = reason, stop_reason
        return True
