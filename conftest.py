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


def pytest_sessionfinish(session, exitstatus):
    """Under GSPO_REQUIRE_EXTRAS=1 (make test-trl, make test-pretrained, hence make check and CI) a
    skipped test fails the run: an extra whose package is missing must not pass as "skipped"."""
    if os.environ.get("GSPO_REQUIRE_EXTRAS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        reporter.write_line(f"GSPO_REQUIRE_EXTRAS=1: {len(skipped)} skipped test(s) count as failures "
                            f"(first: {skipped[0].longrepr})", red=True)
        session.exitstatus = 1
