from setuptools import setup

setup(
    name="gtpo-kernels",
    version="0.1.0",
    description="Fused Triton kernels for the GTPO policy-gradient loss (GRPO family) for LLM RL",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=["gtpo_kernels", "gtpo_kernels.integrations", "gtpo_reference"],
    package_dir={"gtpo_kernels": "gtpo_kernels", "gtpo_reference": "reference"},
    python_requires=">=3.10",  # torch 2.13 and triton 3.8; the test and trl extras need 3.11
    # torch is not pinned here: install the build that fits your machine first (see README)
    # triton: tested with 3.6 (CUDA) and 3.8 (CPU interpreter, with numpy 2.4)
    install_requires=["torch>=2.4", "triton>=3.6,<3.9; platform_system=='Linux'"],
    extras_require={
        "test": ["pytest", "hypothesis", "numpy"],
        "bench": ["matplotlib>=3.8", "numpy"],
        "trl": ["trl>=1.14,<1.17", "transformers>=5.24,<6"],
        "demo": ["matplotlib>=3.8"],
    },
    license="Apache-2.0",
)
