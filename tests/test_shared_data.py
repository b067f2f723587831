"""Tests find shared reference data relative to the repository (or $TOPOCLIP_REFERENCE_DIR), never at a
machine's absolute path, and skip with a reason when it is absent."""
import re
from pathlib import Path

import _reference

TESTS = Path(__file__).resolve().parent
# A quoted absolute path into one machine's folders (a quote, then /work/, /home/, ...).
MACHINE_PATH = re.compile(r"""["'](?:/work|/home|/Users|/mnt|/data|/srv)/""")


def test_no_test_names_an_absolute_machine_path():
    """Failed on main: test_train_user_data.py read the vocabulary at /work/shared/reference/ (absolute)."""
    offenders = [f"{path.name}:{number}" for path in sorted(TESTS.rglob("*.py"))
                 for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
                 if MACHINE_PATH.search(line)]
    assert offenders == []


def test_reference_files_are_found_from_the_environment_or_not_at_all(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPOCLIP_REFERENCE_DIR", str(tmp_path))
    assert _reference.reference_file("no-such-file.txt") is None
    (tmp_path / "no-such-file.txt").write_text("here\n")
    assert _reference.reference_file("no-such-file.txt") == tmp_path / "no-such-file.txt"
    assert _reference.REPOSITORY == TESTS.parent and (_reference.REPOSITORY / "pyproject.toml").is_file()
