"""The node's room: what runs on an executor to bring up a TF node and serve it.

``launcher`` (the Spark task that spawns a node), ``process`` (the node process, ``python -m
dataplane.node.process``), ``server`` (its Arrow Flight server), ``context`` (the ``ctx`` handed
to ``main``). Nothing here imports the driver's room.
"""

__all__: list[str] = []
