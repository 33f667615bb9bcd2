"""setup.py - the build hook of `pip install .` (pyproject.toml holds the
package's metadata): builds libcomet.so with the project's Makefile and puts
it inside the package `comet` (python/comet/), with _build_info.json saying
how it was built. No compiled Python extension: comet loads the library
through ctypes, so one wheel serves every Python 3 and every torch.

The backend:
  - CUDA when nvcc is found (PATH, else $CUDA_HOME/bin) and torch's NCCL (the
    nvidia.nccl package, in the environment being installed into) is found:
    comet's device code is then built against the NCCL torch loads, and
    comet loads that NCCL at import (one NCCL in the process);
  - CPU-only otherwise (`make NVCC=`).
  COMET_BUILD=cpu or COMET_BUILD=cuda forces one (cuda fails when nvcc or an
  NCCL is missing); NCCL_HOME=DIR (its include/ and lib/) names another NCCL.
The choice is printed (`pip install -v .` shows it) and kept:
comet.build_info().

Objects go to build-python/{cpu,cuda}/ (make's own build directory, kept
between installs, so a second install only links).
"""

import json
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_BASE = os.path.join("build-python", "setuptools")


def comet_version():
    text = open(os.path.join(ROOT, "include", "comet.h")).read()
    part = lambda name: re.search(r"#define COMET_VERSION_%s\s+(\d+)" % name, text).group(1)  # noqa: E731
    return "%s.%s.%s" % (part("MAJOR"), part("MINOR"), part("PATCH"))


_NCCL_PROBE = (
    "import os, nvidia.nccl as m\n"
    "for d in m.__path__:\n"
    "    if os.path.exists(os.path.join(d, 'include', 'nccl.h')) and "
    "os.path.exists(os.path.join(d, 'lib', 'libnccl.so.2')):\n"
    "        print(d); break\n"
)


def find_torch_nccl():
    """torch's NCCL (nvidia.nccl) in the environment being installed into, or
    None. pip builds in an isolated environment that hides that environment's
    packages, so the probe runs the same interpreter without pip's isolation
    variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    for probe_env in (os.environ, env):
        try:
            out = subprocess.run([sys.executable, "-c", _NCCL_PROBE], env=probe_env, capture_output=True,
                                 text=True, timeout=120).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out:
            return out
    return None


def find_nvcc():
    nvcc = shutil.which("nvcc")
    if not nvcc and os.environ.get("CUDA_HOME"):
        cand = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
        nvcc = cand if os.access(cand, os.X_OK) else None
    return nvcc


def choose_backend():
    """(backend, reason, make variables, build facts)."""
    want = os.environ.get("COMET_BUILD", "auto").lower()
    if want not in ("auto", "cpu", "cuda"):
        sys.exit("comet: COMET_BUILD=%s: use cpu, cuda or auto" % want)
    if want == "cpu":
        return "cpu", "COMET_BUILD=cpu", ["NVCC="], {}
    nvcc = find_nvcc()
    nccl, nccl_from = os.environ.get("NCCL_HOME"), "NCCL_HOME"
    if not nccl:
        nccl, nccl_from = find_torch_nccl(), "nvidia.nccl"
    if nvcc and nccl:
        facts = {"nvcc": nvcc, "nccl": nccl, "nccl_from": nccl_from}
        release = re.search(r"release (\d+)\.", subprocess.run([nvcc, "--version"], capture_output=True,
                                                               text=True).stdout)
        if release:  # the CUDA runtime comet links (comet/_capi.py loads torch's first), for build_info()
            facts["cudart"] = "libcudart.so." + release.group(1)
        reason = "nvcc at %s, NCCL from %s (%s)" % (nvcc, nccl_from, nccl)
        return "cuda", reason, ["NVCC=" + nvcc, "NCCL_HOME=" + nccl], facts
    missing = "no nvcc on PATH or in $CUDA_HOME/bin" if not nvcc else "torch's NCCL (nvidia.nccl) is not installed"
    if want == "cuda":
        sys.exit("comet: COMET_BUILD=cuda, but %s" % missing)
    return "cpu", missing, ["NVCC="], {}


def build_libcomet():
    """Run make; return (path of libcomet.so, build facts)."""
    backend, reason, make_vars, facts = choose_backend()
    how = "with the CUDA backend" if backend == "cuda" else "CPU-only (the CPU backend)"
    print("comet: building libcomet.so %s: %s" % (how, reason), flush=True)
    make = shutil.which("make")
    if not make:
        sys.exit("comet: `make` is needed to build libcomet.so (and a C11 compiler)")
    build = os.path.join("build-python", backend)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    cmd = [make, "-j%d" % max(1, os.cpu_count() or 1), "BUILD=" + build] + make_vars + [build + "/libcomet.so"]
    print("comet: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    so = os.path.realpath(os.path.join(ROOT, build, "libcomet.so"))
    facts = dict(facts, backend=backend, reason=reason, version=comet_version())
    return so, facts


class build_py(_build_py):
    """build_py, then libcomet.so and _build_info.json into the package."""

    def run(self):
        super().run()
        so, facts = build_libcomet()
        targets = [os.path.join(self.build_lib, "comet")]
        if getattr(self, "editable_mode", False):  # pip install -e .: the package is the source folder
            targets.append(os.path.join(ROOT, "python", "comet"))
        for dest in targets:
            os.makedirs(dest, exist_ok=True)
            shutil.copyfile(so, os.path.join(dest, "libcomet.so"))
            os.chmod(os.path.join(dest, "libcomet.so"), 0o755)
            with open(os.path.join(dest, "_build_info.json"), "w") as f:
                json.dump(facts, f, indent=1, sort_keys=True)

    def get_outputs(self, include_bytecode=1):
        out = super().get_outputs(include_bytecode)
        return out + [os.path.join(self.build_lib, "comet", n) for n in ("libcomet.so", "_build_info.json")]


cmdclass = {"build_py": build_py}

# A wheel for this platform (it carries a native library) that any Python 3 can load.
try:
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:
        _bdist_wheel = None
if _bdist_wheel is not None:

    class bdist_wheel(_bdist_wheel):
        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            return ("py3", "none", super().get_tag()[2])

    cmdclass["bdist_wheel"] = bdist_wheel

os.makedirs(os.path.join(ROOT, BUILD_BASE), exist_ok=True)
setup(
    version=comet_version(),
    cmdclass=cmdclass,
    options={"build": {"build_base": BUILD_BASE}, "egg_info": {"egg_base": BUILD_BASE}},
)
