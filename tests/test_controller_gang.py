"""A gang's future: member 0's reply once every member answered, a member's failure at once, a timeout
while one still runs; warm's pids kept per member (``controller/gang.py``)."""

import pytest

from stalwart.controller.gang import GangFuture

pytestmark = pytest.mark.unit


class Fut:
    def __init__(self, value=None, error=None, after=0):
        self.value, self.error, self.after = value, error, after

    def get(self, timeout=None):
        if self.after > 0:
            self.after -= 1
            raise TimeoutError
        if self.error is not None:
            raise self.error
        return self.value


def test_a_gang_answers_member_zeros_reply_once_all_have_answered():
    seen = []
    fut = GangFuture([Fut(10), Fut(11, after=3)], seen.append)
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.0)  # member 1 still running
    assert fut.get(timeout=5.0) == 10 and seen == [[10, 11]]


def test_a_members_failure_fails_the_gang_at_once_while_others_run():
    fut = GangFuture([Fut(0, after=10**9), Fut(error=RuntimeError("member 1 died"))])
    with pytest.raises(RuntimeError, match="member 1 died"):
        fut.get(timeout=5.0)
