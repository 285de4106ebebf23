"""The driver's room: starting a cluster and running it from the Spark driver.

``startup`` (:func:`dataplane.run`), ``cluster`` (:class:`dataplane.Cluster`), ``feed`` (train
and inference orchestration), ``control`` (the reservation and heartbeat server the nodes call),
``sparkjobs`` (Spark jobs run in the background). The driver reaches the node room through one
door, :mod:`dataplane.node.launcher`, the Spark task that starts a node.
"""

__all__: list[str] = []
