"""OUT is the one folder the lab writes in (vllm_lab/outdir.py): a path outside it, or one that
passes a symbolic link below it, is refused with one sentence; nothing is written or deleted."""

import pytest

from vllm_lab import outdir


def test_a_path_outside_out_is_refused(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(outdir.OutsideOut, match="not inside OUT"):
        outdir.inside(out, out / ".." / "elsewhere")
    with pytest.raises(outdir.OutsideOut, match="not inside OUT"):
        outdir.make_folder(out, tmp_path / "sibling")
    assert not (tmp_path / "sibling").exists()
    assert outdir.inside(out, out / "a" / "b") == out / "a" / "b"  # not made yet: fine


def test_a_link_below_out_is_followed_by_nothing(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine")
    out.mkdir()
    (out / "exp").symlink_to(victim)
    with pytest.raises(outdir.OutsideOut, match="a symbolic link"):
        outdir.remove_tree(out, out / "exp" / "run")
    with pytest.raises(outdir.OutsideOut, match="a symbolic link"):
        outdir.make_folder(out, out / "exp" / "new")
    (out / "report").mkdir()
    (out / "report" / "index.html").symlink_to(victim / "keep")
    with pytest.raises(outdir.OutsideOut, match="a symbolic link"):
        outdir.no_links_within(out, out / "report")
    assert (victim / "keep").read_text() == "mine" and sorted(p.name for p in victim.iterdir()) == ["keep"]


def test_the_work_folder_is_checked_too(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".work").symlink_to(tmp_path)
    with pytest.raises(outdir.OutsideOut):
        outdir.work_folder(out)
