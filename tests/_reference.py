"""Reference data shared by the tests but not shipped with the package (e.g. the paper's ERNIE vocabulary).

Found relative to the repository, never at a machine's absolute path: $TOPOCLIP_REFERENCE_DIR, then
shared/reference inside the repository, then shared/reference beside it. Tests that need a file skip
with ERNIE_MISSING-style reasons when it is absent.
"""
import os
from pathlib import Path
from typing import Optional

REPOSITORY = Path(__file__).resolve().parents[1]


def reference_file(name: str) -> Optional[Path]:
    """The shared reference file `name`, or None when none of the places holds it."""
    folders = [os.environ.get("TOPOCLIP_REFERENCE_DIR"), REPOSITORY / "shared" / "reference",
               REPOSITORY.parent / "shared" / "reference"]
    return next((Path(folder) / name for folder in folders if folder and (Path(folder) / name).is_file()), None)


def missing(name: str) -> str:
    """The skip reason of a test whose reference file `name` is in none of the places."""
    return f"{name} not found in $TOPOCLIP_REFERENCE_DIR, shared/reference in the repository or beside it"


ERNIE_VOCAB_NAME = "ernie-2.0-en-vocab.txt"
ERNIE_VOCAB = reference_file(ERNIE_VOCAB_NAME)
ERNIE_MISSING = missing(ERNIE_VOCAB_NAME)
CAT = reference_file("cat.jpeg")  # a real photo
CAT_MISSING = missing("cat.jpeg")
