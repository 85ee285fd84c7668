"""setup.cfg holds the metadata; this file only ships the one-line .pth activation backstop,
which setuptools cannot place in site-packages from setup.cfg alone."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "vllm_bi100_patch.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=False)


setup(cmdclass={"build_py": BuildPyWithPth})
