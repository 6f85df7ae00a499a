"""Build hook: generates the protobuf/gRPC stubs (gen_protos.py) from the
repository's proto/ folder before setuptools lists or copies the package
(egg_info / dist_info, build_py, sdist). Metadata lives in pyproject.toml."""
import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_protos  # noqa: E402

_generated = []


def generate_once():
    if not _generated:
        _generated.append(gen_protos.generate(HERE))


def with_protos(base):
    class Command(base):
        def run(self):
            generate_once()
            super().run()

    Command.__name__ = base.__name__
    return Command


# ctxcache.v1 is listed even before it is generated (the commands above make it).
PACKAGES = sorted(set(find_packages(HERE, include=["ctxcache", "ctxcache.*"])) | {"ctxcache.v1"})

setup(packages=PACKAGES,
      cmdclass={"egg_info": with_protos(egg_info), "build_py": with_protos(build_py),
                "sdist": with_protos(sdist)})
