"""Hypothesis profiles and the one tiny training run that the behaviour tests share."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")       # the suite never touches the network

from hypothesis import HealthCheck, settings  # noqa: E402

# `ci`: derandomized, so a CI failure reproduces exactly; `thorough`: many more examples.
settings.register_profile("ci", derandomize=True, max_examples=100, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "extra: needs an optional extra (trl, the pretrained model); "
                                       "make test deselects it")
