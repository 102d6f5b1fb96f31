"""The web UI as a user meets it: `rayfactory webui` in a subprocess, driven by headless Chromium.

The browser is Debian's chromium with its chromedriver (scripts/install_system_packages.sh, which
the test command runs). Without them the browser tests skip with that reason, except under CI=true,
where they fail: the UI is never left untested by CI. Screenshots of each tab go to
test-artifacts/webui/ (or $RAYFACTORY_TEST_ARTIFACTS/webui).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from cluster.local_head import Head, free_port, stop_head
from tests.ci import skip_or_fail_in_ci

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = os.path.join(os.environ.get("RAYFACTORY_TEST_ARTIFACTS") or os.path.join(REPO_ROOT, "test-artifacts"),
                         "webui")
SERVER_START_TIMEOUT_S = 90


@contextlib.contextmanager
def cli_server(args: list[str], cwd, probe: str, timeout: float):
    """`rayfactory <args> --port P` in a subprocess in ``cwd``, without the caller's Ray settings;
    its URL once ``probe`` answers. Its output goes to cwd/<command>.log, quoted if it does not start."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = REPO_ROOT
    log_path = os.path.join(cwd, f"{args[0]}.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "cluster.cli", *args, "--port", str(port)],
                                   cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(url + probe, timeout=5)
                break
            except OSError:
                if process.poll() is not None or time.time() > deadline:
                    process.kill()
                    with open(log_path, encoding="utf-8") as f:
                        raise RuntimeError(f"rayfactory {args[0]} did not start:\n{f.read()[-3000:]}")
                time.sleep(0.5)
        try:
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def wait_for(condition, timeout: float, what: str = "the page", poll: float = 0.3):
    """``condition()``'s first truthy value, asked every ``poll`` seconds; AssertionError after ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="session")
def webui(tmp_path_factory):
    """(url, share_dir, cwd) of a running `rayfactory webui`; its Ray head is stopped at the end.
    The UI reads and writes only inside its folder, so the repo's data/ is copied there."""
    cwd = tmp_path_factory.mktemp("webui-cwd")
    shutil.copytree(os.path.join(REPO_ROOT, "data"), cwd / "data")
    share = cwd / "share"
    with cli_server(["webui", "--share-dir", str(share)], cwd, "/api/spec", SERVER_START_TIMEOUT_S) as url:
        yield url, str(share), str(cwd)
    head = Head.load(os.path.join(share, "ray-head.json"))
    if head is not None:
        stop_head(head)


@pytest.fixture(scope="session")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        reason = ("headless Chromium is not installed (Debian: apt-get install chromium chromium-driver; "
                  "scripts/install_system_packages.sh does it and the test command runs that)")
        skip_or_fail_in_ci(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1700"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    os.makedirs(ARTIFACTS, exist_ok=True)
    driver.artifacts = ARTIFACTS  # where the tests save their screenshots
    yield driver
    driver.quit()
