"""The suite's tiers (``tests/tiers.py``): which tests the README's command leaves to the slow tier."""

from __future__ import annotations

import re
from pathlib import Path

from tests import tiers

ROOT = Path(__file__).resolve().parent.parent


def test_a_test_is_slow_by_its_measured_time_or_by_the_slow_module_fixture_it_uses():
    long_one = max(tiers.SECONDS, key=tiers.SECONDS.get)
    short_one = min(tiers.SECONDS, key=tiers.SECONDS.get)
    assert tiers.is_slow(long_one, ["tmp_path"]) and not tiers.is_slow(short_one, ["tmp_path"])
    assert not tiers.is_slow("tests/test_bench.py::test_not_timed", ["tmp_path"])
    assert tiers.is_slow("tests/test_bench.py::test_not_timed", ["run"])  # it shares the fixture's whole bench run
    assert not tiers.is_slow("tests/test_zoo.py::test_not_timed", ["run"])  # another module's "run" is not it
    assert tiers.fixture_group("tests/test_bench.py::test_not_timed", ["run"]) == "tests/test_bench.py"


def test_each_slow_fixture_is_a_module_fixture_of_its_file():
    for file, name in tiers.SLOW_FIXTURES.items():
        source = (ROOT / file).read_text()
        assert re.search(rf'@pytest.fixture\(scope="module"\)\ndef {name}\(', source), (file, name)
