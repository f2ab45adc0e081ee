"""The fake backend's scheduler suites again, with rounds planned ahead (engine/run_ahead.py).

Every test of test_scheduler (preemption, swaps, recomputes, aborts, prefix caching, the
decode-share gate), test_short_prefill, test_loop_guard_rounds, test_spec_rounds and
test_prefill_groups (prompts prefilled together) runs
here once more with the fake's ``step`` doing what the worker does: after a round, plan the
next one ahead when it can and step it before the round's output is taken in. Their
assertions (tokens, books, pages drained) must hold unchanged.
"""

from __future__ import annotations

import weakref

import pytest

from engine.run_ahead import plan_ahead
from tests.engine import (
    fake_backend,
    test_loop_guard_rounds,
    test_prefill_groups,
    test_scheduler,
    test_short_prefill,
    test_spec_rounds,
)
from tests.engine.test_loop_guard_rounds import *  # noqa: F403
from tests.engine.test_prefill_groups import *  # noqa: F403
from tests.engine.test_scheduler import *  # noqa: F403
from tests.engine.test_short_prefill import *  # noqa: F403
from tests.engine.test_spec_rounds import *  # noqa: F403

_queued: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scheduler -> (plan, output) stepped ahead
_ran_ahead = [0]
_plain_step = fake_backend.step


def step_ahead(sched, backend, clock):
    """fake_backend.step as the worker runs rounds: the round queued ahead (if any) is this one."""
    plan, out = _queued.pop(sched, (None, None))
    if plan is None:
        plan = sched.schedule()
        out = backend.step(plan)
    nxt = plan_ahead(sched, plan)
    if nxt is not None:
        _queued[sched] = (nxt, backend.step(nxt))
        _ran_ahead[0] += 1
    clock.advance(out.prefill_seconds + out.decode_seconds)
    return sched.update_from_output(plan, out)


@pytest.fixture(autouse=True)
def rounds_ahead(monkeypatch):
    modules = (fake_backend, test_scheduler, test_short_prefill, test_loop_guard_rounds, test_spec_rounds)
    for module in (*modules, test_prefill_groups):
        if getattr(module, "step", None) is _plain_step:
            monkeypatch.setattr(module, "step", step_ahead)
    yield
    _queued.clear()


def test_the_suites_run_rounds_ahead():
    """The patched step does plan rounds ahead, so the suites passing here means something."""
    before = _ran_ahead[0]
    test_scheduler.test_requests_complete_with_expected_tokens_and_free_blocks()
    assert _ran_ahead[0] > before
