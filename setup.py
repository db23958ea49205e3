from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def read_requirements(name: str) -> list[str]:
    """Requirement lines of a requirements file, without comments and blank lines."""
    lines = (HERE / name).read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


setup(
    name="asyncflow",
    version="0.1.0",
    description="Asynchronous streaming reinforcement learning for LLM post-training",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["asyncflow", "asyncflow.*"]),
    python_requires=">=3.11",
    install_requires=read_requirements("requirements.txt"),
    extras_require={
        "gpu": ["vllm"],
        "npu": ["torch_npu", "mindspeed", "vllm-ascend"],
        "dev": ["pytest", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["asyncflow=asyncflow.cli:main"]},
)
