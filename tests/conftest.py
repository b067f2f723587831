"""Test options and the two lanes.

`--run-slow` and `--run-gpu` enable the tests marked `slow` and `gpu`.

Integration tests meet the released tools themselves (faiss, TensorBoard, W&B, transformers, onnxruntime,
OpenCLIP, CLIP_benchmark) and skip, through `pytest.importorskip`, where a tool is not installed. Under CI
(CI=true) such a skip fails the run and is listed: a break in an integration cannot land as a silence.
Tests marked `torchvision` (OpenCLIP, CLIP_benchmark) need torchvision, which the CPU build of torch cannot
import: they run in the field lane (`bash .ci/field`, a second environment with the CUDA build of torch, which
runs on a CPU) and are deselected, with a note, where torchvision is not installed.
"""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

# The tests mirror src/topoclip/ in folders; their shared helpers (_tolerance, _reference, ...) live here.
sys.path.insert(0, str(Path(__file__).resolve().parent))

HAVE_TORCHVISION = importlib.util.find_spec("torchvision") is not None
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# pytest.importorskip's reasons: a tool missing, or older than its minversion.
MISSING_TOOL = ("could not import", "required is")

_missing_tools: list[str] = []


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")
    parser.addoption("--run-gpu", action="store_true", help="run tests marked gpu (needs CUDA)")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow")
    skip_gpu = pytest.mark.skip(reason="gpu: pass --run-gpu on a CUDA machine")
    for item in items:
        if "slow" in item.keywords and not (config.getoption("--run-slow") or IN_CI):  # CI runs the whole suite
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not (config.getoption("--run-gpu") and torch.cuda.is_available()):
            item.add_marker(skip_gpu)
    if not HAVE_TORCHVISION:
        field = [item for item in items if "torchvision" in item.keywords]
        if field:
            items[:] = [item for item in items if "torchvision" not in item.keywords]
            config.hook.pytest_deselected(items=field)
            config._topoclip_field_lane = len(field)


def _record_missing_tool(report) -> None:
    if report.skipped and any(reason in str(report.longrepr) for reason in MISSING_TOOL):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _missing_tools.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _record_missing_tool(report)


def pytest_collectreport(report):
    _record_missing_tool(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    field = getattr(config, "_topoclip_field_lane", 0)
    if field:
        terminalreporter.write_line(f"{field} tests need torchvision (OpenCLIP, CLIP_benchmark) and were deselected "
                                    f"here: they run in the field lane, `bash .ci/field`")
    if _missing_tools:
        what = "FAILED under CI: integration tests skipped" if IN_CI else "integration tests skipped"
        terminalreporter.write_line(f"{what} ({len(_missing_tools)}), the tool not installed:")
        for line in _missing_tools:
            terminalreporter.write_line(f"  {line}")


def pytest_sessionfinish(session, exitstatus):
    if IN_CI and _missing_tools and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _torchrun_logs(tmp_path_factory):
    """Every torchrun a test starts logs under the session's tmp folder (PET_LOG_DIR is its --log-dir), which pytest
    removes with its old base folders: without one it makes a /tmp/torchelastic_* folder per launch and leaves it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PET_LOG_DIR", str(tmp_path_factory.mktemp("torchelastic")))
        yield
