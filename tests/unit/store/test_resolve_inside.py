"""Path containment: no relative path, however built, resolves outside the store root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpoint.protocol.errors import BadRequestError
from rollpoint.store.filesystem import is_url, normalize_location, resolve_inside

ROOT = "/srv/rollpoint/run"
URL_ROOT = "memory://bucket/run"


@pytest.mark.parametrize(
    ("relative", "expected"),
    [
        ("snapshots/s1/manifest.json", f"{ROOT}/snapshots/s1/manifest.json"),
        ("./snapshots//s1/", f"{ROOT}/snapshots/s1"),
        ("..a/...", f"{ROOT}/..a/..."),
    ],
)
def test_relative_paths_are_joined_and_normalised(relative: str, expected: str) -> None:
    assert resolve_inside(ROOT, relative) == expected


def test_url_roots_are_joined_with_slashes() -> None:
    assert resolve_inside(URL_ROOT + "/", "snapshots/s1") == f"{URL_ROOT}/snapshots/s1"


@pytest.mark.parametrize(
    ("relative", "message"),
    [
        ("../etc/passwd", "contains '..'"),
        ("snapshots/../../etc", "contains '..'"),
        ("snapshots/s1/..", "contains '..'"),
        ("/etc/passwd", "is absolute"),
        ("s3://other-bucket/x", "is absolute"),
        ("snap\x00shot", "NUL byte"),
        ("..\\..\\etc", "backslash"),
        ("", "names no file or folder"),
        ("./", "names no file or folder"),
    ],
)
def test_unsafe_paths_are_refused_naming_them(relative: str, message: str) -> None:
    with pytest.raises(BadRequestError) as info:
        resolve_inside(ROOT, relative)

    assert message in info.value.message
    assert repr(relative) in info.value.message


def test_a_symlink_out_of_a_local_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    (root / "inner").symlink_to(root)

    with pytest.raises(BadRequestError, match=r"leaves .* through a symlink"):
        resolve_inside(str(root), "escape/secret")
    assert resolve_inside(str(root), "inner/file") == f"{root}/inner/file"


def test_file_urls_and_relative_roots_are_local_paths(tmp_path: Path) -> None:
    assert not is_url(f"file://{tmp_path}")
    assert normalize_location(f"file://{tmp_path}/") == str(tmp_path)
    assert normalize_location("runs/demo") == os.path.abspath("runs/demo")
    assert is_url("s3://bucket/run") and normalize_location("s3://bucket/run/") == "s3://bucket/run"


_COMPONENTS = st.sampled_from(
    ["..", ".", "", "a", "b c", "...", "..a", "~", "x:y", "é", "%2e%2e", "\\", "\x00", "/"]
)
_BUILT_PATHS = st.lists(_COMPONENTS, max_size=8).map("/".join)
_ANY_TEXT = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40)


def _assert_contained(root: str, relative: str) -> None:
    try:
        resolved = resolve_inside(root, relative)
    except BadRequestError:
        return
    assert resolved.startswith(root + "/")
    inside = resolved[len(root) + 1 :]
    assert inside and ".." not in inside.split("/") and "\x00" not in inside
    if not is_url(root):
        assert os.path.commonpath([root, os.path.normpath(resolved)]) == root


@given(st.one_of(_BUILT_PATHS, _ANY_TEXT))
def test_no_generated_path_escapes_a_local_root(relative: str) -> None:
    _assert_contained(ROOT, relative)


@given(st.one_of(_BUILT_PATHS, _ANY_TEXT))
def test_no_generated_path_escapes_a_url_root(relative: str) -> None:
    _assert_contained(URL_ROOT, relative)
