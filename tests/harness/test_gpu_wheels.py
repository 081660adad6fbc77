"""The device call is prepared here (scripts/gpu/prepare_wheels.py, docs/gpu-check.md): the
wheels' folder is git-ignored, a dry run downloads nothing, and the documented command installs
what the script writes and runs a valid ``vshape gpu-check``."""
import importlib.util
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_vshape.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "gpu-check.md").read_text()


def _script():
    spec = importlib.util.spec_from_file_location("prepare_wheels",
                                                  ROOT / "scripts" / "gpu" / "prepare_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs a git checkout")
def test_wheel_folder_is_git_ignored():
    folder = _script().DEFAULT_DIR
    result = subprocess.run(["git", "check-ignore", "-q", f"{folder}/megatron_core-0.19.2.whl"],
                            cwd=ROOT)
    assert result.returncode == 0, f"{folder}/ is not in .gitignore"


def test_dry_run_downloads_nothing(tmp_path, capsys):
    script = _script()
    folder = tmp_path / "wheels"
    assert script.main(["--output", str(folder), "--dry-run"]) == 0
    download, other, wheel = capsys.readouterr().out.splitlines()
    assert shlex.split(other)[-1] == "megatron-core==0.16.1"
    words = shlex.split(download)
    assert words[words.index("--python-version") + 1] == "3.12"
    assert "manylinux_2_28_x86_64" in words and "--only-binary=:all:" in words
    assert "megatron-core==0.19.2" in words and str(folder) in words
    assert Path(shlex.split(wheel)[-1]).name == "src" and not folder.exists()
    assert "vshape-release-" in shlex.split(wheel)[-1]  # a copy, not the tree (RELEASE_FILES)


def test_the_project_wheel_is_built_from_a_copy_of_the_release_files(tmp_path):
    """Built in the working tree, setuptools' reused build/lib would ship modules deleted or
    moved since an earlier build; the copy holds only the release files, and the package
    without caches."""
    script = _script()
    copy = script.release_copy(tmp_path / "src")
    assert sorted(p.name for p in copy.iterdir()) == sorted(script.RELEASE_FILES)
    assert not list(copy.rglob("__pycache__"))
    shipped = {p.relative_to(copy).as_posix() for p in (copy / "megatron_vshape").rglob("*.py")}
    assert {p.relative_to(ROOT).as_posix() for p in (ROOT / "megatron_vshape").rglob("*.py")
            if "__pycache__" not in p.parts} == shipped


def test_doc_command_installs_what_the_script_writes():
    script = _script()
    (call, other, uneven) = [line.strip() for line in DOC.splitlines() if "--find-links" in line]
    # the second call: the same with megatron-core 0.16.1, bf16 pipelines only
    assert other.replace("0.16.1", "0.19.2").replace(" --no-fp32 --no-profile", "") == call
    # the third: the uneven-stage run alone (issue 48)
    assert uneven.replace(" --no-fp32 --no-profile --pipelines uneven", "") == call
    install, check = call.split(" && ")
    words = shlex.split(install)
    assert words[words.index("--find-links") + 1] == script.DEFAULT_DIR
    assert "--no-index" in words and set(script.INSTALL) <= set(words)
    # every requirement the script downloads is installed (by its project name)
    names = {re.split(r"[<>=]", r)[0] for r in script.REQUIREMENTS}
    assert names <= {re.split(r"[<>=]", w)[0] for w in words}
    assert f'carry: ["{script.DEFAULT_DIR}"]' in DOC and "timeout_s: 600" in DOC
    check, pack = check.split("; ")
    args = shlex.split(check)
    assert words[0] == args[0] == "python3"  # the device's Python, the one with torch
    assert args[1:3] == ["-m", "megatron_vshape"]
    parsed = build_parser().parse_args(args[3:])
    assert parsed.command == "gpu-check" and parsed.output == "/tmp/gc"
    # the report and eight profiles are more files than a device call returns: one tarball
    assert shlex.split(pack) == ["tar", "czf", "$OUT/gc.tgz", "-C", "/tmp", "gc"]
