"""Reading foreign weight files never runs code: a pickle whose __reduce__ would act is refused unexecuted."""
import os
import pickle

import pytest
import torch

from topoclip.cli import main
from topoclip.io.convert.files import read_state_dict
from topoclip.core.errors import CheckpointError


class WritesAMarker:
    """Unpickling this calls os.system(...), which would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_malicious_pickle_is_refused_without_running(tmp_path, capsys, writer):
    marker = tmp_path / "executed"
    path = tmp_path / "weights.pt"
    payload = {"visual.proj": torch.zeros(2, 2), "trap": WritesAMarker(marker)}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as handle:
            pickle.dump(payload, handle)
    with pytest.raises(CheckpointError, match="never runs code"):
        read_state_dict(path)
    assert main(["convert", "--from", "openai", str(path), str(tmp_path / "out"), "--vocab", "unused"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("topoclip: error: refused to load") and error.count("\n") == 1
    assert not marker.exists()
    with open(path, "rb") as handle:  # the file really would have acted: an unrestricted load creates the marker
        pickle.load(handle) if writer == "pickle.dump" else torch.load(handle, weights_only=False)
    assert marker.exists()


def test_torchscript_archives_are_refused(tmp_path):
    path = tmp_path / "ViT-B-16.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    with pytest.raises(CheckpointError, match="TorchScript"):
        read_state_dict(path)


def test_training_wrappers_and_prefixes_are_removed(tmp_path):
    path = tmp_path / "epoch_3.pt"
    torch.save({"epoch": 3, "name": "run", "state_dict": {"module.logit_scale": torch.tensor(1.0),
                                                         "module.visual.proj": torch.ones(2, 2)}}, path)
    state = read_state_dict(path)
    assert sorted(state) == ["logit_scale", "visual.proj"]
    torch.testing.assert_close(state["visual.proj"], torch.ones(2, 2))


def test_unreadable_and_missing_files(tmp_path):
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="refused to load"):
        read_state_dict(tmp_path / "junk.bin")
    with pytest.raises(FileNotFoundError):
        read_state_dict(tmp_path / "absent.pt")
    with pytest.raises(FileNotFoundError, match="expected one of"):
        read_state_dict(tmp_path)
