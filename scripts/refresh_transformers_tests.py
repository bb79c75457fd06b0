#!/usr/bin/env python3
"""Refresh tests/transformers_common/ from the transformers source distribution of a given version.

    python scripts/refresh_transformers_tests.py [--version 5.23.0]

Downloads the sdist of `transformers==VERSION` from the package index (pip download, no install), and copies its
`tests/test_modeling_common.py` and `tests/test_configuration_common.py` unchanged (their Apache-2.0 headers
included) into tests/transformers_common/, then records the version in tests/transformers_common/VERSION. The sdist
does not ship the modules those two import from (`tests/generation/test_utils.py`, `tests/exporters/test_export.py`,
`tests/utils/test_configuration_utils.py`); the stand-ins under tests/transformers_common/ are expertize's own and are
left alone. Rerun the common tests afterwards (`pytest tests/test_transformers_common.py`) and read the native
classes' rows first: a failure there is the harness's, not expertize's.
"""

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

FILES = ("test_modeling_common.py", "test_configuration_common.py")
TARGET = Path(__file__).resolve().parent.parent / "tests" / "transformers_common"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    import transformers

    parser.add_argument("--version", default=transformers.__version__, help="default: the installed version")
    version = parser.parse_args().version
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                               f"transformers=={version}", "-d", tmp])
        (sdist,) = Path(tmp).glob("transformers-*.tar.gz")
        with tarfile.open(sdist) as archive:
            for name in FILES:
                member = archive.getmember(f"transformers-{version}/tests/{name}")
                with archive.extractfile(member) as src, open(TARGET / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    (TARGET / "VERSION").write_text(f"{version}\n")
    print(f"tests/transformers_common/: {', '.join(FILES)} from transformers {version}")


if __name__ == "__main__":
    main()
