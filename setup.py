"""Only a build step the declarative configuration cannot express: models.toml and the default
workloads live at the top level of the repository, where people look for them, and a wheel
must carry them inside the package (edgespec/_data/), where registry.py finds them."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ["models.toml", "workloads/prompts.jsonl", "workloads/structured.jsonl", "workloads/agent-session.jsonl",
           "workloads/agent-session-claude.jsonl"]


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the files from the checkout itself
        for rel in SHIPPED:
            dst = Path(self.build_lib) / "edgespec" / "_data" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(__file__).parent / rel, dst)


setup(cmdclass={"build_py": BuildPyWithData})
