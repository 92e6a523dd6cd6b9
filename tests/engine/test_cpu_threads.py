"""The CPU thread default and its HYBRIDKV_CPU_THREADS override (hybridkv/cpu_threads.py)."""
import pytest
import torch

from hybridkv.cpu_threads import (ENV_VAR, configure_cpu_threads, default_cpu_threads,
                                  requested_cpu_threads)


def test_default_is_one_thread_on_small_machines_only():
    assert default_cpu_threads(cores=2) == 1
    assert default_cpu_threads(cores=4) == 1
    assert default_cpu_threads(cores=64) is None


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_bad_override_is_refused_naming_the_value(raw):
    with pytest.raises(ValueError, match=f"{ENV_VAR}='{raw}'.*>= 1"):
        requested_cpu_threads({ENV_VAR: raw})


def test_override_wins_on_cpu_and_other_devices_are_untouched(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv(ENV_VAR, "2")
        assert configure_cpu_threads("cuda:0") == before
        assert configure_cpu_threads("cpu") == 2
        monkeypatch.setenv(ENV_VAR, "")
        assert requested_cpu_threads() is None
        monkeypatch.setenv(ENV_VAR, "bad")
        with pytest.raises(ValueError):
            configure_cpu_threads("cpu")
        assert torch.get_num_threads() == 2  # a refused value changes nothing
    finally:
        torch.set_num_threads(before)
