"""Caption editing in the dashboard (``--edit_captions``), tried from outside against the real server (uvicorn on
loopback): a caption file is written atomically beside a listed image and nowhere else, with the token, CSRF and
Host rules of every change; the images without a caption are captioned by a ``dreamstep caption`` process."""

from __future__ import annotations

import functools
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from dashboard_testkit import serve
from PIL import Image

pytest.importorskip("starlette")

from dreamstep.captioning.tiny import write_tiny_wd14  # noqa: E402
from dreamstep.dashboard.app import create_app  # noqa: E402
from dreamstep.dashboard.caption_routes import CaptionEditing  # noqa: E402
from dreamstep.dashboard.dataset_check import check_dataset  # noqa: E402

TOKEN = "caption-token"
AUTH = {"X-Dreamstep-Token": TOKEN}


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    for name, colour in (("a.png", (200, 30, 30)), ("b.png", (30, 30, 200)), ("c.png", (30, 200, 30))):
        Image.new("RGB", (64, 64), colour).save(folder / name)
    (folder / "a.txt").write_text("a red square\n")
    (tmp_path / "outside").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "outside" / "x.png")
    (tmp_path / "outside" / "secret.txt").write_text("keep me\n")
    return folder


@pytest.fixture
def server(dataset: Path, tmp_path: Path):
    models = tmp_path / "models"
    write_tiny_wd14(models)
    editing = CaptionEditing(TOKEN, [models])
    with serve(create_app([], dataset=str(dataset), recheck=functools.partial(check_dataset, dataset, 64),
                           captions=editing, local_hosts=True)) as url:
        yield url, editing


