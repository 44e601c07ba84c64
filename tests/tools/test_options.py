"""The tooling's folder swap (``options.write_dir_atomically``): a folder written whole or not at all."""

import pytest

from fcprag_tools import options
from fcprag_tools.options import write_dir_atomically as write_dir


def _tree(folder):
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("crash", [RuntimeError, KeyboardInterrupt])
def test_the_folder_swap_leaves_the_old_folder_when_a_write_crashes_halfway(tmp_path, crash):
    out = tmp_path / "out"
    write_dir(out, lambda d: [(d / "a").write_text("old a"), (d / "sub").mkdir(), (d / "sub" / "b").write_text("1")])
    assert _tree(out) == {"a": "old a", "sub/b": "1"}

    def half(d):
        (d / "a").write_text("new a")
        raise crash("in the middle")

    with pytest.raises(crash, match="in the middle"):
        write_dir(out, half)
    assert _tree(out) == {"a": "old a", "sub/b": "1"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(crash):  # a folder that was not there is still not there, nor any temporary one
        write_dir(tmp_path / "new", half)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    write_dir(out, lambda d: (d / "c").write_text("c"))  # a whole write replaces the whole folder
    assert _tree(out) == {"c": "c"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_folder_swap_puts_the_old_folder_back_when_the_swap_itself_fails(tmp_path, monkeypatch):
    import os

    out = tmp_path / "out"
    write_dir(out, lambda d: (d / "a").write_text("old"))
    (tmp_path / f".out.tmp-{os.getpid()}").mkdir()  # left by a killed run of this process id: cleared
    (tmp_path / f".out.tmp-{os.getpid()}" / "stale").write_text("x")
    real, calls = os.replace, []

    def second_fails(a, b):
        calls.append((a, b))
        if len(calls) == 2:  # out -> aside worked; the new folder -> out fails
            raise OSError("disk gone")
        return real(a, b)

    monkeypatch.setattr(options.os, "replace", second_fails)
    with pytest.raises(OSError, match="disk gone"):
        write_dir(out, lambda d: (d / "a").write_text("new"))
    assert len(calls) == 3 and _tree(out) == {"a": "old"}  # the third call moved it back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
