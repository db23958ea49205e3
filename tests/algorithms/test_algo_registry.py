"""Registry: lookup by name, clear errors, and the module-level registries' contents."""
from __future__ import annotations

import pytest

import asyncflow.algorithms as alg
from asyncflow.algorithms import Registry


def test_register_get_names() -> None:
    reg: Registry = Registry("widget")

    @reg.register("b")
    def fb() -> int:
        return 2

    @reg.register("a")
    def fa() -> int:
        return 1

    assert reg.get("a") is fa and reg.get("b")() == 2
    assert reg.names() == ["a", "b"]
    assert "a" in reg and "zzz" not in reg and len(reg) == 2 and list(reg) == ["a", "b"]


def test_unknown_name_lists_registered_names() -> None:
    reg: Registry = Registry("widget")
    reg.register("alpha")(lambda: 0)
    reg.register("beta")(lambda: 0)
    with pytest.raises(ValueError, match=r"unknown widget 'gamma'; registered: alpha, beta"):
        reg.get("gamma")
    with pytest.raises(ValueError, match=r"registered: \(none\)"):
        Registry("empty").get("x")


def test_unhashable_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown"):
        Registry("w").get(["list"])  # type: ignore[arg-type]


def test_duplicate_name_with_other_function_raises() -> None:
    reg: Registry = Registry("widget")

    def f() -> None: ...

    def g() -> None: ...

    reg.register("x")(f)
    reg.register("x")(f)  # the same function again is fine (e.g. a module reload)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("x")(g)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_names_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        Registry("widget").register(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Registry(bad)  # type: ignore[arg-type]


def test_module_registries_hold_the_documented_names() -> None:
    assert alg.ADVANTAGES.names() == ["dr_grpo", "gae", "grpo", "reinforce_pp", "rloo"]
    assert alg.POLICY_LOSSES.names() == ["cispo", "clip_higher", "decoupled_ppo", "dual_clip", "gspo", "ppo_clip",
                                        "tis", "vanilla"]
    assert alg.VALUE_LOSSES.names() == ["clipped", "mse"]
    assert alg.KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    assert alg.AGGREGATIONS.names() == ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"]
    assert alg.POLICY_LOSSES.get("clip_higher") is alg.POLICY_LOSSES.get("ppo_clip")
    assert alg.POLICY_LOSSES.get("vanilla") is alg.POLICY_LOSSES.get("dual_clip")  # verl's default


def test_alias() -> None:
    reg: Registry = Registry("widget")

    def f() -> int:
        return 1

    def g() -> int:
        return 2

    reg.register("f")(f)
    reg.register("g")(g)
    reg.alias("other_f", "f")
    reg.alias("other_f", "f")  # again: the same function, fine
    assert reg.get("other_f") is f and reg.names() == ["f", "g", "other_f"]
    with pytest.raises(ValueError, match="'g' is already registered"):
        reg.alias("g", "f")
    with pytest.raises(ValueError, match="unknown widget 'h'"):
        reg.alias("x", "h")
    with pytest.raises(ValueError, match="non-empty string"):
        reg.alias("", "f")


@pytest.mark.parametrize("reg", [alg.ADVANTAGES, alg.POLICY_LOSSES, alg.VALUE_LOSSES,
                                 alg.KL_ESTIMATORS, alg.AGGREGATIONS])
def test_module_registries_reject_unknown_names(reg: Registry) -> None:
    with pytest.raises(ValueError) as exc:
        reg.get("no_such_thing")
    for name in reg.names():
        assert name in str(exc.value)
