import dataclasses

import pytest

from labkit.config import TrainConfig, from_env


def test_defaults_are_literal(monkeypatch):
    monkeypatch.delenv("LABKIT_FAST", raising=False)
    cfg = TrainConfig.from_env()
    assert cfg == TrainConfig()


def test_fast_overlay_env_and_overrides(monkeypatch):
    monkeypatch.setenv("LABKIT_FAST", "1")
    monkeypatch.setenv("LABKIT_CLIP_NORM", "0.05")
    monkeypatch.setenv("LABKIT_BF16", "true")
    cfg = TrainConfig.from_env(log_every=2)
    assert cfg.max_steps == TrainConfig.FAST["max_steps"] and cfg.epochs == TrainConfig.FAST["epochs"]
    assert cfg.clip_norm == 0.05 and cfg.bf16 is True and cfg.log_every == 2
    assert cfg.to_dict()["clip_norm"] == 0.05


def test_bad_env_value_names_variable(monkeypatch):
    monkeypatch.setenv("LABKIT_MAX_STEPS", "big")
    with pytest.raises(ValueError, match="LABKIT_MAX_STEPS='big'"):
        TrainConfig.from_env()


def test_unknown_override():
    with pytest.raises(TypeError, match="no field"):
        TrainConfig.from_env(batchsize=3)


def test_any_dataclass(monkeypatch):
    @dataclasses.dataclass
    class P:
        steps: int = 100
        name: str = "x"
        FAST = {"steps": 3}

    monkeypatch.setenv("LABKIT_FAST", "1")
    monkeypatch.setenv("LABKIT_NAME", "y")
    assert from_env(P) == P(steps=3, name="y")
