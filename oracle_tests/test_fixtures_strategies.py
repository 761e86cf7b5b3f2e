"""The suite's hypothesis settings (``fixtures.strategies.settings``): the soak and the
reproducible-CI switches taken from the environment, and their bad values rejected by name."""
import pytest

from fixtures.strategies import settings


def test_defaults_explore_with_a_per_worker_database(monkeypatch):
    monkeypatch.delenv("DSV4_HYPOTHESIS_SCALE", raising=False)
    monkeypatch.delenv("DSV4_HYPOTHESIS_DERANDOMIZE", raising=False)
    s = settings(15)
    assert s.max_examples == 15 and s.derandomize is False and s.database is not None
    assert s.deadline is None


def test_scale_multiplies_and_derandomize_drops_the_database(monkeypatch):
    monkeypatch.setenv("DSV4_HYPOTHESIS_SCALE", "20")
    monkeypatch.setenv("DSV4_HYPOTHESIS_DERANDOMIZE", "1")
    s = settings(15)
    assert s.max_examples == 300 and s.derandomize is True and s.database is None


@pytest.mark.parametrize("name,value", [("DSV4_HYPOTHESIS_SCALE", "many"),
                                        ("DSV4_HYPOTHESIS_SCALE", "-2"),
                                        ("DSV4_HYPOTHESIS_DERANDOMIZE", "yes")])
def test_bad_environment_values_are_named(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        settings(15)
