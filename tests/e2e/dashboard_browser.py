"""Drives mpquic's dashboard in Debian's headless chromium (WebDriver through chromedriver and
selenium). Run inside the namespace where the dashboard listens (`ip netns exec NS python3 ...`);
test_dashboard.py talks to it over stdin/stdout, one line per step:

    -> "UP wan1 wan2 <seconds>"        every path shows "up"; a screenshot is saved
    <- "GO"                             (after the test black-holed a path)
    -> "DOWN wan1 <seconds since GO>"   the path shows "down" (or "disconnected")
    -> "EVENTS <json list>"             the page's event list; a second screenshot is saved
    -> "ERROR <text>"                   something did not show in time

    python3 dashboard_browser.py URL PATH_THAT_GOES_DOWN SCREENSHOT_PREFIX PROFILE_DIR
"""

import json
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service


def say(line):
    print(line, flush=True)


def states(driver):
    """{path: state} of the rows on the page (data-path / data-state)."""
    # One script, not an element at a time: the page redraws its rows with every report, and
    # an element found before a redraw is stale after it.
    rows = driver.execute_script(
        "return [...document.querySelectorAll('tr[data-path]')].map(r => [r.dataset.path, r.dataset.state])")
    return dict(rows)


def wait_for(driver, cond, timeout):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        s = states(driver)
        if cond(s):
            return s
        time.sleep(0.05)
    return None


def main():
    url, down_path, shots, profile = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    # Root in CI: no sandbox; no GPU in a namespace; a profile of its own per run, in a
    # directory the test removes (it kills this process and the browser when it is done).
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1500,620", f"--user-data-dir={profile}"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        t0 = time.monotonic()
        driver.get(url)
        s = wait_for(driver, lambda s: len(s) >= 2 and all(v == "up" for v in s.values()), 20)
        if s is None:
            say(f"ERROR paths not all up on the page: {states(driver)}; page: {driver.page_source[:2000]!r}")
            return
        time.sleep(3)  # a few seconds of graph for the screenshot
        driver.save_screenshot(f"{shots}-up.png")
        say("UP " + " ".join(sorted(s)) + f" {time.monotonic() - t0:.2f}")
        if sys.stdin.readline().strip() != "GO":
            return
        t0 = time.monotonic()
        s = wait_for(driver, lambda s: s.get(down_path) in ("down", "disconnected"), 10)
        if s is None:
            say(f"ERROR {down_path} not shown down: {states(driver)}")
            return
        say(f"DOWN {down_path} {time.monotonic() - t0:.2f}")
        time.sleep(2)
        driver.save_screenshot(f"{shots}-down.png")
        events = driver.execute_script("return [...document.querySelectorAll('#events li')].map(e => e.textContent)")
        conn = driver.execute_script("return document.getElementById('conn').textContent")
        say("EVENTS " + json.dumps({"events": events, "conn": conn}))
    finally:
        driver.quit()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        import traceback
        say("ERROR " + traceback.format_exc().replace("\n", " | "))
        sys.exit(1)
