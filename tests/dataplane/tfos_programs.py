"""TensorFlowOnSpark-style node programs, written here the way TFoS 2.2.5's examples are.

Each imports TensorFlow inside the function (as TFoS's examples do) and ``dataplane.compat``
where a TFoS program imports ``tensorflowonspark``. Run by tests/dataplane/test_tfos_programs.py.
"""

from __future__ import annotations

import json
import os


def _build_and_compile_model(tf, lr):  # type: ignore[no-untyped-def]
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(32, activation="relu", input_shape=(64,), name="hidden"),
        tf.keras.layers.Dense(10, activation="softmax", name="out"),
    ])
    model.compile(
        loss=tf.keras.losses.sparse_categorical_crossentropy,
        optimizer=tf.keras.optimizers.Adam(learning_rate=lr),
        metrics=["accuracy"],
    )
    return model


def keras_spark_main(args, ctx):  # type: ignore[no-untyped-def]
    """examples/mnist/keras/mnist_spark.py on 8x8 digits: DataFeed(ctx.mgr, False) + generator
    + steps_per_epoch at 90% + compat.export_saved_model + terminate()."""
    import numpy as np
    import tensorflow as tf

    from dataplane.compat import TFNode, compat

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    tf_feed = TFNode.DataFeed(ctx.mgr, False)
    seen = {"rows": 0}

    def rdd_generator():  # type: ignore[no-untyped-def]
        while not tf_feed.should_stop():
            batch = tf_feed.next_batch(1)
            if len(batch) > 0:
                example = batch[0]
                seen["rows"] += 1
                image = np.array(example[0]).astype(np.float32) / 16.0
                label = np.reshape(np.array(example[1]).astype(np.float32), (1,))
                yield (image, label)
            else:
                return

    ds = tf.data.Dataset.from_generator(
        rdd_generator, (tf.float32, tf.float32), (tf.TensorShape([64]), tf.TensorShape([1]))
    )
    options = tf.data.Options()
    compat.disable_auto_shard(options)  # every worker reads only its own pushed rows
    ds = ds.with_options(options).batch(args.batch_size)

    with strategy.scope():
        multi_worker_model = _build_and_compile_model(tf, args.lr)

    steps_per_epoch = args.rows / args.batch_size
    steps_per_epoch_per_worker = steps_per_epoch / ctx.num_workers
    max_steps_per_worker = int(steps_per_epoch_per_worker * 0.9)
    history = multi_worker_model.fit(
        x=ds, epochs=args.epochs, steps_per_epoch=max_steps_per_worker, verbose=0
    )
    compat.export_saved_model(multi_worker_model, args.export_dir, ctx.job_name == "chief")
    tf_feed.terminate()
    with open(os.path.join(args.report_dir, f"node{ctx.worker_num}.json"), "w") as f:
        json.dump({
            "job_name": ctx.job_name, "task_index": ctx.task_index,
            "num_workers": ctx.num_workers, "rows_read": seen["rows"],
            "steps": max_steps_per_worker, "epochs": len(history.history["loss"]),
            "keras": type(multi_worker_model).__module__.split(".")[0],
        }, f)


def _parse_digits(tf):  # type: ignore[no-untyped-def]
    def parse_tfr(example_proto):  # type: ignore[no-untyped-def]
        feature_def = {"label": tf.io.FixedLenFeature(1, tf.int64),
                       "image": tf.io.FixedLenFeature(64, tf.int64)}
        features = tf.io.parse_single_example(serialized=example_proto, features=feature_def)
        image = tf.cast(features["image"], dtype=tf.float32) / 16.0
        label = tf.cast(features["label"], dtype=tf.float32)
        return (image, label)

    return parse_tfr


def parallel_inference(args, ctx):  # type: ignore[no-untyped-def]
    """examples/mnist/keras/mnist_inference.py: TFParallel instances score TFRecord shards with
    the exported SavedModel and write ``label prediction`` lines, one file per instance."""
    import numpy as np
    import tensorflow as tf

    saved_model = tf.saved_model.load(args.export_dir, tags="serve")
    predict = saved_model.signatures["serving_default"]

    ds = tf.data.Dataset.list_files("{}/part-*".format(args.images_labels), shuffle=False)
    ds = ds.shard(ctx.num_workers, ctx.worker_num)
    ds = ds.interleave(tf.data.TFRecordDataset)
    ds = ds.map(_parse_digits(tf))
    ds = ds.batch(10)

    tf.io.gfile.makedirs(args.output)
    output_file = tf.io.gfile.GFile("{}/part-{:05d}".format(args.output, ctx.worker_num), mode="w")
    for batch in ds:
        predictions = predict(hidden_input=batch[0])
        labels = np.reshape(batch[1], -1).astype(int)
        preds = np.argmax(predictions["out"], axis=1)
        for x in zip(labels, preds):
            output_file.write("{} {}\n".format(x[0], x[1]))
    output_file.close()


