"""ctx.save_model's write: a path holds a whole model or what it held before, never a part."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dataplane.node.context import save_whole


def _half_save(path: str) -> None:
    """What a save cut off by a lost peer leaves: the SavedModel folder, then the error."""
    os.makedirs(os.path.join(path, "variables"))
    raise RuntimeError("UnavailableError: Collective ops is aborted by: peer lost")


def test_a_save_that_fails_leaves_no_model_at_the_path(tmp_path):
    # it left final_sm/variables/ (empty) at the final path: a restart script checking
    # os.path.exists(path) took the run as saved
    with pytest.raises(RuntimeError, match="peer lost"):
        save_whole(_half_save, str(tmp_path / "final_sm"))
    assert os.listdir(tmp_path) == []


def test_a_save_that_fails_over_an_earlier_model_keeps_it(tmp_path):
    target = tmp_path / "final_sm"
    (target / "variables").mkdir(parents=True)
    (target / "saved_model.pb").write_bytes(b"the earlier model")
    with pytest.raises(RuntimeError, match="peer lost"):
        save_whole(_half_save, str(target))
    assert os.listdir(tmp_path) == ["final_sm"]
    assert sorted(os.listdir(target)) == ["saved_model.pb", "variables"]
    assert (target / "saved_model.pb").read_bytes() == b"the earlier model"
    with pytest.raises(FileExistsError, match="final_sm exists and save_model was given overwrite=False"):
        save_whole(lambda p: None, str(target), overwrite=False)


@pytest.mark.parametrize("name", ["sm", "model.h5", "model.keras"])
def test_keras_models_saved_whole_load_back_equal(tmp_path, name):
    # a SavedModel folder and .h5 (tf_keras), .keras (Keras 3): the sibling written first keeps
    # the extension that picks the format; saving again replaces the first copy
    import tf_keras
    import keras

    k = keras if name.endswith(".keras") else tf_keras
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    for seed in (1, 2):
        k.utils.set_random_seed(seed)
        model = k.Sequential([k.layers.Input((3,)), k.layers.Dense(2)])
        save_whole(model.save, str(tmp_path / name))
        assert os.listdir(tmp_path) == [name]
        back = k.models.load_model(str(tmp_path / name))
        np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(model(x)))
