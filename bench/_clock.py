"""A clock the benchmarks move by hand (a scheduler's ``clock``): ``now`` is what it says."""


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