def tensorflow_mode_main(args, ctx):  # type: ignore[no-untyped-def]
    """examples/mnist/keras/mnist_tf_ds.py: InputMode.TENSORFLOW, the node reads the TFRecords
    itself (ctx.absolute_path), trains and exports."""
    import tensorflow as tf

    from dataplane.compat import compat

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    image_pattern = ctx.absolute_path(args.images_labels)
    ds = tf.data.Dataset.list_files(image_pattern)
    ds = ds.repeat(args.epochs).shuffle(args.buffer_size)
    ds = ds.interleave(tf.data.TFRecordDataset)
    train_datasets = ds.map(_parse_digits(tf)).batch(args.batch_size * args.cluster_size)
    with strategy.scope():
        multi_worker_model = _build_and_compile_model(tf, args.lr)
    multi_worker_model.fit(
        x=train_datasets, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, verbose=0
    )
    compat.export_saved_model(multi_worker_model, args.export_dir, ctx.job_name == "chief")
    report = {"job_name": ctx.job_name, "pattern": image_pattern}
    if ctx.job_name == "chief":  # the export loads and predicts
        predict = tf.saved_model.load(args.export_dir).signatures["serving_default"]
        ds = tf.data.Dataset.list_files(image_pattern, shuffle=False)
        ds = ds.interleave(tf.data.TFRecordDataset).map(_parse_digits(tf)).batch(100)
        hits = scored = 0
        for images, labels in ds:
            preds = tf.argmax(predict(hidden_input=images)["out"], axis=1)
            hits += int(tf.reduce_sum(tf.cast(preds == tf.cast(labels[:, 0], tf.int64), tf.int32)))
            scored += int(labels.shape[0])
        report.update(scored=scored, accuracy=hits / scored)
    with open(os.path.join(args.report_dir, f"node{ctx.worker_num}.json"), "w") as f:
        json.dump(report, f)


def pipeline_train_fn(args, ctx):  # type: ignore[no-untyped-def]
    """examples/mnist/keras/mnist_pipeline.py's main_fun: a TFEstimator's train_fn reading the
    input_mapping columns (sorted: image, label) with DataFeed(ctx.mgr, False)."""
    import numpy as np
    import tensorflow as tf

    from dataplane.compat import TFNode, compat

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    tf_feed = TFNode.DataFeed(ctx.mgr, False)

    def rdd_generator():  # type: ignore[no-untyped-def]
        while not tf_feed.should_stop():
            batch = tf_feed.next_batch(1)
            if len(batch) > 0:
                example = batch[0]
                image = np.array(example[0]).astype(np.float32) / 16.0
                label = np.reshape(np.array(example[1]).astype(np.float32), (1,))
                yield (image, label)
            else:
                return

    ds = tf.data.Dataset.from_generator(
        rdd_generator, (tf.float32, tf.float32), (tf.TensorShape([64]), tf.TensorShape([1]))
    ).batch(args.batch_size)
    with strategy.scope():
        multi_worker_model = _build_and_compile_model(tf, args.lr)
    steps = int(args.rows / args.batch_size / ctx.num_workers * 0.9)
    multi_worker_model.fit(x=ds, epochs=args.epochs, steps_per_epoch=steps, verbose=0)
    compat.export_saved_model(multi_worker_model, args.export_dir, ctx.job_name == "chief")
    tf_feed.terminate()


