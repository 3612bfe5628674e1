"""Set up a virtual environment with one version of an integration's framework, for `bash dev.sh compat`.

    python requirements/compat.py VENV lightning oldest|newest|VERSION
    python requirements/compat.py VENV fastai oldest|newest|VERSION

"oldest" is the lower bound pyproject.toml's extra allows; "newest" the newest the package index has; a version
number, that version (to find the oldest that passes). The
environment gets the CPU torch build, the test tools, ranksafe (editable, no extras) and the framework at that
version with its own requirements, except torchvision (its only build here is for CUDA, and it breaks `import
lightning` on CPU torch): fastai is installed without its dependencies, then with the ones its metadata lists.
Prints the version installed.
"""

from __future__ import annotations

import email
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0+cpu"
# setuptools: older lightning releases import pkg_resources (gone from setuptools 81 on) without requiring it
TEST_TOOLS = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "cloudpickle",
    "setuptools<81",
    "s3fs",
    "moto[s3]>=5",
    "flask",
    "flask-cors",
]


def lower_bound(package: str) -> str:
    """The ``>=`` bound of ``package`` in pyproject.toml's optional dependencies."""
    m = re.search(rf'"{package}\s*>=\s*([\w.]+)"', (ROOT / "pyproject.toml").read_text())
    if m is None:
        raise SystemExit(f"pyproject.toml gives {package} no lower bound (>=)")
    return m.group(1)


def pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)


def requires(python: Path, spec: str) -> list[str]:
    """The requirements of ``spec``'s wheel, without torchvision and without those for extras."""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([str(python), "-m", "pip", "download", "-q", "--no-deps", "-d", d, spec], check=True)
        wheel = next(Path(d).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            meta = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith("METADATA"))))
    wanted = []
    for req in meta.get_all("Requires-Dist") or []:
        if "extra ==" in req or re.match(r"torchvision\b", req):
            continue
        wanted.append(req.split(";")[0].strip())
    return wanted


def main(venv: str, package: str, which: str) -> None:
    venv_path = ROOT / venv
    python = venv_path / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv_path)], check=True)
    version = lower_bound(package) if which == "oldest" else None if which == "newest" else which
    spec = package if version is None else f"{package}=={version}"
    pip(python, TORCH)
    pip(python, "--no-warn-conflicts", *TEST_TOOLS, "-e", str(ROOT), TORCH.split("+")[0])
    if package == "fastai":
        pip(python, "--no-deps", "--upgrade", spec)
        # accelerate: fastai.distributed imports it, and fastai's metadata does not list it (our extra does)
        pip(python, "--no-warn-conflicts", *requires(python, spec), "accelerate", TORCH.split("+")[0])
    else:
        pip(python, "--upgrade", spec, TORCH.split("+")[0])
    version = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version('{package}'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    print(f"{package} {version}")


if __name__ == "__main__":
    main(*sys.argv[1:])
