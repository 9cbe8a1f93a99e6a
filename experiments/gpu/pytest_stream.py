"""pytest plugin (`-p pytest_stream`): one JSON line per collected set and per test outcome, appended
to the file named by $TEVJAX_PYTEST_STREAM the moment it is known, so that a run stopped by a
timeout still leaves every result it reached (a junit report is written only at the end)."""

from __future__ import annotations

import json
import os


def _write(record: dict) -> None:
    path = os.environ.get("TEVJAX_PYTEST_STREAM")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _message(report) -> str:
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " / ".join(lines[-3:])[-400:]


def pytest_collection_finish(session) -> None:
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_collectreport(report) -> None:
    if report.failed:
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "error", "message": _message(report)})


def pytest_runtest_logreport(report) -> None:
    # A test's outcome is its call's, unless setup did not pass (error or skip) or teardown failed.
    if report.when == "call":
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    elif report.when == "setup" and not report.passed:
        outcome = "skipped" if report.skipped else "error"
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    else:
        return
    _write({"nodeid": report.nodeid, "when": report.when, "outcome": outcome, "seconds": report.duration,
            "message": "" if outcome == "passed" else _message(report)})
