"""Per-rank compute time: on a GPU from events on the compute stream, read a step late without a
sync; checked here with stand-in events on a fake clock (no wall-clock timing)."""

import torch

from hetforge.train.parallel import BucketClock, ComputeTimer

NOW = [0.0]  # seconds on the fake device's clock
DONE = [-1.0]  # the stream has completed everything recorded up to this time


class FakeEvent:
    """One stream: waiting for an event completes every event recorded before it, as on CUDA."""

    def __init__(self):
        self.t = None

    def record(self):
        self.t = NOW[0]

    def synchronize(self):
        DONE[0] = max(DONE[0], self.t)

    def elapsed_time(self, end: "FakeEvent") -> float:  # milliseconds, as CUDA's
        assert end.t <= DONE[0], "read before its end event completed"
        return (end.t - self.t) * 1e3


def micro(timer: ComputeTimer, compute_s: float, clock: BucketClock | None = None, wait_s: float = 0.0):
    timer.start()
    NOW[0] += compute_s
    if clock is not None:  # the last bucket is ready; then the all-reduce waits for a slower peer
        clock.last_event = FakeEvent()
        clock.last_event.record()
    NOW[0] += wait_s
    timer.stop(synced=clock is not None)


def test_events_are_read_one_step_late_and_waits_for_peers_are_excluded():
    clock = BucketClock(FakeEvent)
    timer = ComputeTimer(torch.device("cpu"), clock, event_factory=FakeEvent)
    micro(timer, 0.10)  # step 1: an accumulation micro-batch, then the synced one
    micro(timer, 0.20, clock, wait_s=5.0)
    assert timer.step_seconds() == 0.0  # nothing finished yet is asked for: no sync
    micro(timer, 0.40, clock, wait_s=1.0)  # step 2
    assert abs(timer.step_seconds() - 0.30) < 1e-9  # step 1's, without its 5 s of waiting
    micro(timer, 0.25, clock)  # step 3, read at once (the memory plan's check)
    assert abs(timer.step_seconds(wait=True) - 0.25) < 1e-9
    micro(timer, 0.5)
    assert abs(timer.step_seconds() - 0.0) < 1e-9  # step 2's were consumed by nobody: dropped by the wait
    assert abs(timer.step_seconds() - 0.5) < 1e-9


def test_the_host_clock_is_used_on_a_cpu():
    clock = BucketClock()
    timer = ComputeTimer(torch.device("cpu"), clock)
    timer.start()
    clock.last = timer._t0 + 0.125  # the last bucket was ready 125 ms in
    timer.stop(synced=True)
    assert timer.step_seconds() == 0.125 and timer.step_seconds() == 0.0
