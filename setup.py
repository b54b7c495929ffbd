"""Packaging for dora_megatron (setuptools; console script ``dora``).

The CPU install path (tools/setup_env.sh) installs ``torch==2.13.0`` first so
pip never resolves the multi-GB CUDA build; here torch is only lower-bounded so
GPU clusters keep their own CUDA torch.
"""

from setuptools import find_packages, setup

setup(
    name="dora_megatron",
    version="0.1.0",
    description="Asynchronous RL for LLMs with multi-version streaming rollout (DORA) on Megatron-Core and SGLang",
    python_requires=">=3.11",
    packages=find_packages(include=["dora_megatron", "dora_megatron.*"]),
    # the vLLM key guard runs in vLLM's venv from its own directory (not a package)
    package_data={"dora_megatron.rollout.vllm": ["guard_path/*.py"]},
    install_requires=[
        "torch>=2.4",
        "megatron-core==0.16.1",
        "pyyaml>=6",
        "tensorboard>=2.14",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "numpy>=1.24",
        "aiohttp>=3.9",
        "orjson>=3.9",  # /generate answers decoded off the event loop (dora_megatron/comm/generate_codec.py)
        "msgspec>=0.18",  # request bodies checked against their typed fields (dora_megatron/comm/protocol.py)
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "psutil>=5.9",  # megatron dist_checkpointing save
        "transformers>=4.51",  # config.json is read by its config classes (dora_megatron/models/hf_config.py)
        # prompt datasets (Parquet, JSON lines, save_to_disk directories; dora_megatron/data/dataset.py)
        "datasets>=3.0",
        "pyarrow>=15",
        "math-verify>=0.7",  # the built-in `math` reward (symbolic equivalence of final answers)
        "scipy>=1.10",  # dora bench: Student t quantiles of the ratios' confidence intervals
    ],
    extras_require={
        # msgspec (also an install requirement): SGLang 0.5.23's request types (tests/sglang_wheel.py)
        # validate the client's bodies;
        # import-linter: the layering contracts of .importlinter (tests/unit/test_layering.py; 2.17 has
        # the acyclic_siblings contract); pytest-timeout: a hung test fails alone (pytest.ini) instead
        # of holding the whole run; pytest-xdist: CI runs the suite on two workers (`-n 2 --dist
        # loadfile`: a module's fixtures stay on one worker), the integration tests wait on their
        # servers about half of the time; mypy (pinned: a new release may flag what this one passes):
        # the type check of mypy.ini (tests/unit/test_types.py), with types-tqdm: tqdm ships no
        # type hints (controller/outputs.py's progress bar); accelerate: transformers needs it to
        # read a block-FP8 checkpoint, the oracle of tests/unit/weights/test_fp8_checkpoint.py
        "test": ["pytest>=8", "hypothesis>=6.100", "msgspec>=0.18", "import-linter>=2.17", "pytest-timeout>=2.3",
                 "pytest-xdist>=3.5", "wandb>=0.17", "mypy==2.4.1", "types-tqdm>=4.60", "accelerate>=1.0"],  # wandb: the offline W&B log of tests/integration/test_own_model_job.py
        # CUDA clusters only; documented in the README, never needed on CPU. SGLang is pinned to
        # the release whose protocol dora speaks (comm/sglang_client.py TESTED_SGLANG_VERSION);
        # another one gets a warning at launch.
        "gpu": ["transformer-engine[pytorch]", "sglang[all]==0.5.23"],
        "math": ["math-verify"],  # in install_requires now; kept so older install commands still work
        "wandb": ["wandb>=0.17"],  # observability.wandb
    },
    entry_points={"console_scripts": ["dora=dora_megatron.cli.main:entrypoint"]},
)