def _call(url: str, body: object | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        return e.code, json.loads(text) if text.startswith("{") else text


def test_each_image_is_listed_with_its_caption_file(server, dataset):
    url, _ = server
    status, body = _call(f"{url}/api/dataset/captions")
    assert status == 200
    listed = {Path(im["path"]).name: im for im in body["images"]}
    assert listed["a.png"]["caption"] == "a red square" and listed["a.png"]["file"] == str(dataset / "a.txt")
    assert listed["b.png"]["caption"] is None and listed["b.png"]["file"] == str(dataset / "b.txt")
    assert body["job"]["running"] is False and "wd14" in body["captioners"]


def test_an_image_without_a_caption_file_says_so_beside_the_text_it_trains_with(dataset):
    recheck = functools.partial(check_dataset, dataset, 64, instance_prompt="a sks square")
    with serve(create_app([], dataset=str(dataset), recheck=recheck, captions=CaptionEditing(TOKEN, []),
                          local_hosts=True)) as url:
        listed = {Path(im["path"]).name: im for im in _call(f"{url}/api/dataset/captions")[1]["images"]}
    assert (listed["a.png"]["caption"], listed["a.png"]["has_file"]) == ("a red square", True)
    assert (listed["b.png"]["caption"], listed["b.png"]["has_file"]) == ("a sks square", False)


def test_an_edit_writes_the_caption_file_and_the_check_reads_it(server, dataset):
    url, _ = server
    status, body = _call(f"{url}/api/dataset/captions", {"path": str(dataset / "b.png"),
                                                         "caption": "a blue\nsquare  "}, AUTH)
    assert status == 200, body
    assert (dataset / "b.txt").read_text() == "a blue square\n"
    assert not [p for p in dataset.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    check = _call(f"{url}/api/dataset")[1]
    b = next(im for im in check["images"] if im["name"] == "b.png")
    assert b["raw_caption"] == "a blue square" and b["used"]


@pytest.mark.parametrize("path", ["{outside}/x.png", "{data}/../outside/x.png", "{outside}/secret.txt",
                                  "/etc/passwd", "{data}/a.txt", "b.png"])
def test_a_path_that_is_not_a_listed_image_is_refused(server, dataset, path):
    url, _ = server
    given = path.format(outside=dataset.parent / "outside", data=dataset)
    status, body = _call(f"{url}/api/dataset/captions", {"path": given, "caption": "pwned"}, AUTH)
    assert status == 404, body
    assert (dataset.parent / "outside" / "secret.txt").read_text() == "keep me\n"
    assert not (dataset.parent / "outside" / "x.txt").exists() and not (dataset / "b.txt").exists()


def test_a_caption_file_that_links_outside_is_refused(server, dataset):
    url, _ = server
    secret = dataset.parent / "outside" / "secret.txt"
    os.symlink(secret, dataset / "c.txt")
    status, body = _call(f"{url}/api/dataset/captions", {"path": str(dataset / "c.png"), "caption": "x"}, AUTH)
    assert status == 403 and "link" in body["error"]
    assert secret.read_text() == "keep me\n"


@pytest.mark.parametrize("headers, expected", [
    ({}, 403),
    ({"X-Dreamstep-Token": "wrong"}, 403),
    ({"Cookie": f"dreamstep_token={TOKEN}"}, 403),
    ({**AUTH, "Origin": "http://evil.example"}, 403),
    ({**AUTH, "Content-Type": "text/plain"}, 415),
    ({**AUTH, "Host": "evil.example"}, 403),
])
def test_an_edit_without_the_token_or_from_another_site_is_refused(server, dataset, headers, expected):
    url, _ = server
    edit = {"path": str(dataset / "b.png"), "caption": "x"}
    assert _call(f"{url}/api/dataset/captions", edit, headers)[0] == expected
    assert not (dataset / "b.txt").exists()


def test_without_edit_captions_the_dataset_check_stays_read_only(dataset):
    with serve(create_app([], dataset=str(dataset), recheck=functools.partial(check_dataset, dataset, 64))) as url:
        status, _ = _call(f"{url}/api/dataset/captions", {"path": str(dataset / "b.png"), "caption": "x"}, AUTH)
    assert status == 405 and not (dataset / "b.txt").exists()


def test_bad_requests_change_nothing(server, dataset, tmp_path):
    url, _ = server
    assert _call(f"{url}/api/dataset/captions", {"path": str(dataset / "a.png"), "caption": " \n"}, AUTH)[0] == 400
    assert _call(f"{url}/api/dataset/captions/missing", {"captioner": "gpt"}, AUTH)[0] == 400
    status, body = _call(f"{url}/api/dataset/captions/missing", {"captioner": "wd14", "model": str(tmp_path)}, AUTH)
    assert status == 403 and "RUN_DIR" in body["error"]
    assert (dataset / "a.txt").read_text() == "a red square\n"


@pytest.mark.parametrize(("route", "raw", "field"), [
    ("captions", b"[" * 100_000 + b"]" * 100_000, "body"),
    ("captions", b"[1]", "body"),
    ("captions", b'{"path": "a.png", "caption": {"a": 1}}', "caption"),
    ("captions", b'{"path": ["a.png"], "caption": "x"}', "path"),
    ("captions", b'{"path": "a.png", "caption": "a \\ud800 square"}', "caption"),
    ("captions/missing", b'{"captioner": ["wd14"]}', "captioner"),
    ("captions/missing", b'{"captioner": {"a": 1}}', "captioner"),
    ("captions/missing", b'{"captioner": "wd14", "model": {"a": 1}}', "model"),
    ("captions/missing", b'{"captioner": "wd14", "prefix": "\\udc80"}', "prefix"),
])
def test_malformed_caption_requests_are_a_4xx_naming_the_field(server, dataset, route, raw, field):
    url, editing = server
    request = urllib.request.Request(f"{url}/api/dataset/{route}", data=raw, method="POST",
                                     headers={"Content-Type": "application/json", **AUTH})
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=30)
    assert 400 <= answer.value.code < 500 and json.loads(answer.value.read())["field"] == field
    assert editing.process is None and sorted(p.name for p in dataset.iterdir()) == ["a.png", "a.txt", "b.png",
                                                                                    "c.png"]


def test_the_button_captions_the_images_without_one_in_its_own_process(server, dataset, tmp_path):
    url, editing = server
    status, body = _call(f"{url}/api/dataset/captions/missing",
                         {"captioner": "wd14", "model": str(tmp_path / "models" / "wd14"), "prefix": "sks, "}, AUTH)
    assert status == 202, body
    assert body["job"]["command"][1:4] == ["-m", "dreamstep", "caption"] and editing.process.pid != os.getpid()
    deadline = time.monotonic() + 120
    while (job := _call(f"{url}/api/dataset/captions/job")[1]["job"])["running"]:
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    assert job["returncode"] == 0, job["log"]
    assert (dataset / "a.txt").read_text() == "a red square\n"
    for name in ("b.txt", "c.txt"):
        assert (dataset / name).read_text().startswith("sks, ")
    check = _call(f"{url}/api/dataset")[1]
    assert all(im["used"] for im in check["images"])


def test_edit_captions_needs_a_dataset(capsys):
    from dreamstep.cli import main

    assert main(["dashboard", ".", "--edit_captions"]) == 2
    assert "--edit_captions edits the captions of --dataset" in capsys.readouterr().err


def test_the_caption_log_folder_is_made_for_a_job_and_removed_with_the_dashboard():
    import gc

    editing = CaptionEditing(TOKEN, [])
    assert editing.log_dir is None  # a dashboard that never captions leaves nothing in the temp folder
    folder = editing.log_path.parent
    assert folder.is_dir()
    del editing
    gc.collect()
    assert not folder.exists()