def feed_and_answer_main(args, ctx):  # type: ignore[no-untyped-def]
    """One DataFeed(ctx.mgr, False), as TFoS programs have: read ``args["take"]`` training rows,
    terminate() the rest, then answer inference ((label*10 text, float32 label, the array))
    until shutdown, appending each answered row's label to ``dir/answered.txt``."""
    import numpy as np

    from dataplane.compat import TFNode

    tf_feed = TFNode.DataFeed(ctx.mgr, False)
    seen = []
    while len(seen) < args["take"] and not tf_feed.should_stop():
        seen.extend(tf_feed.next_batch(min(7, args["take"] - len(seen))))
    tf_feed.terminate()
    info = {
        "job_name": ctx.job_name, "task_index": ctx.task_index, "worker_num": ctx.worker_num,
        "num_workers": ctx.num_workers, "cluster_spec": ctx.cluster_spec,
        "rows": [[type(r).__name__, np.asarray(r[0]).tolist(), type(r[0]).__name__, r[1], r[2]]
                 for r in seen],
        "should_stop_after_terminate": tf_feed.should_stop(),
    }
    with open(os.path.join(args["dir"], "tfos.json"), "w") as f:
        json.dump(info, f)
    while not tf_feed.should_stop():
        batch = tf_feed.next_batch(5)
        if batch:
            with open(os.path.join(args["dir"], "answered.txt"), "a") as f:
                f.write("".join(f"{row[1]}\n" for row in batch))
            tf_feed.batch_results([(f"{row[1] * 10}:{row[2]}", np.float32(row[1]), np.asarray(row[0]))
                                   for row in batch])


def failing_main(args, ctx):  # type: ignore[no-untyped-def]
    """Reads a few rows, then raises (TFCluster.train must raise the node's error)."""
    from dataplane.compat import TFNode

    TFNode.DataFeed(ctx.mgr, False).next_batch(3)
    raise RuntimeError("map_fun failed on purpose")


def every_element_main(args, ctx):  # type: ignore[no-untyped-def]
    """A TFoS training loop on two workers: next_batch until should_stop, keeping every row's
    label. Once ``dir/terminate`` exists, worker 1 reads ``args["more"]`` rows, then
    terminate()s and goes on calling next_batch (for inference rows) until shutdown."""
    from dataplane.compat import TFNode

    feed = TFNode.DataFeed(ctx.mgr)
    seen, after, terminated = [], None, False
    path = os.path.join(args["dir"], f"node{ctx.worker_num}.json")
    while not feed.should_stop():
        batch = feed.next_batch(7)
        seen.extend(int(r[1]) for r in batch)
        if batch:
            with open(path + ".tmp", "w") as f:
                json.dump(seen, f)
            os.replace(path + ".tmp", path)
        if ctx.worker_num == 1 and not terminated:
            if after is None and os.path.exists(os.path.join(args["dir"], "terminate")):
                after = len(seen)
            if after is not None and len(seen) >= after + args["more"]:
                feed.terminate()
                terminated = True


def short_answer_main(args, ctx):  # type: ignore[no-untyped-def]
    """Answers inference with one result too few per batch."""
    from dataplane.compat import TFNode

    feed = TFNode.DataFeed(ctx.mgr, False)
    while not feed.should_stop():
        batch = feed.next_batch(7)
        if batch:
            feed.batch_results([row[1] for row in batch][:-1])


def raising_answer_main(args, ctx):  # type: ignore[no-untyped-def]
    """Answers two inference batches, then raises (as a model failing on bad input would)."""
    from dataplane.compat import TFNode

    feed = TFNode.DataFeed(ctx.mgr, False)
    answered = 0
    while not feed.should_stop():
        batch = feed.next_batch(5)
        if batch:
            if answered == 2:
                raise ValueError(f"the model failed on label {batch[0][1]}")
            feed.batch_results([row[1] for row in batch])
            answered += 1


def ps_joins_main(args, ctx):  # type: ignore[no-untyped-def]
    """InputMode.TENSORFLOW with a ps: the ps blocks as server.join() does; the worker returns."""
    import time

    if ctx.job_name == "ps":
        while True:
            time.sleep(1)


def stalled_worker_main(args, ctx):  # type: ignore[no-untyped-def]
    """InputMode.SPARK without master_node (every node a worker, as TFoS's default): worker 1
    reads three batches, then never reads its DataFeed again (stuck in its own code); worker 0
    reads until the feed ends."""
    import time

    from dataplane.compat import TFNode

    feed = TFNode.DataFeed(ctx.mgr, False)
    if ctx.task_index == 1:
        for _ in range(3):
            feed.next_batch(10)
        time.sleep(args["stall"])
        return
    while not feed.should_stop():
        feed.next_batch(10)
