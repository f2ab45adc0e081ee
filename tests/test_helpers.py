"""The shared waiting helper: returns what it waited for, or fails naming it and the last value."""

import itertools

import pytest

from tests.helpers import wait_for


def test_returns_the_first_value_that_satisfies():
    counter = itertools.count()
    assert wait_for(lambda: next(counter), 5, 0.001, until=lambda v: v >= 3) == 3


def test_times_out_naming_what_it_waited_for_and_the_last_value():
    with pytest.raises(AssertionError) as info:
        wait_for(lambda: {"status": "loading"}, 0.05, 0.01, "the model to serve", until=lambda e: e["status"] == "x")
    text = str(info.value)
    assert "the model to serve" in text and "{'status': 'loading'}" in text and "0.05s" in text


def test_ignored_exceptions_count_as_not_yet_and_others_propagate():
    calls = itertools.count()

    def flaky():
        if next(calls) < 2:
            raise ConnectionError("not up yet")
        return "up"

    def down():
        raise ConnectionError("down")

    assert wait_for(flaky, 5, 0.001, ignoring=(ConnectionError,)) == "up"
    with pytest.raises(AssertionError, match="ConnectionError"):
        wait_for(down, 0.05, 0.01, ignoring=(ConnectionError,))
    with pytest.raises(KeyError):
        wait_for(lambda: {}["missing"], 5, 0.001)
