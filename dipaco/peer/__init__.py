"""The volunteer (floor 2): the peer's loop, its links to owners, module fetch and checks, the
inner loop, the push of deltas (codec, error feedback), task state files, device fit, downloads,
its identity and doctor's checks. It meets the coordinator only through protocols/."""
