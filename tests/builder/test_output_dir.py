"""``llmc build``'s output folder: nothing of the user's is replaced, temp folders of killed builds are cleaned
(never a live one's), a kill -9 at any point leaves the old build or the new one, and a full disk leaves nothing."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmc import manifest as mf
from llmc.builder.output_dir import TMP_MARKER, remove_stale_temp_dirs, replace_dir
from llmc.builder.pipeline import build
from llmc.errors import BuildError
from llmc.recipe import load_recipe
from tests.builder.test_pipeline import siblings, write_recipe


def dead_pid() -> int:
    """A PID with no process behind it (a child that has exited and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def old_build(tmp_path_factory, tiny_hf_dir) -> tuple[Path, Path]:
    """(recipe path, a finished build of it) to copy from."""
    root = tmp_path_factory.mktemp("old")
    recipe = write_recipe(root, tiny_hf_dir)
    build(load_recipe(recipe), out_dir=root / "build" / "tiny")
    return recipe, root / "build" / "tiny"


@pytest.mark.parametrize("manifest", ['{"name": "web"}', "{not json", '{"format_version": 99}', None])
def test_a_folder_without_a_valid_llmc_manifest_is_never_replaced(tmp_path, tiny_hf_dir, manifest):
    out = tmp_path / "v"
    out.mkdir()
    if manifest is not None:
        (out / "manifest.json").write_text(manifest)
    (out / "important.txt").write_text("x")
    with pytest.raises(BuildError, match="is not an llmc build that this llmc reads") as info:
        build(load_recipe(write_recipe(tmp_path, tiny_hf_dir)), out_dir=out)
    assert "remove that folder yourself" in str(info.value) and "\n" not in str(info.value)
    assert (out / "important.txt").read_text() == "x" and siblings(out) == ["tiny.yaml", "v"]


def test_stale_temp_folders_of_dead_builds_are_cleaned_and_live_ones_kept(tmp_path, old_build):
    recipe, old = old_build
    parent = tmp_path / "out"
    parent.mkdir()
    dead, alive = dead_pid(), os.getppid()
    marker = json.dumps({"pid": dead, "host": os.uname().nodename})
    for name, pid in ((".tiny.tmp-", dead), (".other.tmp-", dead), (".tiny.tmp-", alive)):
        folder = parent / f"{name}{pid}"
        folder.mkdir()
        (folder / TMP_MARKER).write_text(marker)
        (folder / "checkpoint").mkdir()
        (folder / "checkpoint" / "rank0.safetensors").write_bytes(b"x" * 1000)
    (parent / f".empty.tmp-{dead}").mkdir()
    user = parent / f".notes.tmp-{dead}"  # looks like a temp name, but is not llmc's: kept
    user.mkdir()
    (user / "mine.txt").write_text("keep")
    elsewhere = parent / f".far.tmp-{dead}"  # another host's build on a shared filesystem: kept
    elsewhere.mkdir()
    (elsewhere / TMP_MARKER).write_text(json.dumps({"pid": dead, "host": "another-host"}))
    build(load_recipe(recipe), out_dir=parent / "tiny")
    assert siblings(parent / "tiny") == sorted([f".far.tmp-{dead}", f".notes.tmp-{dead}", f".tiny.tmp-{alive}",
                                                "tiny"])
    assert (user / "mine.txt").read_text() == "keep"


def test_an_old_build_left_renamed_away_is_put_back(tmp_path, old_build):
    _, old = old_build
    import shutil

    shutil.copytree(old, tmp_path / f".tiny.old-{dead_pid()}")
    assert remove_stale_temp_dirs(tmp_path) and mf.read_manifest(tmp_path / "tiny") == mf.read_manifest(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_dir_swaps_and_leaves_nothing(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr("llmc.builder.output_dir._exchange", lambda a, b: False)
    old, new = tmp_path / "target", tmp_path / ".new"
    old.mkdir()
    (old / "v").write_text("1")
    new.mkdir()
    (new / "v").write_text("2")
    replace_dir(new, old)
    assert (old / "v").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_full_disk_is_one_error_and_no_partial_output(tmp_path, tiny_hf_dir, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "x.safetensors"))

    monkeypatch.setattr("llmc.builder.pipeline.export_checkpoint", full)
    out = tmp_path / "out" / "tiny"
    with pytest.raises(BuildError, match="No space left on device") as info:
        build(load_recipe(write_recipe(tmp_path, tiny_hf_dir)), out_dir=out)
    assert "Fix: free space" in str(info.value) and siblings(out) == []


# A build in a subprocess that SIGKILLs itself at one named point of the swap (the deterministic kills).
KILLER = """
import os, signal, sys
from llmc.builder import output_dir
point = sys.argv.pop(1)
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
exchange, remove_tree, rename = output_dir._exchange, output_dir.remove_tree, os.rename
if point == "before-swap":
    output_dir._exchange = lambda a, b: die()
elif point == "after-swap":
    output_dir._exchange = lambda a, b: exchange(a, b) and die()
elif point == "while-deleting-old":
    def remove_tree(path, seen=[]):
        seen.append(path)
        if len(seen) == 2:  # the 1st call clears a leftover temp name; the 2nd deletes the old build
            next(p for p in path.iterdir() if p.name == "checkpoint").rename(path / "x")  # half gone
            die()
        return remove_tree.__wrapped__(path)
    remove_tree.__wrapped__ = output_dir.remove_tree
    output_dir.remove_tree = remove_tree
elif point == "between-renames":
    output_dir._exchange = lambda a, b: False
    calls = []
    def rename_once(a, b):
        calls.append(a)
        if len(calls) == 2:
            die()
        return rename(a, b)
    output_dir.os.rename = rename_once
from llmc.cli import main
main(sys.argv[1:])
"""


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def check_old_or_new(out: Path, expected_files: list[str], recipe_sha: str) -> None:
    assert mf.read_manifest(out).recipe_sha256 == recipe_sha and files(out) == expected_files


@pytest.mark.parametrize("point", ["before-swap", "after-swap", "while-deleting-old", "between-renames"])
def test_kill_at_each_point_of_the_swap_leaves_a_whole_build(tmp_path, old_build, point):
    import shutil

    recipe, old = old_build
    out = tmp_path / "out" / "tiny"
    shutil.copytree(old, out)
    expected = files(old)
    cmd = [sys.executable, "-c", KILLER, point, "build", str(recipe), "-o", str(out), "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if point != "between-renames":  # there the build folder is renamed away until the next build
        check_old_or_new(out, expected, mf.read_manifest(old).recipe_sha256)
    build(load_recipe(recipe), out_dir=out, force=True)  # the next build (in-process: quicker, same code)
    check_old_or_new(out, expected, mf.read_manifest(old).recipe_sha256)
    assert siblings(out) == ["tiny"]


def test_kill_at_random_times_leaves_the_old_build_or_the_new_one(tmp_path, old_build):
    import shutil

    recipe, old = old_build
    out = tmp_path / "out" / "tiny"
    shutil.copytree(old, out)
    expected, sha = files(old), mf.read_manifest(old).recipe_sha256
    cmd = [sys.executable, "-m", "llmc.cli", "build", str(recipe), "-o", str(out), "--force"]
    started = time.perf_counter()
    assert subprocess.run(cmd, capture_output=True, timeout=300).returncode == 0
    duration = time.perf_counter() - started
    rng = random.Random(18)
    for fraction in sorted(rng.uniform(0.3, 1.0) for _ in range(3)):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(duration * fraction)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        check_old_or_new(out, expected, sha)
    assert subprocess.run(cmd, capture_output=True, timeout=300).returncode == 0
    check_old_or_new(out, expected, sha)
    assert siblings(out) == ["tiny"]
