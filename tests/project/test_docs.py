"""The README and the docs site (issue 41 item 1): a short README whose links resolve, generated pages
that match their sources, and a docs site that `mkdocs build --strict` builds, so a broken link or a
page missing from the navigation fails the suite."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT_BYTES = 15 * 1024


def _mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=project,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )


def test_readme_is_short_and_its_links_resolve() -> None:
    readme = ROOT / "README.md"
    assert readme.stat().st_size <= README_LIMIT_BYTES, f"README.md is {readme.stat().st_size} bytes"
    text = readme.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into the docs"
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"
    # The README gives the two commands .ci/run and a new user run.
    assert "./quickstart.sh" in text and "./test.sh" in text


def test_generated_pages_match_their_sources() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools/docs_gen.py"), "--check"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    run = _mkdocs_build(ROOT, tmp_path / "site")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site/reference/api/index.html").exists()


@pytest.mark.parametrize(
    "violation",
    ["[a page that does not exist](no-such-page.md)", "[a missing anchor](design.md#no-such-section)"],
)
def test_strict_build_fails_on_a_broken_link(tmp_path: Path, violation: str) -> None:
    """The guard itself: the same build refuses a docs tree with one broken link."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", project / "docs")
    index = project / "docs/index.md"
    index.write_text(index.read_text() + f"\n{violation}\n")
    run = _mkdocs_build(project, tmp_path / "site")
    assert run.returncode != 0
    assert "no-such" in run.stdout + run.stderr
