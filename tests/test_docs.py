"""The documentation site builds with `mkdocs build --strict`: no broken links or
anchors, no page left out of the nav, and the API reference imports asynclock and
renders the docstrings' parameter, return and exception sections."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLCHAIN = {"mkdocs": "mkdocs", "material": "mkdocs-material",
             "mkdocstrings_handlers.python": "mkdocstrings[python]"}


def _missing() -> list[str]:
    missing = []
    for module, package in TOOLCHAIN.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(package)
    return missing


def test_docs_build_strict(tmp_path: Path) -> None:
    missing = _missing()
    if missing:
        pytest.skip(f"docs toolchain not installed ({', '.join(missing)}); "
                    "launch/setup.sh installs it")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"mkdocs build --strict failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "asynclock" / "index.html").is_file()
    for page, least in (("asynclock", 25), ("torch", 40), ("cuda", 5)):
        html = (tmp_path / "site" / "reference" / page / "index.html").read_text()
        for section in ("Parameters:", "Returns:", "Raises:"):
            found = html.count(f'doc-section-title">{section}<')
            assert found >= (least if section == "Parameters:" else 1), (page, section, found)
