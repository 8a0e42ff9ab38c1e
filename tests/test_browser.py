"""The report's index.html in a real browser: Selenium drives Debian's headless Chromium through
Debian's chromedriver (both from `make test`; Selenium Manager is never asked for a driver). It
opens the report from disk, clicks a head and checks that the pattern view shows that head's
attention, sorts and filters the head table, checks that every image and script loaded and that
no request left the page, and saves screenshots. Deliberately broken pages prove that each check
can fail.

Set REPORT_SCREENSHOT=path to keep the screenshot (the README's docs/report_screenshot.png)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from analyses.components.rollout import all_patterns
from analyses.cli import main
from analyses.report.build import DISPLAY_TEXT, DISPLAY_TOKENS
from analyses.core.tokens import leading_tokens
from interp import load_model

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# `make test` installs chromium and chromium-driver wherever apt-get can run as root, and .ci/run sets
# CI=1, so under CI their absence is a failure; elsewhere (no apt, not root) the test is skipped.
pytestmark = pytest.mark.skipif(
    (CHROMIUM is None or CHROMEDRIVER is None) and not os.environ.get("CI"),
    reason="chromium/chromedriver are missing and `make test` could not install them (needs apt-get as root)",
)
LOCAL_SCHEMES = ("file:", "data:", "blob:")
WAIT_S = 20


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1000", "--hide-scrollbars"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # an explicit driver: nothing fetched
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    # the command docs/guides/report.md says this test runs
    assert main(["report", "--model", "toy", "--prompts", "8", "--intervention-prompts", "4", "--seed", "0",
                 "--out", str(out)]) == 0
    return out


def open_page(driver, page: Path) -> None:
    """Load ``page`` after emptying the logs, and wait for the load event."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get("about:blank")
    driver.get_log("performance"), driver.get_log("browser")
    driver.get(page.as_uri())
    WebDriverWait(driver, WAIT_S).until(lambda d: d.execute_script("return document.readyState") == "complete")


def requests_made(driver) -> list[str]:
    """Every URL the page asked for since it was opened (Chrome's network log and the Resource
    Timing API), except the page's own file: and inline data: URLs."""
    sent = [json.loads(entry["message"])["message"] for entry in driver.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in sent if m["method"] == "Network.requestWillBeSent"]
    urls += driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    return sorted({url for url in urls if not url.startswith(LOCAL_SCHEMES)})


