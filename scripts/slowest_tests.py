"""Print a test run's time and its slowest tests from the JUnit reports scripts/run_tests.sh writes.

    python scripts/slowest_tests.py .ci/last-junit-no-ray.xml .ci/last-junit-ray.xml [--top 30]

Each report is one pytest invocation; its wall time is the report's own ``time``. A test's time is
its call plus setup and teardown, as JUnit records it (module fixtures count to the first test).
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    cases, total = [], 0.0
    for report in args.reports:
        root = ET.parse(report).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        wall = float(suite.get("time", 0))
        total += wall
        counts = {key: suite.get(key) for key in ("tests", "failures", "errors", "skipped")}
        print(f"{report}: {wall / 60:.1f} min, " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        for case in suite.iter("testcase"):
            cases.append((float(case.get("time", 0)), f"{case.get('classname')}::{case.get('name')}"))
    print(f"all reports: {total / 60:.1f} min of tests")
    print(f"the {args.top} slowest tests:")
    for seconds, name in sorted(cases, reverse=True)[: args.top]:
        print(f"  {seconds:7.1f} s  {name}")


if __name__ == "__main__":
    main()
