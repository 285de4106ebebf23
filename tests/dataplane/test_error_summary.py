"""What NodeError says of a node's traceback (error_summary), on real tracebacks."""

from __future__ import annotations

import traceback

from dataplane.errors import error_summary, known_fix, spark_job_error


def _traceback_of(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException:  # noqa: BLE001
        return traceback.format_exc()
    raise AssertionError("did not raise")


def test_a_message_over_several_lines_keeps_its_reason():
    # Keras names the failing layer on the first line and says why on the next ones
    def fit():
        try:
            {}["x"]
        except KeyError:
            raise ValueError(
                "Exception encountered when calling layer 'dense' (type Dense).\n\n"
                'Input 0 of layer "dense" is incompatible with the layer: expected axis -1 of '
                "input shape to have value 4, but received input with shape (None, None)\n\n"
                "Call arguments received by layer 'dense' (type Dense):\n"
                "  • inputs=tf.Tensor(shape=(None, None), dtype=float32)"
            ) from None

    assert error_summary(_traceback_of(fit)).splitlines() == [
        "ValueError: Exception encountered when calling layer 'dense' (type Dense).",
        'Input 0 of layer "dense" is incompatible with the layer: expected axis -1 of input '
        "shape to have value 4, but received input with shape (None, None)",
        "Call arguments received by layer 'dense' (type Dense):",
        "  • inputs=tf.Tensor(shape=(None, None), dtype=float32)",
    ]


def test_the_last_error_of_a_chain_and_no_traceback_lines():
    def chained():
        try:
            raise KeyError("label")
        except KeyError as e:
            raise RuntimeError("could not build the batch") from e

    assert error_summary(_traceback_of(chained)) == "RuntimeError: could not build the batch"


def test_a_generator_error_inside_tensorflow_text():
    import tensorflow as tf

    def gen():
        yield 1
        raise KeyError("boom in the generator")

    text = _traceback_of(lambda: list(tf.data.Dataset.from_generator(gen, output_types=tf.int32)))
    assert error_summary(text) == "KeyError: 'boom in the generator'"


def test_a_failure_inside_a_tf_data_function_keeps_its_message():
    # a corrupt image under MWMS fit (ctx.dataset(decode=...)): the summary kept "Detected at
    # node ..." and "<stack traces unavailable>" and dropped the line that says what failed
    text = (
        "Traceback (most recent call last):\n"
        '  File "/work/main/dataplane/node/process.py", line 437, in _run_main\n'
        "tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution error:\n\n"
        "Detected at node Assert/AssertGuard/Assert_tfg_inlined_Assert/AssertGuard_1 defined at (most recent call last):\n"
        "<stack traces unavailable>\n"
        "Error in user-defined function passed to ParallelMapDatasetV2:4 transformation with iterator: "
        "Iterator::Root::Prefetch::RebatchV2::Map::Prefetch::RebatchV2::ParallelMapV2: assertion failed: "
        "[ctx.dataset(decode=...): column image: a value is not a JPEG image, at row (of this pass):] "
        "[15] [id =] [211] [label =] [1]\n"
        "\t [[{{node Assert/AssertGuard/Assert_tfg_inlined_Assert/AssertGuard_1}}]]\n"
        "\t [[MultiDeviceIteratorGetNextFromShard]]\n"
        " [Op:__inference_train_function_1924]\n"
    )
    assert error_summary(text) == (
        "tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution error:\n"
        "assertion failed: [ctx.dataset(decode=...): column image: a value is not a JPEG image, "
        "at row (of this pass):] [15] [id =] [211] [label =] [1]")


def test_long_messages_are_cut():
    text = _traceback_of(lambda: (_ for _ in ()).throw(ValueError("\n".join(["x" * 500] * 20))))
    out = error_summary(text)
    assert len(out.splitlines()) <= 8 and len(out) == 1500 and out.endswith("...")


def test_a_failed_spark_job_keeps_the_python_error_without_the_jvm_stack():
    text = (
        "An error occurred while calling o123.collect.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 failed\n"
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3/pyspark/worker.py", line 1, in main\n'
        "ModuleNotFoundError: No module named 'dataplane'\n"
        " SQLSTATE: 38000\n"
        "\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:572)\n"
        "\tat org.apache.spark.sql.execution.python.PythonArrowOutput$$anon$1.read(PythonArrowOutput.scala:118)\n"
        "\t... 20 more\n"
        "Driver stacktrace:\n"
    )
    assert error_summary(text) == "ModuleNotFoundError: No module named 'dataplane'"


def test_a_failed_spark_job_is_worded_the_same_for_the_launch_and_the_push():
    # the launch job worded its failure with error_summary alone, which gave Py4J's header line
    # ("An error occurred while calling o85.collectToPython.") for a JVM error
    jvm = (
        "An error occurred while calling o85.collectToPython.\n"
        ": org.apache.spark.SparkException: [FAILED_READ_FILE.FILE_NOT_EXIST] Encountered error "
        "while reading file file:///d/part-0.parquet. File does not exist. SQLSTATE: 42K03\n"
        "\tat org.apache.spark.sql.errors.QueryExecutionErrors$.fileNotExistError(QueryExecutionErrors.scala:1)\n"
    )
    assert spark_job_error(RuntimeError(jvm)) == (
        "SparkException: [FAILED_READ_FILE.FILE_NOT_EXIST] Encountered error while reading file "
        "file:///d/part-0.parquet. File does not exist."
    )
    python = (
        "An exception was thrown from the Python worker. Please see the stack trace below.\n"
        "Traceback (most recent call last):\n"
        '  File "/app/job.py", line 9, in price\n'
        "ValueError: no price for id 150\n"
        "  which the report continues\n"
    )
    assert spark_job_error(RuntimeError(python)) == "ValueError: no price for id 150\n  which the report continues"
    assert spark_job_error(RuntimeError(python), max_lines=1) == "ValueError: no price for id 150"
    ours = "Job aborted\nTraceback (most recent call last):\ndataplane.errors.FeedError: node 1 went away\n"
    assert spark_job_error(RuntimeError(ours)) == "dataplane.errors.FeedError: node 1 went away"
    # a static JVM method's call reads "z:...", which the header pattern missed
    static = ("An error occurred while calling z:org.apache.hadoop.fs.FileSystem.getFileSystemClass.\n"
              ': org.apache.hadoop.fs.UnsupportedFileSystemException: No FileSystem for scheme "s3"\n'
              "\tat org.apache.hadoop.fs.FileSystem.getFileSystemClass(FileSystem.java:3581)\n")
    assert spark_job_error(RuntimeError(static)) == 'UnsupportedFileSystemException: No FileSystem for scheme "s3"'
    task = "Job aborted\nformats.errors.StorageError: cannot read s3://b/k: denied\n"
    assert spark_job_error(RuntimeError(task)) == "formats.errors.StorageError: cannot read s3://b/k: denied"


def test_a_spark_error_whose_jvm_has_gone_is_named_not_raised_again():
    # py4j's Py4JJavaError fetches its text from the JVM on str(): once that JVM has exited
    # (out of memory in local mode), wording the job's failure raised ConnectionRefusedError
    class Py4JJavaError(Exception):
        def __str__(self) -> str:
            raise ConnectionRefusedError(111, "Connection refused")

    assert spark_job_error(Py4JJavaError()) == (
        "Py4JJavaError (its text could not be read: Spark's JVM no longer answers)")
    assert spark_job_error(RuntimeError("")) == "RuntimeError('')"


def test_a_driver_script_s_function_sent_to_a_child_process_is_explained():
    # main and its helpers reach the node by value; multiprocessing finds what a child runs by
    # module and name, and the node's __main__ is not the user's script
    fork = ("_pickle.PicklingError: Can't pickle <function square at 0x7f1b53200040>: "
            "attribute lookup square on __main__ failed")
    spawn = "AttributeError: Can't get attribute 'square' on <module '__main__' (built-in)>"
    for text in (fork, spawn):
        fix = known_fix(text)
        assert fix is not None and "a module the executors can import" in fix and "addPyFile" in fix, fix


def test_data_notes_name_an_empty_pass_only_when_there_was_one():
    from dataplane.driver.feed import DataNotes, _EpochBooks, _empty_notes, _Split
    from dataplane.errors import NodeError

    def books(assigned, limit, reading):  # type: ignore[no-untyped-def]
        return _EpochBooks(3, ["w0", "w1"], assigned=assigned, limit=limit, reading=reading)

    train = _Split("train", None, None, b"", {}, rows=None)  # no array column: not scanned
    assert _empty_notes([train], [books({0: 1, 1: 0}, 0, {0, 1})]) == [
        "epoch 3 (train, 1 of 1): its 1 row(s) over 2 workers leave some worker none, so every worker "
        "yielded none (each yields the smallest worker's share); push at least one row per worker."]
    # both workers left the epoch early (take(k), then the main failed): nothing about the data
    assert _empty_notes([train], [books({0: 50, 1: 50}, 0, set())]) == []
    assert _empty_notes([train], [books({0: 50, 1: 50}, 50, {0, 1})]) == []
    empty = _Split("train", None, None, b"", {}, rows=0)  # the scan counted none: said once
    notes = _empty_notes([empty], [books({0: 0, 1: 0}, 0, {0, 1})])
    assert notes == ["the DataFrame given to train(df) has no rows, so every worker's pass over "
                     "it is empty; check the filters or joins that built it."]
    err = NodeError("node 0: main raised:\nValueError: boom")
    DataNotes(empty=notes).add_to(err)
    DataNotes(empty=notes).add_to(err)  # the same error raised again by shutdown: said once
    assert str(err) == f"node 0: main raised:\nValueError: boom\nThe data may be why: {notes[0]}"


def test_known_tensorflow_failures_get_their_fix():
    from dataplane.errors import known_fix

    # Keras 3's fit under MultiWorkerMirroredStrategy (TF 2.21), as a node reports it
    keras3 = (
        'Traceback (most recent call last):\n  File "/n/main.py", line 13, in main\n'
        "    m.fit(ds, epochs=1, verbose=0)\n"
        '  File "/v/site-packages/keras/src/utils/traceback_utils.py", line 122, in error_handler\n'
        "    raise e.with_traceback(filtered_tb) from None\n"
        "ValueError: Attempt to convert a value (PerReplica:{\n  0: <tf.Tensor: shape=(16, 4)>\n"
        "}) with an unsupported type (<class 'tensorflow.python.distribute.values.PerReplica'>) to a Tensor.\n"
    )
    assert "import tf_keras as keras" in known_fix(keras3)
    # the same error from tf_keras' own code is something else
    assert known_fix(keras3.replace("/keras/src/", "/tf_keras/src/")) is None
    assert known_fix("ValueError: shapes (None, 3) and (None, 4) are incompatible") is None
    # Keras 3's fit on ctx.dataset(32, features="x"): no label= given, so no targets
    no_label = (
        'Traceback (most recent call last):\n  File "/n/main.py", line 11, in main\n'
        '    m.fit(ctx.dataset(32, features="x"), epochs=1, verbose=0)\n'
        '  File "/v/site-packages/keras/src/utils/traceback_utils.py", line 122, in error_handler\n'
        "    raise e.with_traceback(filtered_tb) from None\n"
        '  File "/v/site-packages/keras/src/backend/tensorflow/core.py", line 154, in convert_to_tensor\n'
        "    return tf.convert_to_tensor(x, dtype=dtype)\n"
        "ValueError: None values not supported.\n"
    )
    assert "ctx.dataset(..., label='y')" in known_fix(no_label)
    assert known_fix(no_label.replace("m.fit(", "m.predict(")) is None
    # a one-input model fed every column (no features=), as Keras 3 and tf_keras say it
    keras3_dict = (
        "ValueError: Exception encountered when calling Sequential.call().\n\n"
        "\x1b[1mThe structure of `inputs` doesn't match the expected structure.\n"
        "Expected: keras_tensor\n"
        "Received: inputs={'id': 'Tensor(shape=(None,))', 'x': 'Tensor(shape=(None, 4))'}\x1b[0m\n"
    )
    tf_keras_dict = ('ValueError: Missing data for input "input_1". You passed a data dictionary '
                     "with keys ['id', 'x']. Expected the following keys: ['input_1']")
    assert "features='x'" in known_fix(keras3_dict) and known_fix(keras3_dict) == known_fix(tf_keras_dict)
    # a list column the reader yields ragged (its shape not declared) into a Dense layer
    keras3_ragged = (
        "tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution error:\n"
        "assertion failed: [The matrices in `a` and `b` may not be ragged in their innermost "
        "dimension.] [Condition x == y did not hold element-wise:] [x (sequential_1/dense_1/"
        "RaggedMatMul/Size:0) = ] [63] [y (sequential_1/dense_1/RaggedMatMul/Size_1:0) = ] [64]\n"
    )
    tf_keras_ragged = (
        "ValueError: Exception encountered when calling layer 'dense' (type Dense).\n"
        "Dense layer only supports RaggedTensors when the innermost dimension is non-ragged. "
        "Received: inputs.shape=(None, None).\n"
    )
    assert "shapes={'image': (784,)}, on the reader or on ctx.dataset" in known_fix(keras3_ragged)
    assert known_fix(keras3_ragged) == known_fix(tf_keras_ragged)
    empty = ("ValueError: Unexpected result of `train_function` (Empty logs). This could be due "
             "to issues in input pipeline that resulted in an empty dataset.")
    assert known_fix(empty).startswith("fit's first epoch got no batch from its dataset: the pass was empty.")
    # a node that knows why its pass was empty: its note replaces the guesses, other fixes stay
    note = "a pass over ctx.dataset(split='train') ended without rows: read one pass per epoch."
    assert known_fix(empty, note) == f"The data may be why: {note}"
    assert known_fix(keras3_ragged, note) == f"{known_fix(keras3_ragged)}\nThe data may be why: {note}"
    assert known_fix("ValueError: a bug of main's", note) == f"The data may be why: {note}"
    assert known_fix(empty, None) == known_fix(empty)
    # Keras' bold on and off do not reach the message
    summary = error_summary(keras3_dict)
    assert "\x1b" not in summary and "The structure of `inputs` doesn't match" in summary, summary


def test_ragged_columns_are_named_with_their_lengths_and_the_way_to_find_the_rows():
    from dataplane.driver.feed import _ragged_notes, _Split

    flat = _Split("train", None, None, b"", {}, rows=200, ragged={"x": (0, 3, 4)})
    nested = _Split("validation", None, None, b"", {}, rows=9, ragged={"img": (1, 7, 8)})
    first, second = _ragged_notes([flat, nested])
    assert first.startswith("column 'x' holds arrays of 3 to 4 values, so ctx.dataset() yields "
                            "it as a tf.RaggedTensor"), first
    assert "df.where(F.size('x') != 4) finds them" in first, first
    assert second.startswith("column 'img' of train(validation=...) holds nested arrays whose "
                             "level-1 arrays have 7 to 8 values, so"), second
    assert "Declare ctx.dataset(..., shapes={'img': (...)})" in second, second
    assert _ragged_notes([_Split("train", None, None, b"", {}, rows=5)]) == []
    # said only when the failure is about ragged tensors: a text model fails for other reasons
    from dataplane.driver.feed import DataNotes
    from dataplane.errors import NodeError

    other = NodeError("node 0: main raised:\nRuntimeError: Collective ops must be configured")
    DataNotes(ragged=[first]).add_to(other)
    assert "The data may be why" not in str(other)
    dense = NodeError("node 0: main raised:\nValueError: ...", remote_traceback="... RaggedMatMul ...")
    DataNotes(ragged=[first]).add_to(dense)
    assert str(dense).endswith(f"The data may be why: {first}")
    # an earlier failed call comes first, then the empty passes, then the ragged columns
    both = NodeError("node 0: main raised:\nValueError: ragged", remote_traceback="")
    DataNotes(failed_call="an earlier train() call failed (x).", empty=["no rows."], ragged=[first]).add_to(both)
    assert str(both).endswith(f"The data may be why: an earlier train() call failed (x). no rows. {first}")


def test_the_failed_call_note_tells_cut_epochs_from_withdrawn_ones():
    from dataplane.driver.feed import _failed_call_note

    err = ValueError("pushing epoch 4 failed: PythonException: no price for id 350\n  (traceback)")
    both = _failed_call_note(err, [4], [5, 6])
    assert both == (
        "an earlier train() call failed (pushing epoch 4 failed: PythonException: no price for id "
        "350); its epoch 4 ended early with only the rows that had arrived, possibly none (a Keras "
        "fit stops or fails on an empty epoch); its epochs 5-6, which no worker had begun, were "
        "withdrawn. A main that failed cannot pick up the training where it stopped: fix the cause "
        "and start a new cluster (dataplane.run) for the next try."
    )
    only_gone = _failed_call_note(KeyboardInterrupt(), [], [7])
    assert only_gone.startswith("an earlier train() call failed (KeyboardInterrupt); its epoch 7, which no")
    assert "ended early" not in only_gone


def test_a_tensorflow_without_remote_filesystems_is_explained_with_the_ways_that_work():
    # TensorFlow 2.18+ (and 2.16 without tensorflow-io imported) has no s3:// or hdfs://: a
    # main's own model.save or a callback writing there failed with TensorFlow's bare words
    text = ("tensorflow.python.framework.errors_impl.UnimplementedError: File system scheme 's3' "
            "not implemented (file: 's3://models/run1/model.keras')")
    fix = known_fix(text)
    assert fix is not None and "ctx.save_model(model, url)" in fix and "pyarrow.fs" in fix, fix
    assert "dataplane.predict" in fix and "ctx.local_copy(url)" in fix and "local directory" in fix, fix
    assert known_fix(text.replace("not implemented", "is fine")) is None


def test_a_graph_error_keeps_its_message_after_the_stack_of_where_its_op_was_made():
    # a text label into a Keras loss: the NodeError said only "UnimplementedError: Graph
    # execution error:", since the stack TF prints before the message ended the summary
    stack = "".join(f'  File "/venv/keras/src/trainers/trainer.py", line {n}, in f{n}\n\n' for n in range(12))
    text = (
        "Traceback (most recent call last):\n"
        '  File "/work/main/dataplane/node/process.py", line 476, in _run_main\n'
        "tensorflow.python.framework.errors_impl.UnimplementedError: Graph execution error:\n\n"
        "Detected at node compile_loss/sparse_categorical_crossentropy/Cast defined at (most recent call last):\n"
        f"{stack}"
        "Cast string to float is not supported\n"
        "\t [[{{node compile_loss/sparse_categorical_crossentropy/Cast}}]] [Op:__inference_multi_step_on_iterator_519]\n"
    )
    assert error_summary(text) == (
        "tensorflow.python.framework.errors_impl.UnimplementedError: Graph execution error:\n"
        "Cast string to float is not supported")
    assert "StringIndexer" in known_fix(text) and "features=[...]" in known_fix(text)
    # several root errors: the first one's message, not TF's count of them
    several = text.replace("Cast string to float is not supported\n",
                           "2 root error(s) found.\n  (0) UNIMPLEMENTED:  Cast string to float is not supported\n")
    assert error_summary(several).splitlines()[1].strip() == "(0) UNIMPLEMENTED:  Cast string to float is not supported"


def test_fit_with_validation_split_on_the_feed_is_told_to_split_the_dataframe():
    keras3 = ("ValueError: Argument `validation_split` is only supported for tensors or NumPy arrays."
              "Found incompatible type in the input: [<class 'tensorflow.python.data.ops.dataset_ops._OptionsDataset'>]")
    tf_keras = ("ValueError: `validation_split` is only supported for Tensors or NumPy arrays, found "
                "following types in the input: [<class 'tensorflow.python.data.ops.dataset_ops.PrefetchDataset'>]")
    for text in (keras3, tf_keras):
        fix = known_fix(text)
        assert fix is not None and "df.randomSplit([0.8, 0.2], seed=1)" in fix, fix
        assert "validation=val_df" in fix and "split='validation'" in fix, fix
