"""pip install --no-build-isolation . : builds the _kda extension through the project's CMake build.

The extension is the CMake target _kda (python/CMakeLists.txt); setuptools only drives CMake and puts
the built module into the wheel beside python/kda/*.py. Nothing is downloaded: CMake finds the Debian
packages that scripts/install_deps.sh installs.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# setuptools' default build/ is the CMake build folder of the README's set-up: use build-pip/ instead.
(ROOT / "build-pip").mkdir(exist_ok=True)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = Path(self.build_temp).resolve() / "cmake"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(
            ["cmake", "-S", str(ROOT), "-B", str(build_dir), *generator,
             "-DCMAKE_BUILD_TYPE=Release", "-DKDA_BUILD_TESTS=OFF", "-DKDA_BUILD_BENCH=OFF",
             "-DKDA_BUILD_PYTHON=ON", f"-DPython3_EXECUTABLE={sys.executable}"],
            check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "_kda", "-j", str(os.cpu_count() or 1)],
                       check=True)
        built = list((build_dir / "python" / "kda").glob("_kda*.so"))
        if len(built) != 1:
            raise RuntimeError(f"expected one built _kda module in {build_dir}, found {built}")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[0], target)


setup(
    packages=["kda"],
    package_dir={"": "python"},
    ext_modules=[Extension("kda._kda", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    options={"build": {"build_base": "build-pip"}, "egg_info": {"egg_base": "build-pip"}},
)
