"""dipaco as a Flower app: the coordinator is a ServerApp, peers are SuperNodes.

Flower inverts control (a node only answers the ServerApp's messages), so the ServerApp speaks
dipaco's protocol to the coordinator core on each node's behalf and relays what only the node
can say. ``strategy.DipacoStrategy`` claims a task for each node from the core, fetches its
path's modules and sends them as dipaco wire frames; ``client`` runs the ordinary
:class:`~dipaco.peer.peer.Peer` on the node against what the message carried, and returns the
delta as the node's own signed ``SubmitDelta`` envelope, which the core opens, validates and
applies exactly as on every other transport. ``deploy`` starts a real SuperLink (TLS, node
authentication) and SuperNodes; the unit tests run the same apps in one process
(``tests/unit/_flower_grid.py``). ``apps.serve`` runs a prepared run over any Flower ``Grid``.
See docs/flower.md.
"""
