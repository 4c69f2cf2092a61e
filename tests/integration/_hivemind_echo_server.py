"""A hivemind echo server for the transport tests: prints its address as JSON, serves until killed.

Usage: python _hivemind_echo_server.py [--sleep SECONDS]
It echoes every request, except that b"BIG <n>" is answered with n random bytes.
The first stdout line is {"peer_id": ..., "maddrs": [...], "pid": ...}. The server exits when its
stdin closes (so it never outlives a test that forgot it), or when killed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dipaco.protocols.hivemind import HivemindNode
from dipaco.protocols.wire import ByteBuffer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds the handler sleeps")
    args = parser.parse_args()

    def echo(data: ByteBuffer) -> ByteBuffer:
        if args.sleep:
            time.sleep(args.sleep)
        if bytes(data[:4]) == b"BIG ":  # b"BIG <n>": answer n random bytes
            return os.urandom(int(bytes(data[4:])))
        return data

    node = HivemindNode()
    try:
        node.serve(echo)
        info = {"peer_id": node.peer_id, "maddrs": node.visible_maddrs(), "pid": os.getpid()}
        print(json.dumps(info), flush=True)
        sys.stdin.read()  # until the test closes our stdin
    finally:
        node.shutdown()


if __name__ == "__main__":
    main()
