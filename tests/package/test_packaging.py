"""What ``pip install`` does to a user's environment, and what the wheel carries.

Users train inside containers whose torch and megatron-core they keep. One wheel is built from
the checkout's files (a few seconds; setuptools comes from the index) and dry-run installed
(``pip install --dry-run --report``: the JSON list of what pip would install) into a virtualenv
whose torch 2.15.0 and megatron-core 0.19.2 are stand-ins, dist-info metadata only: neither the
package nor any extra may install torch or megatron-core there, while the old setup's pins
would have. The wheel also carries the bundled configs (the top-level configs/, which setup.py
maps into the package), found by name once it is installed.
About 20 s, most of it pip resolving from the index.
"""
import importlib.util
import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import megatron_vshape
from megatron_vshape.configs import CONFIG_DIR, KINDS

pytestmark = pytest.mark.slow  # a wheel built, pip run in virtualenvs: 5-20 s each

ROOT = Path(__file__).resolve().parents[2]
USER_STACK = {"torch": "2.15.0", "megatron-core": "0.19.2"}
"""An NGC-style container's (CUDA builds; here only their metadata)."""
EXTRAS = ("megatron", "megatron-lm", "runtime", "test", "plot")
STACK_REQUIRES = {"megatron-core": ["torch>=2.6.0", "numpy", "packaging>=24.2"]}
"""What the real megatron-core 0.19.2 declares, so pip sees the same dependency graph."""


def _pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    # This machine's pip configuration caps torch (<= 2.14.1, the releases on its disk) by a
    # global constraint, which would itself replace the stand-in 2.15: the test is about this
    # package's requirements only.
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The package's wheel, built from a copy of the files a release is built from
    (scripts/gpu/prepare_wheels.py's ``release_copy``, which builds the GPU check's wheel)."""
    spec = importlib.util.spec_from_file_location("prepare_wheels",
                                                  ROOT / "scripts" / "gpu" / "prepare_wheels.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    src = script.release_copy(tmp_path_factory.mktemp("release") / "src")
    out = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(src))
    (built,) = out.glob("megatron_vshape-*.whl")
    return built


def _user_env(path: Path, stack: dict[str, str]) -> Path:
    """A virtualenv (no pip: the outer pip drives it with --python) holding ``stack``."""
    venv.create(path, with_pip=False)
    python = path / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for name, version in stack.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        requires = "".join(f"Requires-Dist: {r}\n" for r in STACK_REQUIRES.get(name, []))
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                       + requires)
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n"
                                             for f in ("METADATA", "INSTALLER", "RECORD")))
    return python


def _would_install(python: Path, *requirements: str, options=()) -> dict[str, str]:
    """{name: version} of what ``pip install`` would install into ``python``'s environment."""
    report = python.parent.parent / "report.json"
    _pip("--python", str(python), "install", "--dry-run", "--quiet", "--report", str(report),
         *options, *requirements)
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


@pytest.fixture(scope="module")
def user_env(tmp_path_factory) -> Path:
    return _user_env(tmp_path_factory.mktemp("user") / "venv", USER_STACK)


@pytest.mark.parametrize("extras", ["", f"[{','.join(EXTRAS)}]"], ids=["plain", "every-extra"])
def test_install_keeps_the_users_torch_and_megatron_core(wheel, user_env, extras):
    """Every extra at once: a requirement of any of them that replaced torch or megatron-core
    would show here (pip keeps an installed release that satisfies every requirement)."""
    planned = _would_install(user_env, f"{wheel}{extras}")
    assert planned["megatron-vshape"] == megatron_vshape.__version__
    assert "pyyaml" in planned
    assert not set(USER_STACK) & set(planned), planned
    if extras:
        assert {"psutil", "tqdm", "einops", "pytest"} <= set(planned)


def test_the_old_pins_would_have_replaced_them(wheel, user_env):
    """The check can fail: the old setup.py's ``megatron`` extra pinned torch==2.13.0 and
    megatron-core==0.16.*, and pip would have swapped both."""
    planned = _would_install(user_env, f"{wheel}[megatron]", "torch==2.13.0",
                             "megatron-core==0.16.*")
    assert planned["torch"].startswith("2.13.0") and planned["megatron-core"].startswith("0.16.")


def test_the_cpu_constraints_pin_a_fresh_environment(wheel, tmp_path):
    """README's CPU path (-c constraints/cpu.txt): torch 2.13.0 and megatron-core 0.16.1 for an
    environment that has neither, never an open torch range."""
    python = _user_env(tmp_path / "venv", {})
    planned = _would_install(python, f"{wheel}[test]",
                             options=("-c", str(ROOT / "constraints" / "cpu.txt")))
    assert planned["torch"].startswith("2.13.0") and planned["megatron-core"] == "0.16.1"


def test_the_wheel_carries_the_configs_and_license(wheel):
    """Every file of the top-level configs/ (setup.py's package_dir) lands in the package."""
    names = set(zipfile.ZipFile(wheel).namelist())
    assert CONFIG_DIR == ROOT / "configs"  # the checkout reads its own folder
    for kind in KINDS:
        shipped = {n for n in names if n.startswith(f"megatron_vshape/configs/bundled/{kind}/")}
        assert {f"megatron_vshape/configs/bundled/{kind}/{p.name}"
                for p in (CONFIG_DIR / kind).glob("*.yaml")} == {
                    n for n in shipped if n.endswith(".yaml")}
    assert "megatron_vshape/configs/bundled/models/README.md" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text
    assert f"Version: {megatron_vshape.__version__}\n" in text
    assert "Requires-Dist: torch==" not in text and "Requires-Dist: torch;" in text


def test_an_installed_wheel_finds_configs_by_name(wheel, tmp_path):
    """A regular (non-editable) install, used from a folder outside the checkout: its ``vshape``
    command finds a bundled model, grid and profile by name."""
    target = tmp_path / "site"
    _pip("install", "--no-deps", "--quiet", "--target", str(target), str(wheel))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}

    def vshape(*words: str) -> subprocess.CompletedProcess:
        # the wheel's own console script (its shebang is this interpreter)
        return subprocess.run([str(target / "bin" / "vshape"), *words], cwd=elsewhere, env=env,
                              text=True, capture_output=True, timeout=120)

    script = ("import megatron_vshape.configs as c; print(c.__file__); print(c.CONFIG_DIR)")
    done = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, text=True,
                          capture_output=True, timeout=60, check=True)
    where, configs = done.stdout.split()
    assert Path(where).is_relative_to(target)
    assert Path(configs) == target / "megatron_vshape" / "configs" / "bundled"
    plan = vshape("plan", "--model", "gpt-9.6b", "--gpus", "16", "--gpu-memory", "80",
                  "--profile", "cuda-gpt-9.6b-s3072", "--top", "1", "--no-progress")
    assert plan.returncode == 0, plan.stderr
    assert "--num-layers 30 --hidden-size 5120" in plan.stdout
    grid = vshape("grid", "gpt-9.6b", "--dry-run")
    assert grid.returncode == 0, grid.stderr
    assert "grid gpt-9.6b (gpt-9.6b): model gpt-9.6b (30 layers" in grid.stdout
    version = vshape("--version")
    assert version.stdout == f"vshape {megatron_vshape.__version__}\n"
