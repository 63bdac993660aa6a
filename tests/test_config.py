import dataclasses
import re

import pytest

from labkit.config import TrainConfig, from_env


def test_defaults_are_literal(monkeypatch):
    monkeypatch.delenv("LABKIT_FAST", raising=False)
    cfg = TrainConfig.from_env()
    assert cfg == TrainConfig()


def test_fast_overlay_env_and_overrides(monkeypatch):
    monkeypatch.setenv("LABKIT_FAST", "1")
    monkeypatch.setenv("LABKIT_CLIP_NORM", "0.05")
    monkeypatch.setenv("LABKIT_RESUME", "true")
    cfg = TrainConfig.from_env(log_every=2)
    assert cfg.max_steps == TrainConfig.FAST["max_steps"] and cfg.epochs == TrainConfig.FAST["epochs"]
    assert cfg.clip_norm == 0.05 and cfg.resume is True and cfg.log_every == 2
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


def test_typo_gets_did_you_mean_and_other_names_pass(monkeypatch):
    monkeypatch.setenv("LABKIT_EPOCSH", "3")
    with pytest.raises(ValueError, match="LABKIT_EPOCSH .* did you mean LABKIT_EPOCHS"):
        TrainConfig.from_env()
    monkeypatch.delenv("LABKIT_EPOCSH")
    # known non-config names and a notebook's own knobs (not like any TrainConfig field) pass
    for name, value in {
        "LABKIT_BACKEND": "cpu",
        "LABKIT_CONSOLE": "1",
        "LABKIT_PIP_SPEC": "x",
        "LABKIT_HOST_ROOT": "/tmp",
        "LABKIT_LR": "0.1",
        "LABKIT_BATCH_SIZE": "8",
    }.items():
        monkeypatch.setenv(name, value)
    assert TrainConfig.from_env() == TrainConfig.from_env()


def test_invalid_booleans_are_errors(monkeypatch):
    from labkit.config import fast_mode, parse_bool

    monkeypatch.setenv("LABKIT_FAST", "maybe")
    with pytest.raises(ValueError, match="LABKIT_FAST='maybe'"):
        fast_mode()
    monkeypatch.setenv("LABKIT_FAST", "0")
    monkeypatch.setenv("LABKIT_RESUME", "yep")
    with pytest.raises(ValueError, match="LABKIT_RESUME='yep'"):
        TrainConfig.from_env()
    assert parse_bool(" On ", "x") is True and parse_bool("NO", "x") is False and parse_bool("", "x") is False


@pytest.mark.parametrize(
    "kwargs",
    [
        {"epochs": -1},
        {"max_steps": -5},
        {"clip_norm": float("nan")},
        {"log_seconds": float("inf")},
        {"checkpoint_every": 1.5},
        {"resume": "yes"},
    ],
)
def test_out_of_range_values_are_refused(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"TrainConfig.{name}="):
        TrainConfig(**kwargs)


def test_nan_from_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("LABKIT_CLIP_NORM", "nan")
    with pytest.raises(ValueError, match="LABKIT_CLIP_NORM='nan' is not a valid finite float"):
        TrainConfig.from_env()


def test_bf16_is_gone_and_says_what_replaces_it(monkeypatch):
    with pytest.raises(
        TypeError, match=r"TrainConfig\(bf16=True\).*precision=labkit\.precision\.choose\(rt, \"bf16\"\)"
    ):
        TrainConfig(bf16=True)
    monkeypatch.setenv("LABKIT_BF16", "1")
    with pytest.raises(ValueError, match=r"LABKIT_BF16 is no longer read.*labkit\.precision\.choose"):
        TrainConfig.from_env()
    assert "bf16" not in TrainConfig().to_dict()


@pytest.mark.parametrize(
    "env, culprit",
    [
        ({"LABKIT_BATCH_SIZE": "0"}, "Params.batch_size=0"),
        ({"LABKIT_EPOCHS": "-1"}, "Params.epochs=-1"),
        ({"LABKIT_LR": "-0.1"}, "Params.lr=-0.1"),
        ({"LABKIT_LR": "0"}, "Params.lr=0.0"),
    ],
)
def test_notebook_params_out_of_range_name_the_setting(monkeypatch, env, culprit):
    """A notebook's Params (batch, epochs, lr) read by from_env: before, batch 0, epochs -1 and lr -0.1
    went through to the training run."""

    @dataclasses.dataclass
    class Params:
        batch_size: int = 32
        epochs: int = 2
        lr: float = 0.1
        seed: int = 0

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=re.escape(culprit)):
        from_env(Params)
    for k in env:
        monkeypatch.delenv(k)
    assert from_env(Params) == Params()
