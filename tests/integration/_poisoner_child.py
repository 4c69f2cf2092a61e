"""``dipaco-peer`` as a poisoning key would run it, in a process of its own: it trains every task
honestly and sends -2.5 times its delta (tests/faults/hostile.py's poisoner), through the real
CLI, transport and push. Arguments: those of ``dipaco-peer``."""

import sys

from dipaco.cli.peer import main
from dipaco.peer import push

_encode = push.Pusher.encode


def _poisoned(self, task, delta):  # noqa: ANN001
    flipped = {mid: {k: -2.5 * v for k, v in t.items()} for mid, t in delta.items()}
    return _encode(self, task, flipped)


push.Pusher.encode = _poisoned

if __name__ == "__main__":
    main(sys.argv[1:])
