"""Joining and publishing a run on the internet (floor 4): the run's records in the hivemind DHT
(manifest, owners, progress, live peers), and a peer's hivemind node for joining a run: what the
command-line tools used to assemble by hand. The byte transport itself is protocols/hivemind/.
"""
