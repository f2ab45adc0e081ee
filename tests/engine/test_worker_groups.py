"""The worker with prompts prefilled together (issue 15 point 4): a step that raises while it
carries a group runs each span again alone, so only the span that raises ends."""

from __future__ import annotations

from tests.engine.test_worker import Engine, expected, logs, models, reached, refused_with, run  # noqa: F401 (fixtures)


def test_a_group_member_that_raises_ends_alone(models, logs):  # noqa: F811 (the fixtures)
    """A lane decodes; three prompts of 6 arrive together (chunk 16: the first two prefill in one
    step). Every step whose prefill carries the poisoned second one raises: it ends with
    engine_error, and the group's other prompt, the one after it and the lane stream every token."""
    poison = 990

    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            lane = await e.submit(max_tokens=40)
            assert (await e.receive(lane.reply_channel))["token_ids"] == expected(lane, 1)
            models.step_gate.close()
            await reached(models.step_gate.held)  # a decode round is in flight
            good = await e.submit()
            bad = await e.submit(prompt=[1, poison, 2, 3, 4, 5])
            after = await e.submit()
            await e.status()  # all three are in the inbox
            failed = []  # the steps that raised (the fake records only those that ran)
            models.fail_step = lambda plan: (
                any(poison in s.token_ids for s in plan.prefills) and not failed.append(plan)
            )
            models.step_gate.open()
            _, last = await e.outcome(bad)
            assert refused_with(last, "engine_error", 500)
            for add, want in ((good, expected(good, 4)), (after, expected(after, 4)), (lane, expected(lane, 40)[1:])):
                tokens, last = await e.outcome(add)
                assert last["type"] == "engine.finished" and tokens == want
            await logs.wait("ignis.engine.row_failed")
            assert [s.token_ids for s in failed[0].prefills] == [good.prompt_token_ids, bad.prompt_token_ids]
            assert all(len(p.prefills) == 1 for p in failed[1:])  # then alone
            stats = (await e.status())["stats"]
            assert (stats["aborted"], stats["lanes_busy"], stats["kv_pages"]["used"]) == (1, 0, 0)

    run(scenario)
