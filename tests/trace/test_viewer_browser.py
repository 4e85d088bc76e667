"""The trace viewer in a real browser: Debian's chromium + chromedriver, driven by Selenium.

Opens the page rendered from the `recorded_trace` fixture (tests/trace/conftest.py), goes to
the seed's worked example (query_start_loc [0, 2, 7, 10]) with the keyboard, and checks what
the page shows against the JSON. Screenshots go to test-artifacts/ at the repo root.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from keel.trace.viewer import render_html

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
SEED_QUERY_START_LOC = [0, 2, 7, 10]  # num_scheduled_tokens [2, 5, 3]
REMOVED_REASONS = {"finished": "gone from self.requests too",
                   "unscheduled": "kept in self.requests"}

# Elements wider than the viewport at phone width, outside any element that scrolls (or clips)
# them horizontally itself: the body must not scroll sideways.
OVERFLOW_JS = """
const limit = document.documentElement.clientWidth + 1;
const clipped = (node) => {
  for (let p = node.parentElement; p; p = p.parentElement) {
    if (p === document.body || p === document.documentElement) return false;
    if (["auto", "scroll", "hidden", "clip"].includes(getComputedStyle(p).overflowX)) return true;
  }
  return false;
};
return [...document.body.querySelectorAll("*")]
  .filter((n) => n.getBoundingClientRect().right > limit && !clipped(n))
  .map((n) => n.tagName + (n.dataset.testid ? "[" + n.dataset.testid + "]" : "")
              + "." + n.className + " right=" + n.getBoundingClientRect().right);
