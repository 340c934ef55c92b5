"""The process-wide request pace (``object_requests_per_second``): the token bucket's arithmetic
on a clock the test drives, then a save and restore through a proxy that records when each
request arrives, on the GCS emulator and on moto."""

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.settings import Settings
from tpu_ckpt.storage._request_rate import RequestRate


class Clock:
    """Time that passes only when the test, or a paced request's wait, moves it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


def test_a_burst_past_one_seconds_worth_waits_its_turn_request_by_request():
    clock = Clock()
    rate = RequestRate(10, clock=clock, sleep=clock.sleep)
    for _ in range(13):
        rate.take()
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.3])  # the first ten are the bucket's burst
    assert rate.requests == 13 and rate.waited_s == pytest.approx(0.6)


def test_an_idle_bucket_refills_to_one_second_of_requests_and_no_more():
    clock = Clock()
    rate = RequestRate(4, clock=clock, sleep=clock.sleep)
    for _ in range(4):
        rate.take()
    clock.now += 60.0  # a minute idle buys one second's burst, not sixty
    for _ in range(5):
        rate.take()
    assert clock.sleeps == pytest.approx([0.25])


def test_the_pace_comes_from_the_environment_and_zero_means_none():
    assert Settings().object_requests_per_second == 0
    assert Settings.from_environment({"TPU_CKPT_OBJECT_REQUESTS_PER_SECOND": "250"}).object_requests_per_second == 250
    with pytest.raises(ValueError, match="TPU_CKPT_OBJECT_REQUESTS_PER_SECOND must be a number of requests a second"):
        Settings.from_environment({"TPU_CKPT_OBJECT_REQUESTS_PER_SECOND": "fast"})
    with pytest.raises(ValueError, match="object_requests_per_second must be positive"):
        Settings(object_requests_per_second=-1)


PER_SECOND = 25


def busiest_second(arrivals: list[float]) -> int:
    """The most requests that arrived within any one second."""
    arrivals = sorted(arrivals)
    return max(sum(1 for t in arrivals[i:] if t < start + 1.0) for i, start in enumerate(arrivals))


@pytest.mark.emulator
def test_a_paced_save_and_restore_stay_under_the_rate_and_are_bit_exact(faulty, knobs):
    proxy, bucket = faulty
    knobs(object_requests_per_second=PER_SECOND)
    tree = {"w": np.random.default_rng(5).standard_normal((200, 500)).astype(np.float32)}
    options = tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(4096))  # ~100 objects
    tc.save(bucket.url("c"), tree, options=options).wait()
    restored = tc.restore(bucket.url("c"))
    assert restored["w"].tobytes() == tree["w"].tobytes()
    arrivals = [r.at for r in proxy.requests]
    assert len(arrivals) > 3 * PER_SECOND and any(r.method == "GET" for r in proxy.requests)
    # One second's burst and one second's rate, and a few for requests that tensorstore retried
    # itself or issued on its own (an S3 bucket's region lookup) without taking a token.
    assert busiest_second(arrivals) <= 2 * PER_SECOND + 5
