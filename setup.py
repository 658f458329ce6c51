"""Two additions to pyproject.toml:
  * the native route's custom-op library, the C files of mha_ep/native/csrc/, built with the machine's C compiler
    and the Python headers alone (no CUDA toolkit, no ORT headers: mha_ep/native/__init__.py), the sources' SHA-256
    built in (a library built from older sources is refused with how to rebuild it). Without a compiler the
    install still succeeds and says why the native route is missing; ``mha-ep --version`` says it too;
  * a wheel carries the top-level ``models/`` folder (the shipped models, MANIFEST.json, speech wavs) as
    ``mha_ep/_shipped_models``, where mha_ep/shipped.py looks first."""

import hashlib
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

SHIPPED = ("*.onnx", "*.json", "*.wav")
NATIVE_SOURCES = Path(__file__).resolve().parent / "mha_ep" / "native" / "csrc"


def source_sha256(folder: Path) -> str:
    """The SHA-256 of the library's sources: of the lines ``<SHA-256 of the file>  <name>`` (as sha256sum prints
    them) of every .c and .h file in ``folder``, sorted by name. mha_ep/native/__init__.py source_sha256 is the
    same rule."""
    files = sorted((path for path in folder.iterdir() if path.suffix in (".c", ".h")), key=lambda path: path.name)
    listing = "".join(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n" for path in files)
    return hashlib.sha256(listing.encode()).hexdigest()


NATIVE = Extension(
    "mha_ep.native._native",
    sources=sorted(f"mha_ep/native/csrc/{path.name}" for path in NATIVE_SOURCES.glob("*.c")),
    depends=sorted(f"mha_ep/native/csrc/{path.name}" for path in NATIVE_SOURCES.glob("*.h")),  # an edit rebuilds
    # the sources' hash, which mha_ep/native/__init__.py compares with the csrc/ beside the library it loads
    define_macros=[("MHA_EP_SOURCE_SHA256", '"%s"' % source_sha256(NATIVE_SOURCES))],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration", "-fvisibility=hidden"],
    libraries=["dl", "pthread"],
    py_limited_api=True,  # the stable ABI (Py_LIMITED_API in the source): one build for Python 3.10 and newer
)


class BuildPyWithModels(build_py):
    def run(self):
        super().run()
        source = Path(__file__).resolve().parent / "models"
        if self.editable_mode or not source.is_dir():  # editable installs read the checkout's models/ directly
            return
        target = Path(self.build_lib) / "mha_ep" / "_shipped_models"
        target.mkdir(parents=True, exist_ok=True)
        for pattern in SHIPPED:
            for path in source.glob(pattern):
                shutil.copy2(path, target / path.name)


class OptionalBuildExt(build_ext):
    """The native library is optional: a machine without a C compiler keeps the onnxruntime-extensions route."""

    def run(self):
        try:
            super().run()
        except Exception as error:  # noqa: BLE001 - distutils raises several kinds (no compiler, compile error)
            self.warn(f"mha_ep: the native custom-op library was not built ({error}); the onnxruntime-extensions "
                      f"route still works. Install a C compiler and the Python headers, then reinstall.")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001
            self.warn(f"mha_ep: the native custom-op library was not built ({error}); the onnxruntime-extensions "
                      f"route still works. Install a C compiler and the Python headers, then reinstall.")


setup(cmdclass={"build_py": BuildPyWithModels, "build_ext": OptionalBuildExt}, ext_modules=[NATIVE],
      options={"bdist_wheel": {"py_limited_api": "cp310"}})
