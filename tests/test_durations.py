"""tests/durations.py: the table that orders the suite's files, read from a junit report or a CPU profile."""
import json

from tests.durations import junit_timings, profile_timings, slowest


def test_junit_report_gives_each_files_slowest_test(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="tests.e2e.test_cli" name="a" time="1.24"/>'
                     '<testcase classname="tests.e2e.test_cli" name="b" time="3.06"/>'
                     '<testcase classname="tests.core.test_device.TestY" name="c" time="7.0"/>'
                     '</testsuite></testsuites>')
    assert slowest(junit_timings(junit)) == {"tests/core/test_device.py": 7.0, "tests/e2e/test_cli.py": 3.1}
    assert list(slowest(junit_timings(junit))) == ["tests/core/test_device.py", "tests/e2e/test_cli.py"]  # slowest first


def test_cpu_profile_folder_gives_the_same_table_over_every_worker(tmp_path):
    (tmp_path / "gw0.json").write_text(json.dumps([["tests/e2e/test_cli.py::a", 1.24, 1.0, 0.0],
                                                   ["tests/core/test_device.py::TestY::c", 7.0, 6.9, 0.0]]))
    (tmp_path / "gw1.json").write_text(json.dumps([["tests/e2e/test_cli.py::b[1]", 3.06, 0.1, 2.9]]))
    table = slowest(profile_timings(tmp_path))
    assert table == {"tests/core/test_device.py": 7.0, "tests/e2e/test_cli.py": 3.1}
    assert list(table) == ["tests/core/test_device.py", "tests/e2e/test_cli.py"]
