"""Scheduler: token budget, chunked prefill next to decodes, join/leave, priorities, max wait, bounded queue,
preemption by recompute, abort; driven by a fake clock and a fake runner that checks the KV slots."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmc.errors import QueueFullError, RequestError
from llmc.request.params import SamplingParams
from llmc.runtime.scheduler import Request, RequestStatus, Scheduler
from tests.runtime.scheduler_helpers import (FakeClock, SlotRunner, make_request, make_scheduler, next_token,
                                             random_arrivals)


def reference(prompt: tuple[int, ...], max_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def drive(sched: Scheduler, arrivals: dict[int, list[Request]], max_steps: int = 500) -> dict:
    """Run an engine-like loop: add arrivals at their step, schedule, execute, update, finish at length."""
    runner = SlotRunner(sched.block_manager.block_size)
    outputs: dict[str, list[int]] = {}
    stats = {"preemptions": 0, "cached_admissions": 0, "steps": 0}
    requests = {r.request_id: r for rs in arrivals.values() for r in rs}
    for step in range(max_steps):
        for r in arrivals.get(step, []):
            sched.add(r)
        if not sched.has_unfinished() and step > max(arrivals):
            break
        out = sched.schedule()
        assert out.num_tokens <= sched.max_num_tokens
        assert len(out.sequences) <= sched.max_num_seqs
        stats["preemptions"] += len(out.preempted_request_ids)
        stats["cached_admissions"] += sum(1 for s in out.sequences if 0 < s.num_computed < len(s.prompt_token_ids))
        new = sched.update(runner.execute(out))
        for rid in new:
            req = requests[rid]
            if len(req.output_token_ids) >= req.params.max_new_tokens:
                outputs[rid] = list(req.output_token_ids)
                sched.finish_request(rid)
        stats["steps"] = step
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return {"outputs": outputs, **stats}


def check_against_reference(result: dict, arrivals: dict[int, list[Request]]) -> None:
    for rs in arrivals.values():
        for r in rs:
            assert result["outputs"][r.request_id] == reference(r.prompt_token_ids, r.params.max_new_tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_arrivals_match_serial_reference(seed):
    arrivals = random_arrivals(seed, 12)
    result = drive(make_scheduler(max_num_tokens=16, max_num_seqs=4), arrivals)
    check_against_reference(result, arrivals)


@pytest.mark.parametrize("seed", [3, 4, 6])
def test_tiny_cache_forces_preemption_by_recompute_and_outputs_stay_exact(seed):
    arrivals = random_arrivals(seed, 10)
    result = drive(make_scheduler(num_blocks=13, block_size=4, max_num_tokens=24, max_num_seqs=6), arrivals)
    assert result["preemptions"] > 0
    check_against_reference(result, arrivals)


def test_shared_prefix_hits_the_cache_and_outputs_stay_exact():
    arrivals = random_arrivals(5, 8, shared_prefix=13)
    arrivals = {2 * k: v for k, v in arrivals.items()}  # spread arrivals so earlier prompts are computed
    result = drive(make_scheduler(max_num_tokens=64), arrivals)
    assert result["cached_admissions"] > 0
    check_against_reference(result, arrivals)


def test_token_budget_and_chunked_prefill_keeps_decodes_running():
    sched = make_scheduler(max_num_tokens=8)
    runner = SlotRunner(4)
    sched.add(make_request("short", 3, max_new=20))
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.sequences] == [("short", 3, True)]
    sched.update(runner.execute(out))
    sched.add(make_request("long", 30, max_new=2))
    chunks = []
    for _ in range(5):
        out = sched.schedule()
        by_id = {s.request_id: s for s in out.sequences}
        assert len(by_id["short"].token_ids) == 1 and by_id["short"].sample  # decode never stalls
        assert out.num_tokens <= 8
        if "long" in by_id:
            chunks.append((by_id["long"].num_computed, len(by_id["long"].token_ids), by_id["long"].sample))
        sched.update(runner.execute(out))
    assert chunks == [(0, 7, False), (7, 7, False), (14, 7, False), (21, 7, False), (28, 2, True)]


def test_steps_with_decodes_take_the_mixed_budget_and_prefill_alone_the_full_one():
    sched = make_scheduler(max_num_tokens=32, max_mixed_tokens=8)
    runner = SlotRunner(4)
    sched.add(make_request("long", 40, max_new=2))
    out = sched.schedule()  # nothing decodes yet: the whole budget goes to the prompt
    assert [(s.request_id, len(s.token_ids)) for s in out.sequences] == [("long", 32)]
    sched.update(runner.execute(out))
    out = sched.schedule()
    sched.update(runner.execute(out))  # "long" finishes its prompt and samples
    sched.add(make_request("next", range(100, 140), max_new=2))  # no prefix shared with "long"
    out = sched.schedule()  # "long" decodes: the step holds 8 tokens in all, "next" prefills 7 of them
    by_id = {s.request_id: len(s.token_ids) for s in out.sequences}
    assert by_id == {"long": 1, "next": 7} and out.num_tokens == 8


def test_requests_join_and_leave_every_step():
    sched = make_scheduler()
    runner = SlotRunner(4)
    sched.add(make_request("a", 5))
    sched.update(runner.execute(sched.schedule()))
    sched.add(make_request("b", 5))
    out = sched.schedule()
    assert [s.request_id for s in out.sequences] == ["a", "b"]
    sched.update(runner.execute(out))
    sched.finish_request("a")
    sched.add(make_request("c", 2))
    out = sched.schedule()
    assert [s.request_id for s in out.sequences] == ["b", "c"]
    assert sched.num_running == 2


def test_max_num_seqs_caps_the_running_batch():
    sched = make_scheduler(max_num_seqs=2, max_num_tokens=100)
    for i in range(3):
        sched.add(make_request(f"r{i}", 3))
    out = sched.schedule()
    assert [s.request_id for s in out.sequences] == ["r0", "r1"]
    assert sched.num_waiting == 1


def test_priority_lower_number_first_then_fcfs():
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("late_low", 3, priority=5))
    sched.add(make_request("normal_1", 3))
    sched.add(make_request("urgent", 3, priority=-1))
    sched.add(make_request("normal_2", 3))
    assert [r.request_id for r in sched.waiting.ordered()] == ["urgent", "normal_1", "normal_2", "late_low"]
    assert [s.request_id for s in sched.schedule().sequences] == ["urgent"]


def test_max_wait_bumps_a_starving_request_to_the_front():
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=1, max_wait_s=10.0, clock=clock)
    sched.add(make_request("low", 3, priority=9))
    clock.now = 5.0
    sched.add(make_request("high", 3, priority=0))
    assert sched.waiting.peek().request_id == "high"
    clock.now = 10.5  # "low" has now waited more than max_wait_s
    assert sched.waiting.peek().request_id == "low"
    assert [s.request_id for s in sched.schedule().sequences] == ["low"]


def test_bounded_queue_rejects_when_full():
    sched = make_scheduler(max_queue_size=2)
    sched.add(make_request("a", 3))
    sched.add(make_request("b", 3))
    with pytest.raises(QueueFullError, match="queue is full"):
        sched.add(make_request("c", 3))
    sched.schedule()  # admitting drains the queue, so new requests fit again
    sched.add(make_request("c", 3))


def test_add_rejects_duplicate_ids_and_requests_that_never_fit():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    sched.add(make_request("a", 3))
    with pytest.raises(RequestError) as e:
        sched.add(make_request("a", 3))
    assert e.value.field == "request_id"
    with pytest.raises(RequestError) as e:
        sched.add(make_request("big", 10, max_new=20))  # 30 tokens > 16 slots in the cache
    assert e.value.field == "max_new_tokens"
    with pytest.raises(RequestError) as e:
        sched.add(make_request("long", 64))
    assert e.value.field == "prompt"


def test_preemption_picks_latest_lowest_priority_and_keeps_generated_tokens():
    # Prefix caching off: with it on, the victim's committed blocks would be found again on readmission.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_tokens=64, prefix=False)
    runner = SlotRunner(4)
    sched.add(make_request("first", 7, max_new=9))
    sched.add(make_request("second", range(11, 18), max_new=9))
    preempted = []
    for _ in range(6):
        out = sched.schedule()
        preempted += out.preempted_request_ids
        sched.update(runner.execute(out))
        if preempted:
            break
    assert preempted == ["second"]
    victim = sched.get("second")
    assert victim.status is RequestStatus.WAITING and victim.num_computed == 0
    assert victim.num_preemptions == 1 and len(victim.output_token_ids) >= 1
    assert sched.waiting.peek() is victim
    kept = list(victim.output_token_ids)
    sched.finish_request("first")
    out = sched.schedule()
    (s,) = out.sequences
    assert s.request_id == "second" and s.num_computed == 0
    assert s.token_ids == tuple(range(11, 18)) + tuple(kept)  # recompute prompt + generated tokens


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched = make_scheduler(max_num_seqs=1)
    runner = SlotRunner(4)
    sched.add(make_request("run", 9))
    sched.add(make_request("wait", 9))
    sched.update(runner.execute(sched.schedule()))
    assert sched.block_manager.num_used_blocks == 3
    assert sched.abort("run") and sched.abort("wait")
    assert not sched.abort("run")
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert not sched.has_unfinished()


def test_abort_while_a_step_runs_is_ignored_by_update():
    sched = make_scheduler()
    runner = SlotRunner(4)
    sched.add(make_request("a", 5))
    sched.add(make_request("b", 5))
    out = sched.schedule()
    sched.abort("a")
    new = sched.update(runner.execute(out))
    assert list(new) == ["b"]
    assert sched.block_manager.num_used_blocks == 2  # only "b": 6 slots in blocks of 4


def test_bookkeeping_is_device_free():
    code = "import sys, llmc.runtime.kv_cache, llmc.runtime.scheduler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_token_slice_equals_slicing_the_whole_sequence():
    """Scheduled tokens come from ``Request.token_slice`` (no prompt + outputs concatenation per step)."""
    request = Request("r", tuple(range(100, 107)), SamplingParams(max_new_tokens=8))
    request.output_token_ids.extend([7, 8, 9])
    whole = request.all_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 2):
            assert request.token_slice(start, end) == whole[start:end], (start, end)
