"""Scheduler planning a step ahead (asynchronous runners): placeholders for tokens not yet on the host,
:meth:`Scheduler.advance` / :meth:`Scheduler.fill`, against the serial reference."""

from __future__ import annotations

import pytest

from llmc.engine.types import PLACEHOLDER
from llmc.runtime.scheduler import Request, RequestStatus, Scheduler
from tests.runtime.scheduler_helpers import (SlotRunner, make_request, make_scheduler, next_token, random_arrivals,
                                             resolve_placeholders)


def stops_on(token: int) -> bool:
    """A stand-in stop id rule: known only once the token's value is (after the next step was planned)."""
    return token % 7 == 0


def drive_ahead(sched: Scheduler, arrivals: dict[int, list[Request]], stop=stops_on, max_steps: int = 500) -> dict:
    """The engine's asynchronous loop: plan step n + 1 (step n's tokens are placeholders), "launch" it, then fill
    step n's tokens and finish requests (length or ``stop``), then advance step n + 1."""
    runner = SlotRunner(sched.block_manager.block_size)
    outputs: dict[str, list[int]] = {}
    stats = {"preemptions": 0, "wasted_rows": 0, "placeholder_rows": 0}
    requests = {r.request_id: r for rs in arrivals.values() for r in rs}
    inflight = None  # (ticket, result) of the launched step whose tokens are not filled yet
    for step in range(max_steps):
        for r in arrivals.get(step, []):
            sched.add(r)
        if not sched.has_unfinished() and inflight is None and step > max(arrivals):
            break
        out = sched.schedule()
        stats["preemptions"] += len(out.preempted_request_ids)
        stats["placeholder_rows"] += sum(1 for s in out.sequences if s.token_ids[-1:] == (PLACEHOLDER,))
        result = runner.execute(resolve_placeholders(out, inflight[1] if inflight else None))
        if inflight is not None:
            for rid, token in sched.fill(*inflight).items():
                req = requests[rid]
                assert PLACEHOLDER not in req.output_token_ids[:-1]  # only the newest token may be pending
                if len(req.output_token_ids) >= req.params.max_new_tokens or stop(token):
                    outputs[rid] = list(req.output_token_ids)
                    stats["wasted_rows"] += any(s.request_id == rid for s in out.sequences)
                    sched.finish_request(rid)
        inflight = (sched.advance(), result)
        if not out.sequences:
            inflight = None
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return {"outputs": outputs, **stats}


def reference_until_stop(prompt: tuple[int, ...], max_new: int, stop=stops_on) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(next_token(tokens))
        if stop(tokens[-1]):
            break
    return tokens[len(prompt):]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["plain", "tiny cache", "shared prefix"])
def test_planning_a_step_ahead_matches_the_serial_reference(seed, kind):
    """Step n + 1 is planned before step n's tokens are known (placeholders) and the outputs stay exact: the runner's
    context check sees every token where it belongs, across preemption by recompute and prefix-cache hits. A
    request ended by a stop token runs one discarded row; one at its length limit is never planned again."""
    if kind == "tiny cache":
        arrivals = random_arrivals(seed + 3, 10)
        sched = make_scheduler(num_blocks=13, block_size=4, max_num_tokens=24, max_num_seqs=6)
    elif kind == "shared prefix":
        arrivals = {2 * k: v for k, v in random_arrivals(seed + 5, 8, shared_prefix=13).items()}
        sched = make_scheduler(max_num_tokens=64)
    else:
        arrivals = random_arrivals(seed, 12)
        sched = make_scheduler(max_num_tokens=16, max_num_seqs=4)
    result = drive_ahead(sched, arrivals)
    assert result["placeholder_rows"] > 0 and result["wasted_rows"] > 0
    if kind == "tiny cache":
        assert result["preemptions"] > 0
    for rs in arrivals.values():
        for r in rs:
            assert result["outputs"][r.request_id] == reference_until_stop(r.prompt_token_ids, r.params.max_new_tokens)


def test_a_request_at_its_length_limit_is_not_planned_again():
    sched = make_scheduler()
    runner = SlotRunner(4)
    sched.add(make_request("a", 5, max_new=2))
    sched.add(make_request("b", 5, max_new=3))
    first = runner.execute(sched.schedule())
    ticket = sched.advance()  # both sampled their first token: placeholders
    assert [r.output_token_ids for r, _, _ in ticket] == [[PLACEHOLDER], [PLACEHOLDER]]
    out = sched.schedule()
    assert [(s.request_id, s.token_ids) for s in out.sequences] == [("a", (PLACEHOLDER,)), ("b", (PLACEHOLDER,))]
    second = runner.execute(resolve_placeholders(out, first))
    assert sched.fill(ticket, first) == first.sampled_token_ids
    ticket = sched.advance()
    out = sched.schedule()  # "a" has 2 of 2 tokens (the second a placeholder): only "b" runs
    assert [s.request_id for s in out.sequences] == ["b"]
    assert sched.get("a").output_token_ids == [first.sampled_token_ids["a"], PLACEHOLDER]
    sched.fill(ticket, second)
    assert PLACEHOLDER not in sched.get("a").output_token_ids + sched.get("b").output_token_ids


def test_fill_skips_finished_requests_and_reaches_preempted_ones():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_tokens=64, prefix=False)
    runner = SlotRunner(4)
    sched.add(make_request("first", 7, max_new=9))
    sched.add(make_request("second", range(11, 18), max_new=9))
    previous, ticket, out = None, None, None
    for _ in range(6):  # plan ahead until "second" is preempted with a token on the way
        out = sched.schedule()
        result = runner.execute(resolve_placeholders(out, previous))
        if out.preempted_request_ids:
            break
        if ticket is not None:
            sched.fill(ticket, previous)
        ticket, previous = sched.advance(), result
    assert out.preempted_request_ids == ("second",)
    victim = sched.get("second")
    assert victim.status is RequestStatus.WAITING and victim.output_token_ids[-1] == PLACEHOLDER
    sched.finish_request("first")
    assert sched.schedule().sequences == ()  # not recomputed while its last token is unknown
    new = sched.fill(ticket, previous)  # "first" finished meanwhile: skipped; "second" gets its token
    assert set(new) == {"second"} and PLACEHOLDER not in victim.output_token_ids
    (s,) = sched.schedule().sequences
    assert s.request_id == "second" and s.token_ids == tuple(range(11, 18)) + tuple(victim.output_token_ids)