"""


@pytest.fixture
def driver() -> Iterator[WebDriver]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    if missing:
        pytest.fail(f"the trace viewer's browser test needs Debian's chromium and chromedriver; "
                    f"missing: {', '.join(missing)} (apt-get install chromium chromium-driver)",
                    pytrace=False)
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    # An explicit driver path: Selenium never runs selenium-manager (no download).
    drv = webdriver.Chrome(options=options,
                           service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        yield drv
    finally:
        drv.quit()


def read_steps(trace: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("type") == "step"]


def by_testid(root: WebDriver | WebElement, testid: str) -> list[WebElement]:
    return root.find_elements(By.CSS_SELECTOR, f'[data-testid="{testid}"]')


def classes(element: WebElement) -> set[str]:
    return set((element.get_attribute("class") or "").split())


class Page:
    def __init__(self, driver: WebDriver, num_steps: int) -> None:
        self.driver = driver
        self.num_steps = num_steps

    def indicator(self) -> str:
        return by_testid(self.driver, "step-indicator")[0].text

    def wait_step(self, index: int) -> None:
        want = f"Step {index + 1} of {self.num_steps}"
        WebDriverWait(self.driver, 5).until(
            lambda _: self.indicator() == want,
            message=f"step indicator should read {want!r}")

    def keys(self, key: str, times: int = 1) -> None:
        """Press key on whatever has focus (the body, unless a control was focused)."""
        if times > 0:
            ActionChains(self.driver).send_keys(key * times).perform()

    def control(self, testid: str) -> WebElement:
        return by_testid(self.driver, testid)[0]


def save_full_page(driver: WebDriver, path: Path) -> None:
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}})
    path.write_bytes(base64.b64decode(shot["data"]))


def check_tab_order(page: Page) -> None:
    """From a fresh page, Tab reaches prev, the slider and next, each with a focus outline."""
    for testid in ("prev", "slider", "next"):
        page.keys(Keys.TAB)
        focused = page.driver.switch_to.active_element
        assert focused.get_attribute("data-testid") == testid
        assert focused.value_of_css_property("outline-style") not in ("none", ""), testid


def navigate_with_keyboard(page: Page, target: int) -> None:
    page.driver.execute_script("document.activeElement && document.activeElement.blur()")
    page.keys(Keys.ARROW_RIGHT, target)
    page.wait_step(target)
    if target > 0:  # back once, then forward again
        page.keys(Keys.ARROW_LEFT)
        page.wait_step(target - 1)
        page.keys(Keys.ARROW_RIGHT)
    else:
        page.keys(Keys.ARROW_RIGHT)
        page.wait_step(1)
        page.keys(Keys.ARROW_LEFT)
    page.wait_step(target)
    last = page.num_steps - 1
    page.keys(Keys.END)
    page.wait_step(last)
    page.keys(Keys.HOME)
    page.wait_step(0)
    page.keys(Keys.ARROW_RIGHT, target)
    page.wait_step(target)


def use_slider_and_buttons(page: Page, target: int) -> None:
    """Mouse on the slider's far end, then arrows on the focused slider (one step per press:
    the page must not step a second time), then prev/next once each."""
    last = page.num_steps - 1
    slider = page.control("slider")
    ActionChains(page.driver).move_to_element_with_offset(
        slider, slider.size["width"] // 2 - 1, 0).click().perform()
    page.wait_step(last)
    assert page.driver.switch_to.active_element == slider
    page.keys(Keys.HOME)
    page.wait_step(0)
    page.keys(Keys.ARROW_RIGHT, target)
    page.wait_step(target)
    assert slider.get_attribute("value") == str(target)
    first, second = ("next", "prev") if target < last else ("prev", "next")
    page.control(first).click()
    page.wait_step(target + 1 if first == "next" else target - 1)
    page.control(second).click()
    page.wait_step(target)


def check_batch(driver: WebDriver, batch: dict[str, Any]) -> None:
    rows = by_testid(driver, "batch-row")
    assert len(rows) == len(batch["rows"]) == batch["num_reqs"]
    added = {a["row"] for a in batch["added"]}
    moved = {m["to"]: m["from"] for m in batch["moves"]}
    for tr, row in zip(rows, batch["rows"]):
        assert tr.get_attribute("data-row") == str(row["row"])
        assert tr.get_attribute("data-req-id") == row["req_id"]
        cells = [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        assert cells[:5] == [str(row["row"]), row["req_id"], str(row["num_computed_tokens"]),
                             str(row["num_tokens"]), str(row["num_scheduled_tokens"])]
        assert cells[5].startswith("[" + ", ".join(map(str, row["block_ids"])) + "]")
        assert ("truncated" in cells[5]) == row["blocks_truncated"]
        assert ("row-added" in classes(tr)) == (row["row"] in added), row
        assert ("row-moved" in classes(tr)) == (row["row"] in moved), row
        if row["row"] in moved:
            assert f"moved from row {moved[row['row']]}" in tr.text
    removed = by_testid(driver, "removed-row")
    assert len(removed) == len(batch["removed"])
    for tr, gone in zip(removed, batch["removed"]):
        assert "row-removed" in classes(tr)
        assert tr.get_attribute("data-req-id") == gone["req_id"]
        assert f"{gone['reason']}: {REMOVED_REASONS[gone['reason']]}" in tr.text


def check_layout(driver: WebDriver, step: dict[str, Any]) -> None:
    layout, batch, sampled = step["layout"], step["batch"], step["sampled_token_ids"]
    assert layout["query_start_loc"] == SEED_QUERY_START_LOC
    # The seed example has 10 tokens: nothing is capped, so every token has a cell.
    assert not layout["truncated"]
    cells = by_testid(driver, "token-cell")
    assert len(cells) == layout["num_tokens"]
    logits = set(layout["logits_indices"])
    for j, cell in enumerate(cells):
        assert cell.get_attribute("data-index") == str(j)
        assert f"pos {layout['positions'][j]}" in cell.text
        assert f"slot {layout['slot_mapping'][j]}" in cell.text
        assert f"input_ids {layout['input_ids'][j]}" in cell.get_attribute("title")
        assert ("logits" in classes(cell)) == (j in logits), f"token {j}"
        assert ("logits" in cell.text) == (j in logits), f"token {j}: visible marker"

    qsl = layout["query_start_loc"]
    groups = by_testid(driver, "req-group")
    assert len(groups) == len(qsl) - 1 == batch["num_reqs"]
    for i, group in enumerate(groups):
        row = batch["rows"][i]
        assert group.get_attribute("data-row") == str(i)
        assert row["req_id"] in group.text
        in_group = [c.get_attribute("data-index") for c in by_testid(group, "token-cell")]
        assert in_group == [str(j) for j in range(qsl[i], qsl[i + 1])]
        assert [int(c.get_attribute("data-index")) for c in by_testid(group, "token-cell")] == [
            j for j, r in enumerate(layout["req_indices"]) if r == i]
        discard = layout["discard_request_mask"][i]
        assert ("discard" in classes(group)) == discard, f"row {i}"
        marks = by_testid(group, "discard-mark")
        if discard:
            assert len(marks) == 1 and marks[0].is_displayed()
            assert "discarded (still prefilling): discard_request_mask" in marks[0].text
        else:
            assert not marks
            ids = sampled[i]
            shown = str(ids[0]) if len(ids) == 1 else "[" + ", ".join(map(str, ids)) + "]"
            assert by_testid(group, "sampled")[0].text == f"sampled → {shown}"

    ticks = [t.text for t in by_testid(driver, "qsl-tick")]
    assert ticks == [str(v) for v in qsl]
    for name in ("req_indices", "positions", "query_start_loc", "seq_lens", "slot_mapping",
                 "logits_indices"):
        shown = by_testid(driver, f"array-{name}")[0].text
        assert shown == "[" + ", ".join(map(str, layout[name])) + "]", name
    mask = by_testid(driver, "array-discard_request_mask")[0].text
    assert mask == "[" + ", ".join(json.dumps(v) for v in layout["discard_request_mask"]) + "]"
    strip = by_testid(driver, "strip-scroll")[0]
    assert strip.value_of_css_property("overflow-x") == "auto"


def check_phases(driver: WebDriver, step: dict[str, Any]) -> None:
    bar = by_testid(driver, "phase-bar")[0]
    segments = by_testid(bar, "phase-segment")
    assert [s.get_attribute("data-phase") for s in segments] == [
        p["name"] for p in step["phases"]]
    assert all(" ms" in s.get_attribute("title") for s in segments)


def test_viewer_shows_the_seed_example(recorded_trace: Path, driver: WebDriver,
                                       tmp_path: Path) -> None:
    steps = read_steps(recorded_trace)
    matches = [i for i, s in enumerate(steps)
               if s["layout"] and s["layout"]["query_start_loc"] == SEED_QUERY_START_LOC]
    assert matches, (f"{recorded_trace}: no step with query_start_loc "
                     f"{SEED_QUERY_START_LOC} (the seed's [2, 5, 3] example)")
    target, step = matches[0], steps[matches[0]]
    assert len(steps) > 1, "the navigation checks need at least two steps"

    html = render_html(recorded_trace, tmp_path / "trace.html")
    driver.get(html.as_uri())
    page = Page(driver, len(steps))
    page.wait_step(0)

    check_tab_order(page)
    navigate_with_keyboard(page, target)
    assert page.indicator() == f"Step {target + 1} of {len(steps)}"
    assert page.control("step-field").text == f'"step": {step["step"]}'
    check_batch(driver, step["batch"])
    check_layout(driver, step)
    check_phases(driver, step)

    use_slider_and_buttons(page, target)
    check_batch(driver, step["batch"])  # the same step again, drawn afresh

    ARTIFACTS.mkdir(exist_ok=True)
    save_full_page(driver, ARTIFACTS / "trace-viewer.png")

    driver.set_window_size(390, 844)
    assert driver.execute_script("return window.innerWidth") == 390
    save_full_page(driver, ARTIFACTS / "trace-viewer-phone.png")
    overflowing = driver.execute_script(OVERFLOW_JS)
    assert not overflowing, f"wider than a 390 px phone, outside a scroll box: {overflowing}"
    widths = driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth,"
        " document.body.scrollWidth]")
    assert widths[0] <= widths[1] and widths[2] <= widths[1], f"body scrolls sideways: {widths}"
    strip = by_testid(driver, "strip-scroll")[0]
    assert driver.execute_script("return arguments[0].getBoundingClientRect().right",
                                 strip) <= widths[1]


def test_viewer_shows_an_empty_step(recorded_trace: Path, driver: WebDriver,
                                    tmp_path: Path) -> None:
    """A step with nothing scheduled (batch, layout and sampled_token_ids null), appended to
    the recorded trace's first lines."""
    lines = [line for line in recorded_trace.read_text().splitlines() if line.strip()][:2]
    empty = {"type": "step", "step": 10**6, "batch": None, "layout": None,
             "sampled_token_ids": None,
             "scheduler_output": {"new": [], "cached": [], "resumed": [], "finished": [],
                                  "preempted": [], "num_scheduled_tokens": {},
                                  "total_num_scheduled_tokens": 0, "spec_decode_tokens": {}},
             "phases": [{"name": "schedule", "start_us": 0.0, "dur_us": 12.5}]}
    trace = tmp_path / "empty.jsonl"
    trace.write_text("\n".join([*lines, json.dumps(empty)]) + "\n")
    num_steps = len(read_steps(trace))
    driver.get(render_html(trace).as_uri())
    page = Page(driver, num_steps)
    page.wait_step(0)
    page.keys(Keys.END)
    page.wait_step(num_steps - 1)
    assert "no tokens scheduled this step" in by_testid(driver, "empty-step")[0].text
    assert not by_testid(driver, "batch-row") and not by_testid(driver, "token-cell")
    assert len(by_testid(driver, "phase-segment")) == 1
    # The address names the step shown, and opening it shows that step again.
    assert driver.current_url.endswith(f"#step={10**6}")
    first = read_steps(trace)[0]["step"]
    driver.get(render_html(trace).as_uri() + f"#step={first}")
    page.wait_step(0)
    driver.get(render_html(trace).as_uri() + f"#step={10**6}")
    page.wait_step(num_steps - 1)
