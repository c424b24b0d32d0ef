"""The dashboard in a real headless browser: Debian's chromium driven by selenium through the system
chromedriver (nothing is downloaded). It opens a finished tiny run and a run in progress, checks that the
loss chart is drawn and the sample images decode, that the page follows the run as it grows, and saves
screenshots under test-artifacts/.

Set DREAMSTEP_DASHBOARD_SCREENSHOT=docs/dashboard.png (and optionally DREAMSTEP_DASHBOARD_RUNS=demo_out)
to also write the README's screenshot of the runs' page.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from dashboard_testkit import GrowingRun, copy_run, serve
from PIL import Image

from dreamstep.dashboard.app import create_app

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--window-size=1280,1000"]
TIMEOUT_S = 240

if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
    pytest.skip("no browser: Debian's chromium and chromium-driver are not installed "
                "(apt-get install -y chromium chromium-driver); the HTTP tests still run", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(TIMEOUT_S)
    yield driver
    driver.quit()


def _version() -> str:
    return subprocess.run([str(CHROMIUM), "--version"], capture_output=True, text=True).stdout.strip()


def _wait(driver, condition, what: str):
    return WebDriverWait(driver, TIMEOUT_S, poll_frequency=0.2).until(
        lambda d: condition(d), message=f"timed out waiting for {what}")


def _drawn_pixels(driver, canvas_id: str) -> int:
    """How many pixels of the canvas are painted (not transparent)."""
    return driver.execute_script("""
        const c = document.getElementById(arguments[0]);
        if (!c || !c.width) { return 0; }
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) { if (d[i] > 0) { n++; } }
        return n;""", canvas_id)


def _sample_images(driver) -> list[dict]:
    return driver.execute_script("""
        return [...document.querySelectorAll('#samples img')].map(
            (img) => ({complete: img.complete, width: img.naturalWidth, src: img.getAttribute('src')}));""")


def _screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    assert driver.save_screenshot(str(path)), f"no screenshot for {name}"
    return path


def _loaded(images: list[dict], count: int) -> bool:
    return len(images) == count and all(i["complete"] and i["width"] > 0 for i in images)


def test_finished_run_renders_its_chart_samples_and_lora_report(browser, finished_run, tmp_path):
    root = tmp_path / "runs"
    copy_run(finished_run, root)
    with serve(create_app([root])) as url:
        browser.get(f"{url}/#/")
        _wait(browser, lambda d: d.execute_script(
            "return document.querySelector('tr[data-run=\"0.robot\"] .badge')?.dataset.state") == "finished",
            "the runs list")
        browser.get(f"{url}/#/run/0.robot")
        _wait(browser, lambda d: int(d.find_element("id", "loss-canvas").get_attribute("data-points") or 0) >= 4,
              "the loss chart")
        assert _drawn_pixels(browser, "loss-canvas") > 2000
        _wait(browser, lambda d: _loaded(_sample_images(d), 3), "three decoded sample images")
        captions = browser.find_element("id", "samples").text
        assert "step 4" in captions and "seed 3" in captions and "sks robot on the beach" in captions
        _wait(browser, lambda d: "diffusers/PEFT layout" in d.find_element("id", "loras").text, "the LoRA report")
        assert "finished" in browser.find_element("id", "log").text
        shot = _screenshot(browser, "dashboard-finished-run.png")
    assert Image.open(shot).size[0] >= 1000
    print(f"browser: {_version()}; screenshot: {shot}")


def test_each_metric_has_its_own_axis_and_the_log_opens_at_its_end(browser, finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "runs")
    (run / "metrics.csv").write_text("step,val_loss,clip_score\n2,0.61234,27.5\n4,0.61236,31.25\n")
    with (run / "train.log").open("a") as log:
        log.writelines(f"line {i} of a long log\n" for i in range(300))
    with serve(create_app([tmp_path / "runs"])) as url:
        browser.get(f"{url}/#/run/0.robot")
        _wait(browser, lambda d: d.execute_script(
            "return document.querySelectorAll('#metrics canvas[data-metric]').length") == 2, "two metric charts")
        _wait(browser, lambda d: _drawn_pixels(d, "metric-1-canvas") > 500, "the clip_score chart")
        assert browser.execute_script(
            "return [...document.querySelectorAll('#metrics canvas')].map((c) => c.dataset.metric)") == [
                "val_loss", "clip_score"]
        _wait(browser, lambda d: "line 299" in d.find_element("id", "log").text, "the log")
        at_end = browser.execute_script(
            "const p = document.querySelector('#log pre'); return p.scrollHeight > p.clientHeight"
            " && p.scrollTop + p.clientHeight >= p.scrollHeight - 2")
        assert at_end, "the log must open at its newest lines"
        browser.execute_script("document.getElementById('metrics').scrollIntoView()")
        _screenshot(browser, "dashboard-metrics.png")


def test_run_in_progress_updates_by_itself(browser, tmp_path):
    run = GrowingRun(tmp_path / "runs" / "live", total=50)
    run.add_steps(5)
    run.add_sample()
    with serve(create_app([tmp_path / "runs"])) as url:
        browser.get(f"{url}/#/run/0.live")
        _wait(browser, lambda d: "step 5 / 50" in d.find_element("tag name", "main").text, "step 5")
        assert browser.find_element("css selector", ".badge").get_attribute("data-state") == "running"
        _wait(browser, lambda d: _loaded(_sample_images(d), 1), "the first sample grid")
        points_before = int(browser.find_element("id", "loss-canvas").get_attribute("data-points"))
        run.add_steps(10)
        run.add_sample()  # no reload: the page polls
        _wait(browser, lambda d: "step 15 / 50" in d.find_element("tag name", "main").text, "step 15")
        _wait(browser, lambda d: _loaded(_sample_images(d), 2), "the second sample grid")
        assert int(browser.find_element("id", "loss-canvas").get_attribute("data-points")) > points_before
        assert "ETA" in browser.find_element("tag name", "main").text
        _screenshot(browser, "dashboard-run-in-progress.png")


def test_compare_two_runs_and_the_readme_screenshot(browser, finished_run, tmp_path):
    root = tmp_path / "runs"
    copy_run(finished_run, root)
    live = GrowingRun(root / "live", total=50)
    live.add_steps(8)
    live.add_sample()
    with serve(create_app([root])) as url:
        browser.get(f"{url}/#/compare/0.robot,0.live")
        _wait(browser, lambda d: int(d.find_element("id", "compare-loss-canvas").get_attribute("data-points") or 0)
              >= 4 + 8, "both smoothed curves")
        _wait(browser, lambda d: d.execute_script(
            "return [...document.querySelectorAll('#compare-samples img')].filter(i => i.naturalWidth > 0).length")
              >= 2, "samples of both runs")
        _screenshot(browser, "dashboard-compare.png")
    readme_shot = os.environ.get("DREAMSTEP_DASHBOARD_SCREENSHOT")
    if readme_shot:
        runs = Path(os.environ.get("DREAMSTEP_DASHBOARD_RUNS", root))
        with serve(create_app([runs])) as url:
            browser.get(f"{url}/#/")
            run_id = _wait(browser, lambda d: d.execute_script(
                "return document.querySelector('tr[data-run]')?.dataset.run"), "a run")
            browser.get(f"{url}/#/run/{run_id}")
            _wait(browser, lambda d: int(d.find_element("id", "loss-canvas").get_attribute("data-points") or 0) > 0,
                  "the loss chart")
            _wait(browser, lambda d: all(i["complete"] and i["width"] > 0 for i in _sample_images(d)), "samples")
            shot = _screenshot(browser, "dashboard-readme.png")
        image = Image.open(shot).convert("RGB")
        image = image.resize((image.width * 3 // 4, image.height * 3 // 4), Image.Resampling.LANCZOS)
        image.quantize(colors=128).save(readme_shot, optimize=True)
        shutil.copy(readme_shot, ARTIFACTS / Path(readme_shot).name)


def _fill(driver, values: dict[str, str]) -> None:
    for name, value in values.items():
        box = driver.find_element("id", f"opt-{name}")
        if box.tag_name == "select":
            from selenium.webdriver.support.ui import Select

            Select(box).select_by_value(value)
            continue
        box.clear()
        box.send_keys(value)


def _row(driver, job_id: int) -> dict:
    return driver.execute_script("""
        const row = document.querySelector(`#jobs tr[data-job="${arguments[0]}"]`);
        return row ? {state: row.dataset.state, progress: row.querySelector('.progress').textContent} : {};""",
                                 job_id)


def _click(driver, job_id: int, action: str) -> None:
    _wait(driver, lambda d: d.find_elements("css selector", f'button[data-job="{job_id}"][data-action="{action}"]'),
          f"the {action} button of job {job_id}")
    driver.find_element("css selector", f'button[data-job="{job_id}"][data-action="{action}"]').click()
    _wait(driver, lambda d: d.find_element("tag name", "body").get_attribute("data-answered") == f"{action} {job_id}",
          f"the answer to {action}")


def _queue_from_form(driver, name: str, steps: int) -> int:
    driver.find_element("id", "name").clear()
    driver.find_element("id", "name").send_keys(name)
    _fill(driver, {"max_train_steps": str(steps)})
    _wait(driver, lambda d: f"--output_dir {d.find_element('id', 'output_root').text}" in
          d.find_element("id", "command").text.replace(f"/{name}", "") and "max_train_steps = " + str(steps)
          in d.find_element("id", "toml").text, f"the command and TOML of {name}")
    driver.find_element("id", "queue").click()
    _wait(driver, lambda d: (d.find_element("tag name", "body").get_attribute("data-answered") or "").startswith(
        "queued") and d.find_element("tag name", "body").get_attribute("data-answered") != driver.last_queued,
        f"{name} queued")
    driver.last_queued = driver.find_element("tag name", "body").get_attribute("data-answered")
    return int(driver.last_queued.split()[1])


def _panel(driver, panel: str) -> dict:
    return driver.execute_script("""
        const box = document.getElementById(arguments[0]);
        return {state: box.dataset.state, fits: box.dataset.fits, text: box.innerText};""", panel)


def test_a_run_created_from_the_form_is_watched_stopped_resumed_and_the_next_job_runs(browser, tmp_path,
                                                                                     tiny_flux_dev_dir):
    """The form shows the plan of the run's own base and the dataset check as it changes; a job queued from it
    is watched, stopped (a checkpoint) and resumed; the dashboard restarted with one job running and one queued
    shows both and goes on with the queue."""
    import signal

    from dashboard_testkit import ROBOT_DIR, DashboardProcess

    from dreamstep.engine.run_folder import read_status

    runs = tmp_path / "runs"
    runs.mkdir()
    roots = [tiny_flux_dev_dir.parent, ROBOT_DIR.parent]
    dashboard = DashboardProcess(runs, roots)
    paused: list[int] = []
    try:
        browser.get(f"{dashboard.url}/new?token={dashboard.token}")
        _wait(browser, lambda d: d.find_elements("id", "opt-pretrained_model_name_or_path"), "the generated form")
        legends = [e.text for e in browser.find_elements("css selector", "fieldset legend")]
        assert legends[:2] == ["model", "data"] and "LoRA / adapter" in legends and "memory" in legends
        assert "LoRA rank" in browser.find_element("css selector", '.field[data-name="rank"]').text
        browser.find_element("id", "name").send_keys("first")
        _fill(browser, {"pretrained_model_name_or_path": "flux-dev", "instance_data_dir": "robot",
                        "instance_prompt": "a photo of sks robot", "resolution": "32", "rank": "4",
                        "validation_prompt": "sks robot", "num_validation_images": "1",
                        "validation_inference_steps": "1", "validation_steps": "1000", "report_to": "none",
                        "logging_steps": "1", "device_memory": "4MB"})
        # Live, before anything is queued: the plan of the tiny base itself (not the released FLUX.1-dev) against
        # the card given, and the robot folder as flux-lora reads it (square 32 px crops, the instance prompt).
        _wait(browser, lambda d: _panel(d, "plan")["fits"] == "false", "the plan: does not fit in 4MB")
        plan = _panel(browser, "plan")["text"]
        assert f"base: {tiny_flux_dev_dir.resolve()}" in plan and "does NOT fit" in plan and "MiB" in plan
        check = _wait(browser, lambda d: (c := _panel(d, "dataset-check"))["state"] == "ready" and c, "the data")
        assert "6 images, 6 used" in check["text"] and "crop 32x32: 6 images" in check["text"]
        assert "robot_0.png: a photo of sks robot" in check["text"]
        _fill(browser, {"device_memory": "2GB"})
        _wait(browser, lambda d: _panel(d, "plan")["fits"] == "true", "the plan to follow the form: fits in 2GB")
        _fill(browser, {"resolution": "48"})
        _wait(browser, lambda d: "crop 48x48: 6 images" in _panel(d, "dataset-check")["text"], "the check at 48 px")
        _fill(browser, {"resolution": "32", "learning_rate": "fast"})
        error = '.field-error[data-for="learning_rate"]'
        _wait(browser, lambda d: "is not a number" in d.find_element("css selector", error).text,
              "the error next to --learning_rate")
        assert browser.find_element("id", "queue").get_attribute("disabled") is not None
        _fill(browser, {"learning_rate": "1e-3"})
        _wait(browser, lambda d: not d.find_element("css selector", error).text, "the error to clear")
        browser.last_queued = None
        first = _queue_from_form(browser, "first", 30)
        second = _queue_from_form(browser, "second", 2)
        _wait(browser, lambda d: _row(d, second).get("state") == "queued", "the second job to wait")
        # Paused at its first steps (read from its status file, written every step here) while the page shows
        # the progress and the Stop click reaches the server, so the run cannot end first however fast it trains.
        job = dashboard.wait_job(first, lambda j: (read_status(Path(j["output_dir"])) or {}).get("step", 0) >= 1,
                                 "to train a step")
        os.kill(job["pid"], signal.SIGSTOP)
        pid = job["pid"]
        _wait(browser, lambda d: _row(d, first).get("progress", "").split(" / ")[0] not in ("", "0"),
              "the first job's progress")
        _click(browser, first, "stop")
        os.kill(pid, signal.SIGCONT)
        _wait(browser, lambda d: _row(d, first).get("state") == "stopped", "the first job to stop")
        folder = Path(dashboard.job(first)["output_dir"])
        status = read_status(folder)
        assert status["state"] == "interrupted" and (folder / f"checkpoint-{status['step']}").is_dir()
        # The second job is held as it starts, so it is still running when the dashboard restarts.
        running = dashboard.wait_job(second, lambda j: j["state"] == "running", "the second job to start")
        os.kill(running["pid"], signal.SIGSTOP)
        paused.append(running["pid"])
        _click(browser, first, "resume")
        _wait(browser, lambda d: _row(d, first).get("state") == "queued", "the resumed job to wait")

        dashboard.close()  # Ctrl-C: one job running, one queued; the user opens the address the new one prints
        dashboard = DashboardProcess(runs, roots)
        browser.get(f"{dashboard.url}/new?token={dashboard.token}")
        _wait(browser, lambda d: (_row(d, first).get("state"), _row(d, second).get("state")) == ("queued", "running"),
              "the restarted page to show the queued and the running job")
        os.kill(paused.pop(), signal.SIGCONT)
        _wait(browser, lambda d: _row(d, second).get("state") == "finished", "the second job to finish")
        _wait(browser, lambda d: _row(d, first).get("state") == "finished", "the resumed job to finish")
        assert _row(browser, first)["progress"] == "30 / 30"
        browser.find_element("css selector", f'#jobs tr[data-job="{first}"] button:last-child').click()
        _wait(browser, lambda d: "resuming from" in d.find_element("id", "job-log").text
              and "pytorch_lora_weights.safetensors" in d.find_element("id", "job-log").text, "the job's log")
        _screenshot(browser, "dashboard-jobs.png")
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        dashboard.close()


def test_a_constant_is_drawn_against_zero_and_axis_labels_tell_ticks_apart(browser, growing_run):
    with serve(create_app([growing_run.folder.parent])) as url:
        browser.get(f"{url}/#/")
        _wait(browser, lambda d: d.execute_script("return typeof range === 'function' && typeof tickLabels === "
                                                  "'function'"), "the page's scripts")
        assert browser.execute_script("return range([{y: [1e-3, 1e-3, 1e-3]}])") == [0, pytest.approx(1.5e-3)]
        low, high = browser.execute_script("return range([{y: [1, 2]}])")
        assert low < 1 < 2 < high and high - low < 1.2
        # values that differ in the fifth decimal (a val_loss): every tick keeps its own label
        labels = browser.execute_script("return tickLabels(niceTicks(0.61234, 0.61236, 5))")
        assert len(set(labels)) == len(labels) > 1
        assert browser.execute_script("return tickLabels(niceTicks(0, 0.0015, 5))") == [
            "0.0000", "0.0005", "0.0010", "0.0015"]
        assert browser.execute_script("return tickLabels(niceTicks(0, 1e6, 5))") == [
            "0", "2e+5", "4e+5", "6e+5", "8e+5", "1e+6"]
