"""Bytes and types, no training role (floor 1): messages, the wire encoding, codecs, refusal
reasons, signed envelopes, transports (local, loopback, hivemind) and DHT discovery."""
