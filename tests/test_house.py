"""The house rules of the code (docs/design.md): every file of kvfill's
packages at most 350 lines and every class at most 200, and each file opens
with a docstring or comment saying its one role - so a newcomer finds each
part by its file name and reads one story per file."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "connector", "record", "bank", "bench", "check")
MAX_FILE_LINES = 350
MAX_CLASS_LINES = 200

FILES = sorted(p for d in PACKAGES for p in (ROOT / d).glob("*.py"))


def test_every_package_has_files_to_check():
    assert {p.parent.name for p in FILES} == set(PACKAGES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_file_is_one_role_of_bounded_size(path):
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_FILE_LINES, f"{path.relative_to(ROOT)} has {lines} lines; split it by role (<= {MAX_FILE_LINES})"
    tree = ast.parse(text)
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES}
    assert not long, f"{path.relative_to(ROOT)}: classes over {MAX_CLASS_LINES} lines: {long}"
    opening = ast.get_docstring(tree) or "".join(
        line.lstrip("# ") for line in text.splitlines()[:3] if line.startswith("#") and not line.startswith("#!"))
    assert len(opening.split()) >= 4, f"{path.relative_to(ROOT)} does not open by saying its role"