def load_problems(driver) -> list[str]:
    """What did not load: images that did not decode, scripts whose src failed, and every error
    the console logged (a script that threw, a blocked request, a missing file)."""
    problems = driver.execute_script(
        "return [...document.images].filter(i => !(i.complete && i.naturalWidth > 0))"
        ".map(i => 'image ' + i.src.slice(0, 60))")
    problems += [f"console: {e['message'][:200]}" for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    return problems


def strip_shading(driver, view: int) -> list[float]:
    """The alpha of every token's shading in a view's token strip."""
    styles = driver.execute_script(
        f"return [...document.querySelectorAll('#view-{view} .token-strip span')].map(s => s.style.background)")
    return [float(re.search(r"rgba\([^)]*,\s*([\d.]+)\)", s).group(1)) if "rgba" in s else 1.0 for s in styles]


def click_head(driver, layer: int, head: int) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element(By.CSS_SELECTOR, f'#head-grid button[data-layer="{layer}"][data-head="{head}"]').click()
    WebDriverWait(driver, 2).until(
        lambda d: d.find_element(By.ID, "pattern-panel").get_attribute("data-head") == f"L{layer}H{head}")


def hover_token(driver, view: int, index: int) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    span = driver.find_elements(By.CSS_SELECTOR, f"#view-{view} .token-strip span")[index]
    ActionChains(driver).move_to_element(span).perform()


def sorted_column(driver, header: str) -> list[str]:
    """Click the head table's ``header`` and read back the (layer, head) order of its rows."""
    from selenium.webdriver.common.by import By

    [th] = [th for th in driver.find_elements(By.CSS_SELECTOR, "#head-table thead th") if th.text == header]
    th.click()
    return driver.execute_script(
        "return [...document.querySelectorAll('#head-table tbody tr')].filter(r => !r.hidden)"
        ".map(r => r.dataset.headName)")


def test_clicking_a_head_shows_its_pattern_and_the_table_sorts(browser, report_dir, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    page = report_dir / "index.html"
    open_page(browser, page)
    WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script("return document.body.dataset.ready") == "true")
    assert browser.execute_script("return typeof CircuitsVis.render") == "function"
    table = pd.read_csv(report_dir / "head_roles.csv", keep_default_na=False)
    previous = table.loc[table["previous_token"].idxmax()]
    layer, head = int(previous["layer"]), int(previous["head"])
    assert browser.find_element(By.ID, "pattern-panel").get_attribute("data-head") != f"L{layer}H{head}"

    click_head(browser, layer, head)
    assert browser.find_element(By.ID, "pattern-title").text.startswith(f"L{layer}H{head}")
    for view in (0, 1):  # CircuitsVis drew a heatmap of that head in both views
        host = browser.find_element(By.ID, f"view-{view}")
        assert host.get_attribute("data-head") == f"L{layer}H{head}"
        WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script(
            f"const c = document.querySelector('#view-{view} canvas'); return c && c.width > 100"))
    # the token strip shows the model's own attention of that head: on the text, hovering token q
    # shades its keys as the model (run here, independently of the page) attends
    model = load_model("toy")
    tokens = leading_tokens(model, DISPLAY_TEXT, DISPLAY_TOKENS)
    expected = all_patterns(model, tokens)[layer, head]
    for query in (5, len(tokens) - 1):
        hover_token(browser, 1, query)
        shading = torch.tensor(strip_shading(browser, 1)[: query + 1])
        assert (shading - expected[query, : query + 1]).abs().max() < 0.01
    assert int(expected[len(tokens) - 1].argmax()) == len(tokens) - 2  # it is a previous-token head
    browser.save_screenshot(str(tmp_path / "clicked.png"))

    # sort: descending on the first click, ascending on the second, by the score's value
    by_induction = table.sort_values("induction", ascending=False, kind="stable")
    names = [f"L{int(r.layer)}H{int(r.head)}" for r in by_induction.itertuples()]
    assert sorted_column(browser, "induction") == names
    assert sorted_column(browser, "induction")[0] == names[-1]
    # filter by role: only the induction heads remain
    Select(browser.find_element(By.CSS_SELECTOR, "select[data-filter-table='head-table']")).select_by_value("induction")
    shown = sorted_column(browser, "layer")
    induction = table[table["role"].str.split(";").apply(lambda roles: "induction" in roles)]
    assert sorted(shown) == sorted(f"L{int(r.layer)}H{int(r.head)}" for r in induction.itertuples()) and shown
    # a row click shows that head too
    browser.find_element(By.CSS_SELECTOR, f'#head-table tr[data-head-name="{shown[0]}"] td').click()
    assert browser.find_element(By.ID, "pattern-panel").get_attribute("data-head") == shown[0]

    assert load_problems(browser) == []
    assert requests_made(browser) == []
    figures = len(list((report_dir / "figures").glob("*.png")))
    assert browser.execute_script("return document.images.length") == figures >= 9  # every figure, inline


def test_the_page_loads_everything_offline_and_is_screenshot(browser, report_dir, tmp_path):
    open_page(browser, report_dir / "index.html")
    browser.set_window_size(1400, 1700)
    shot = tmp_path / "report.png"
    browser.save_screenshot(str(shot))
    assert load_problems(browser) == [] and requests_made(browser) == []
    assert shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and shot.stat().st_size > 10_000
    if os.environ.get("REPORT_SCREENSHOT"):
        target = Path(os.environ["REPORT_SCREENSHOT"])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)
    browser.set_window_size(1400, 1000)


BROKEN = {
    "image": ('<img src="data:image/png;base64,AAAA">', "image"),
    "script": ('<script src="missing.js"></script>', "console"),
    "request": ('<img src="http://127.0.0.1:9/pixel.png">', "request"),
    "fetch": ('<script>fetch("http://127.0.0.1:9/data.json").catch(() => 0)</script>', "request"),
    "throws": ("<script>undefinedFunction()</script>", "console"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_each_check_catches_a_broken_page(browser, tmp_path, kind):
    snippet, caught_by = BROKEN[kind]
    page = tmp_path / f"{kind}.html"
    page.write_text(f"<!DOCTYPE html><html><body><p>broken</p>{snippet}</body></html>")
    open_page(browser, page)
    browser.execute_script("return 0")  # let a pending request reach the log
    problems, requests = load_problems(browser), requests_made(browser)
    assert (requests if caught_by == "request" else [p for p in problems if p.startswith(caught_by)]), (problems, requests)


def test_a_click_that_does_nothing_is_caught(browser, report_dir, tmp_path):
    """The same page with its script's click handler cut out: the click changes nothing, and
    ``click_head`` times out."""
    from selenium.common.exceptions import TimeoutException

    page = tmp_path / "dead.html"
    source = (report_dir / "index.html").read_text()
    assert source.count('grid.addEventListener("click"') == 1
    page.write_text(source.replace('grid.addEventListener("click"', 'grid.addEventListener("no-click"', 1))
    open_page(browser, page)
    shown = browser.execute_script("return document.getElementById('pattern-panel').dataset.head")
    layer, head = (0, 0) if shown != "L0H0" else (0, 1)
    with pytest.raises(TimeoutException):
        click_head(browser, layer, head)
