"""The scheduler's step contract: a ``ScheduledBatch`` out, ``Scheduler.update`` back (speculative acceptance
included), and steps scheduled ahead of the one in flight."""

from __future__ import annotations

from deepinfer.runtime.block_manager import BlockManager
from deepinfer.runtime.kv_cache import CacheKind
from deepinfer.runtime.request import Request
from deepinfer.runtime.scheduled import ScheduledBatch, ScheduledRequest
from deepinfer.engine.scheduler import Scheduler, SchedulerLimits
from deepinfer.plugins.interfaces import ComputedRows
from deepinfer.sampling_params import SamplingParams

BLOCK = 4


def _scheduler(budget: int = 64, blocks: int = 64) -> Scheduler:
    kinds = [CacheKind("swa", 1, ())]
    return Scheduler(SchedulerLimits(8, budget, True, 256), BlockManager(kinds, {"swa": blocks}, BLOCK, True))


def _request(name: str, prompt: int, max_tokens: int = 16) -> Request:
    return Request(name, 0, None, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), ())


def test_a_chunked_prefill_samples_only_in_its_last_chunk():
    scheduler = _scheduler(budget=6)
    long, short = _request("long", 10), _request("short", 3)
    scheduler.add(long)
    scheduler.add(short)
    first = scheduler.schedule()
    assert [(row.request, row.start, row.count, row.samples) for row in first] == [(long, 0, 6, False)]
    scheduler.update(first)
    second = scheduler.schedule()
    assert [(row.request, row.start, row.count, row.samples) for row in second] == [(long, 6, 4, True),
                                                                                     (short, 0, 2, False)]
    assert second.sampling == [long] and second.num_tokens == 6 and long.num_computed == 6


def test_update_books_accepted_drafts_and_finishes_after_booking():
    scheduler = _scheduler()
    kept, done = _request("kept", 5), _request("done", 5)
    for request in (kept, done):
        scheduler.add(request)
    scheduler.update(scheduler.schedule())
    for request in (kept, done):
        request.token_ids.append(7)  # the prefill's sampled token
        request.set_drafts([8, 9, 10])
    step = scheduler.schedule()
    assert [(row.count, row.samples, row.drafts) for row in step] == [(4, True, 3), (4, True, 3)]
    booked = scheduler.update(step, accepted={kept: 1, done: 3}, finished=[done])
    # ``kept`` computed its last token and its first draft; the two rejected drafts' rows are not booked
    assert booked == [ComputedRows(kept, 0, 5, 2)] and kept.num_computed == 7
    assert done.finished and scheduler.running == [kept]


def test_a_step_scheduled_ahead_reserves_its_blocks_and_books_from_the_step_before():
    scheduler = _scheduler()
    request = _request("r", 5)
    scheduler.add(request)
    scheduler.update(scheduler.schedule())
    request.token_ids.append(7)
    request.set_drafts([8, 9])
    in_flight = scheduler.schedule()
    ahead = scheduler.schedule_ahead([request], rows=3)
    (row,) = ahead
    assert (row.start, row.count, row.samples, row.drafts) == (8, 3, True, 2)
    assert len(request.tables["swa"]) == -(-(8 + 3) // BLOCK)  # blocks up to its latest possible end
    request.drop_drafts()
    request.token_ids += [8, 3]  # the step in flight accepted one draft
    scheduler.update(in_flight, accepted={request: 1})
    assert request.num_computed == 7
    scheduler.update(ahead, accepted={request: 0})  # it starts where the step before ended, not at 8
    assert request.num_computed == 8


def test_nothing_is_scheduled_ahead_while_a_request_waits_for_a_slot_or_could_finish():
    scheduler = _scheduler()
    request = _request("r", 5, max_tokens=2)
    scheduler.add(request)
    scheduler.update(scheduler.schedule())
    request.token_ids.append(7)
    assert scheduler.schedule_ahead([request], rows=3) is None  # one token left: the step in flight may end it
    assert scheduler.schedule_ahead([], rows=3) is None
    assert ScheduledBatch([ScheduledRequest.of(request, 5, 1)]).sampling == [request]
