"""The Captions page in a real headless browser (Debian's chromium through the system chromedriver): a caption
typed and saved lands in the caption file, and the button captions the images without one (a ``dreamstep
caption`` process with the tiny WD14 tagger) while the page follows it."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from dashboard_testkit import serve
from PIL import Image

from dreamstep.captioning.tiny import write_tiny_wd14
from dreamstep.dashboard.app import create_app
from dreamstep.dashboard.caption_routes import CaptionEditing
from dreamstep.dashboard.dataset_check import check_dataset

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--window-size=1280,1000"]
TIMEOUT_S = 240
TOKEN = "caption-token"

if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
    pytest.skip("no browser: Debian's chromium and chromium-driver are not installed "
                "(apt-get install -y chromium chromium-driver); the HTTP tests still run", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(TIMEOUT_S)
    yield driver
    driver.quit()


def _wait(driver, condition, what: str):
    return WebDriverWait(driver, TIMEOUT_S, poll_frequency=0.2).until(
        lambda d: condition(d), message=f"timed out waiting for {what}")


def _card(driver, image: Path):
    return driver.find_element("css selector", f'figure[data-path="{image}"]')


def test_a_caption_typed_on_the_page_is_saved_and_the_button_captions_the_rest(browser, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name, colour in (("a.png", (200, 30, 30)), ("b.png", (30, 30, 200)), ("c.png", (30, 200, 30))):
        Image.new("RGB", (64, 64), colour).save(data / name)
    (data / "a.txt").write_text("a red square\n")
    tagger = write_tiny_wd14(tmp_path / "models")
    editing = CaptionEditing(TOKEN, [tmp_path / "models"])
    with serve(create_app([], dataset=str(data), recheck=functools.partial(check_dataset, data, 64),
                           captions=editing, local_hosts=True)) as url:
        browser.get(f"{url}/captions?token={TOKEN}")
        _wait(browser, lambda d: len(d.find_elements("css selector", "figure textarea")) == 3, "three captions")
        assert _card(browser, data / "a.png").find_element("tag name", "textarea").get_attribute("value") \
            == "a red square"
        box = _card(browser, data / "b.png").find_element("tag name", "textarea")
        box.send_keys("a blue square")
        _card(browser, data / "b.png").find_element("tag name", "button").click()
        _wait(browser, lambda d: "saved" in _card(d, data / "b.png").text, "the saved note")
        assert (data / "b.txt").read_text() == "a blue square\n"

        Select(browser.find_element("id", "captioner")).select_by_value("wd14")
        browser.find_element("id", "model").send_keys(str(tagger))
        browser.find_element("id", "caption-start").click()
        _wait(browser, lambda d: "finished (exit code 0)" in d.find_element("id", "caption-status").text,
              "the captioning job")
        _wait(browser, lambda d: "0 without a caption" in d.find_element("id", "caption-count").text, "the new list")
    assert (data / "a.txt").read_text() == "a red square\n" and (data / "b.txt").read_text() == "a blue square\n"
    assert (data / "c.txt").read_text().strip()
