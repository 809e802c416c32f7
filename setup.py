"""Ferry's one import namespace, `ferry`: each source folder installs under it, so no top-level
name of Ferry's can clash with another distribution's (Hugging Face's `kernels`, which
transformers requires, is the one that did). Everything else is in pyproject.toml.

    worker/           -> ferry.worker        (the engine, the worker process, the wire)
    api/              -> ferry.api           (the HTTP API)
    kernels/          -> ferry.kernels       (kernel dispatch, Triton and native CPU kernels)
    infra/autoscaler/ -> ferry.autoscaler    (`ferry autoscale`; the rest of infra/ is not Python)

bench/, tests/ and the rest of infra/ stay out of the wheel.
"""

from setuptools import find_namespace_packages, setup

SOURCES = {
    "ferry.worker": "worker",
    "ferry.api": "api",
    "ferry.kernels": "kernels",
    "ferry.autoscaler": "infra/autoscaler",
}


def packages() -> list[str]:
    found = []
    for name, folder in SOURCES.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_namespace_packages(folder, exclude=["*__pycache__*"])]
    return found


setup(packages=packages(), package_dir=SOURCES)
