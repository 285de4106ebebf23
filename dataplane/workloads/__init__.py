"""Work built on top of a cluster or on plain Spark tasks.

``tuning`` (:func:`dataplane.tune`), ``batch_predict`` (:func:`dataplane.predict`),
``streaming`` (:func:`~dataplane.workloads.streaming.feed_stream`). The Spark ML stages are
:mod:`dataplane.ml`, kept at that path because saved pipelines record their classes by it.
"""

__all__: list[str] = []
