"""Only one addition to pyproject.toml: a wheel carries the top-level ``models/`` folder (the shipped models,
MANIFEST.json, speech wavs) as ``mha_ep/_shipped_models``, where mha_ep/shipped.py looks first."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("*.onnx", "*.json", "*.wav")


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


setup(cmdclass={"build_py": BuildPyWithModels})
