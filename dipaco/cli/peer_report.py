"""What a peer says about its own work: the link line after its first task, the time summary
and the module-sharing summary when it leaves (``dipaco-peer join``)."""

from __future__ import annotations

from typing import Any


def seed_summary(seeds: Any, server: Any) -> str:
    """``modules: 9 from peers (0.4 MB), 3 from owners, 1 refused; served 5 to peers (0.2 MB)``"""
    c = seeds.counts()
    line = (
        f"modules: {c['from_seeds']} from peers ({c['seed_bytes'] / 1e6:.1f} MB), "
        f"{c['from_owner']} from owners, {c['refused']} refused"
    )
    if c.get("unreachable"):
        line += f", {c['unreachable']} serving peer(s) behind another NAT skipped"
    if server is None:
        return line + "; this peer serves none (client mode: pass --serve-modules to serve)"
    return line + f"; served {server.served} to peers ({server.bytes_out / 1e6:.1f} MB)"


THIN_LINK = 0.25  # a share of a task's time in transfers past which the peer says so
SHORT_TASK = 20.0  # seconds of training per task below which transfers' fixed costs weigh


def link_line(
    timings: dict[str, float],
    traffic: tuple[int, int] | None = None,
    behind: float | None = None,
    *,
    tasks: int = 1,
    local: bool = False,
    outage: float = 0.0,
) -> str:
    """One line on the link, from the peer's time so far (printed when its second task starts):
    transfers (fetch and push) against training, the bytes where the transport counts them,
    and, when the transfers take more than a quarter of the time, why and what to change. The
    link is blamed only when it can be the cause: not on this machine (``local``: the
    coordinator's address is a loopback one) and not when tasks are short (under ``SHORT_TASK``
    seconds of training each over ``tasks`` tasks), where each transfer's fixed costs weigh
    whatever the link. ``behind``: the seconds uploads took behind training (--push-behind),
    outside the peer's own time. ``outage``: seconds the coordinator was unreachable, which
    the transfers waited out: not the link's speed, so not counted as transfer time."""
    moving = max(0.0, timings.get("fetch", 0.0) + timings.get("push", 0.0) - outage)
    training = timings["train"]
    share = moving / max(moving + training, 1e-9)
    line = f"link: transfers took {moving:.1f} s so far, training {training:.1f} s"
    if traffic is not None and moving > 0:
        line += f" ({traffic[0] / 1e6:.1f} MB up, {traffic[1] / 1e6:.1f} MB down)"
    if behind is not None:
        line += f", uploads behind training {behind:.1f} s"
    if outage > 0:
        line += f", not counting {outage:.0f} s the coordinator was unreachable"
    if share <= THIN_LINK:
        return line + f": {100 * share:.0f}% on transfers, fine"
    per_task = training / max(tasks, 1)
    if local or per_task < SHORT_TASK:
        where = "on this machine, " if local else ""
        return line + (
            f": {100 * share:.0f}% on transfers, {where}the fixed cost of each task's transfers "
            f"(connections, hashes, saves) next to short tasks ({per_task:.1f} s of training "
            "each), not the link; longer tasks (the run's train.inner_steps) spend less on it"
        )
    return line + (
        f": {100 * share:.0f}% on transfers, a thin link for this run: join from a faster link, "
        'or ask the operator for smaller deltas ([network] codec = "int8" or "sign1")'
        + ("" if behind is not None else ", or pass --push-behind to upload while you train")
    )


def on_loopback(address: str | None) -> bool:
    """Whether a coordinator's address (host:port or a multiaddr) is on this machine."""
    import ipaddress

    from dipaco.peer.checks import parse_address

    try:
        host = parse_address(address or "")[0]
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def time_summary(timings: dict[str, float]) -> str:
    """``time: train 12.3 s (80%), fetch 0.4 s, push 0.5 s, save 0.1 s, waiting for work 3.2 s``"""
    total = sum(timings.values()) or 1.0
    order = ["train", "fetch", "push", "save", "claim"]
    parts = [
        f"{'waiting for work' if k == 'claim' else k} {timings[k]:.1f} s"
        + (f" ({100 * timings[k] / total:.0f}%)" if k == "train" else "")
        for k in sorted(timings, key=lambda k: order.index(k) if k in order else len(order))
    ]
    return "time: " + ", ".join(parts)
