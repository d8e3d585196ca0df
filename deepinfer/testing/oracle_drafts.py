"""Speculative decoding's test oracles: a drafter that knows the reference continuation (from a run without
drafts), so a test decides what is right and where a draft goes wrong, and the comparison of two runs' outputs
(not part of the public API)."""

from __future__ import annotations

from deepinfer.plugins.hookspecs import hookimpl
from deepinfer.plugins.interfaces import Draft
from deepinfer.plugins.manager import registered
from deepinfer.sampling_params import SamplingParams

PROMPTS = ["import os", "def f(x):", "class A:\n    pass\n" * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


class OracleDrafter:
    """Proposes the reference continuation, wrong at draft position ``wrong_at`` (None: always right); requests
    whose prompt is in ``skip`` get no draft; ``confidence`` is handed out with every draft."""

    name = "oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], wrong_at=None, skip=(), confidence=None,
                 length=5):
        self.reference, self.wrong_at, self.skip = reference, wrong_at, set(skip)
        self.confidence, self.length = confidence, length
        self.batches: list[list[int]] = []  # the requests asked for, per step

    def propose(self, requests, computed, features):
        drafts = []
        self.batches.append([len(r.token_ids) for r in requests])
        for r in requests:
            prompt = tuple(r.prompt_token_ids)
            if prompt in self.skip:
                drafts.append(Draft([]))
                continue
            done = r.num_output_tokens
            tokens = list(self.reference[prompt][done : done + self.length])
            if self.wrong_at is not None and self.wrong_at < len(tokens):
                tokens[self.wrong_at] = (tokens[self.wrong_at] + 1) % 64
            drafts.append(Draft(tokens, None if self.confidence is None else list(self.confidence(r))))
        return drafts


def reference_verified_length(draft: Draft, limit: int, floor: float | None) -> int:
    """``speculation.verified_lengths`` for one draft, written as the rule reads: the longest prefix (at most
    ``limit``) whose survival, the product of its confidences, stays at or above ``floor``."""
    length = min(limit, len(draft.token_ids))
    if floor is None or draft.confidence is None:
        return length
    survival = 1.0
    for position, confidence in enumerate(draft.confidence[:length]):
        survival *= confidence
        if survival < floor:
            return position
    return length


def reference_accepted(drafts: list[int], sampled: list[int]) -> int:
    """``speculation.accepted_counts`` for one request, written as the rule reads: leading drafts equal to the
    token sampled at the row before each."""
    count = 0
    while count < len(drafts) and drafts[count] == sampled[count]:
        count += 1
    return count


class DrafterPlugin:
    def __init__(self, drafter):
        self.drafter = drafter

    @hookimpl
    def deepinfer_drafter(self, config, context):
        return self.drafter


class Watched:
    """A drafter whose ``propose`` / ``propose_on_device`` go through ``propose(real_method, *args)`` /
    ``propose_on_device(real_method, *args)`` where given; everything else is the drafter's own."""

    def __init__(self, drafter, propose=None, propose_on_device=None):
        self.drafter = drafter
        if propose is not None:
            self.propose = lambda *args: propose(drafter.propose, *args)
        if propose_on_device is not None:
            self.propose_on_device = lambda *args: propose_on_device(drafter.propose_on_device, *args)

    def __getattr__(self, name):
        return getattr(self.drafter, name)


class WatchingPlugin:
    """Serves the drafter the hook of ``plugin`` builds, from the ``DraftContext`` ``context(c)`` makes of the
    engine's, as a ``Watched`` drafter: how a test watches a real drafter, passed in through the hook rather than
    swapped into a built engine."""

    def __init__(self, plugin, context=None, **watch):
        self.plugin, self.context, self.watch = plugin, context, watch

    @hookimpl
    def deepinfer_drafter(self, config, context):
        drafter = self.plugin.deepinfer_drafter(config, context if self.context is None else self.context(context))
        return None if drafter is None else Watched(drafter, **self.watch)


def generate_with(checkpoint, prompts, params, drafter=None, plugin="oracle-drafts", **engine_args):
    """``prompts``' outputs and the ``LLM`` that generated them, with ``drafter`` serving the drafts (None: no
    speculative decoding)."""
    from deepinfer.llm import LLM

    engine_args.setdefault("dtype", "float32")
    if drafter is None:
        llm = LLM(str(checkpoint), **engine_args)
        return llm.generate(prompts, params, use_tqdm=False), llm
    with registered(DrafterPlugin(drafter), plugin):
        llm = LLM(str(checkpoint), **engine_args)
        return llm.generate(prompts, params, use_tqdm=False), llm


def continuations(outputs) -> dict[tuple[int, ...], list[int]]:
    return {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in outputs}


def assert_same(outputs, expected, logprob_tolerance=1e-4):
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in expected]
    for ours, theirs in zip(outputs, expected):
        if theirs.outputs[0].logprobs is None:
            continue
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a.keys() == b.keys()
            worst = max(abs(a[t].logprob - b[t].logprob) for t in a)
            assert worst <= logprob_tolerance, f"a logprob moved by {worst:.2e}"
