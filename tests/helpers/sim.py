"""The simulator's tiny config and the overrides that keep a test run short; shared by the sim tests."""

from pathlib import Path

TINY = Path(__file__).resolve().parents[2] / "configs" / "sim" / "tiny.yaml"
FAST = ["sim.steps=6", "sim.warmup_steps=1"]
