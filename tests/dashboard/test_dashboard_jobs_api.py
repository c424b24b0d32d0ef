"""The job API's rules, tried from outside against the real server (uvicorn on loopback): the token on every
change, CSRF, the Host check, folders only inside the roots given, the trainer's own validation with the
field named; and the queue's order and cancel kept in SQLite."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from dashboard_testkit import ROBOT_DIR, serve

pytest.importorskip("starlette")

from dreamstep.dashboard.app import create_app  # noqa: E402
from dreamstep.dashboard.job_routes import Training  # noqa: E402
from dreamstep.dashboard.jobs import JobError, JobQueue  # noqa: E402

TOKEN = "change-token"


@pytest.fixture
def roots(tmp_path: Path, tiny_flux_dev_dir: Path) -> tuple[Path, list[Path]]:
    runs = tmp_path / "runs"
    runs.mkdir()
    return runs, [tiny_flux_dev_dir.parent, ROBOT_DIR.parent]


@pytest.fixture
def server(roots):
    runs, data = roots
    # No job may start in these tests: a slot count of 0 keeps accepted jobs queued.
    training = Training([runs], data, runs / ".dreamstep-jobs", TOKEN, max_running=0)
    with serve(create_app([runs], training=training, local_hosts=True)) as url:
        yield url, training


def _post(url: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, dict | str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        return e.code, json.loads(text) if text.startswith("{") else text


def _job(name: str = "first", **options: object) -> dict:
    return {"trainer": "flux-lora", "output_root": 0, "name": name,
            "options": {"pretrained_model_name_or_path": "flux-dev", "instance_data_dir": "robot",
                        "instance_prompt": "a photo of sks robot", "resolution": 32, "max_train_steps": 2,
                        **options}}


AUTH = {"X-Dreamstep-Token": TOKEN}


def test_a_valid_job_is_queued_with_its_toml_and_paths_resolved_inside_the_roots(server, roots, tiny_flux_dev_dir):
    url, training = server
    status, body = _post(f"{url}/api/jobs", _job(learning_rate="2e-4"), AUTH)
    assert status == 201, body
    job = body["job"]
    assert job["state"] == "queued" and job["output_dir"] == str((roots[0] / "first").resolve())
    assert f'pretrained_model_name_or_path = "{tiny_flux_dev_dir.resolve()}"' in job["config_toml"]
    assert "learning_rate = 0.0002\n" in job["config_toml"]  # converted by the config, as the flag would be
    assert job["command"][:3] == ["dreamstep", "train", "flux-lora"]
    listed = json.loads(urllib.request.urlopen(f"{url}/api/jobs", timeout=30).read())["jobs"]
    assert [j["id"] for j in listed] == [job["id"]]
    assert _post(f"{url}/api/jobs", _job(), AUTH)[0] == 400  # the same output folder is taken


def test_a_job_whose_prompts_hold_newlines_and_quotes_queues_a_toml_that_reads_back(server):
    """The form's text areas take newlines; the job's TOML is what its trainer reads (was: queued, then failed)."""
    import tomllib

    url, training = server
    prompt = 'a photo of "sks" robot\non the moon \\ 月\ttab\x01'
    status, body = _post(f"{url}/api/jobs", _job(instance_prompt=prompt, validation_prompt=prompt + "\r\n"), AUTH)
    assert status == 201, body
    saved = tomllib.loads(body["job"]["config_toml"])
    assert (saved["instance_prompt"], saved["validation_prompt"]) == (prompt, prompt + "\r\n")


@pytest.mark.parametrize("headers, expected", [
    ({}, 403),
    ({"X-Dreamstep-Token": "wrong"}, 403),
    ({"Authorization": "Bearer wrong"}, 403),
    ({"Cookie": f"dreamstep_token={TOKEN}"}, 403),  # a cookie is what a cross-site form would carry
    ({**AUTH, "Origin": "http://evil.example"}, 403),
    ({**AUTH, "Content-Type": "application/x-www-form-urlencoded"}, 415),
    ({**AUTH, "Host": "evil.example"}, 403),  # a DNS-rebinding page reaches loopback under another name
])
def test_a_change_without_the_token_or_from_another_site_is_refused(server, headers, expected):
    url, training = server
    assert _post(f"{url}/api/jobs", _job(), headers)[0] == expected
    assert training.queue.all() == []


def test_the_token_in_the_query_does_not_count_for_a_change(server):
    url, training = server
    assert _post(f"{url}/api/jobs?token={TOKEN}", _job())[0] == 403
    assert training.queue.all() == []


@pytest.mark.parametrize("change, field", [
    ({"name": "../outside"}, "name"),
    ({"name": "/tmp/outside"}, "name"),
    ({"name": ".hidden"}, "name"),
    ({"output_root": 3}, "output_root"),
    ({"options": {"instance_data_dir": "/etc"}}, "instance_data_dir"),
    ({"options": {"instance_data_dir": "../runs"}}, "instance_data_dir"),
    ({"options": {"instance_data_dir": "robot/../../.."}}, "instance_data_dir"),
    ({"options": {"pretrained_model_name_or_path": "/etc"}}, "pretrained_model_name_or_path"),
    ({"options": {"logging_dir": "/tmp/logs"}}, "logging_dir"),
    ({"options": {"output_dir": "elsewhere"}}, "output_dir"),
    ({"options": {"resume_from_checkpoint": "latest"}}, "resume_from_checkpoint"),
    ({"options": {"learning_rate": "fast"}}, "learning_rate"),
    ({"options": {"resolution": -5}}, "resolution"),
    ({"options": {"no_such_option": 1}}, "no_such_option"),
    ({"trainer": "flux-dreambooth"}, "trainer"),
])
def test_bad_fields_are_refused_with_the_field_named(server, change, field):
    url, training = server
    body = _job()
    options = {**body["options"], **change.pop("options", {})}
    status, answer = _post(f"{url}/api/jobs", {**body, **change, "options": options}, AUTH)
    assert status == 400 and answer["field"] == field, answer
    assert training.queue.all() == []


def _post_raw(url: str, raw: bytes) -> tuple[int, dict | str]:
    request = urllib.request.Request(url, data=raw, method="POST",
                                     headers={"Content-Type": "application/json", **AUTH})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        return e.code, json.loads(text) if text.startswith("{") else text


_JOB = json.dumps(_job())[:-1]  # a valid job's JSON without its closing brace, for raw bodies


@pytest.mark.parametrize(("raw", "field"), [
    (b"[" * 100_000 + b"]" * 100_000, "body"),
    (b'{"a": ' * 5_000 + b"1" + b"}" * 5_000, "body"),
    (b"[1, 2]", "body"),
    (b'{"trainer": "flux-lora", "output_root": 0, "name": "a", "options": [1]}', "options"),
    (_JOB.encode() + b', "trainer": {"a": 1}}', "trainer"),
    (_JOB.encode() + b', "name": ["a"]}', "name"),
    (_JOB.encode() + b', "name": "' + b"a" * 300 + b'"}', "name"),
    (_JOB.encode() + b', "output_root": 18446744073709551616}', "output_root"),
    (b'{"trainer": "flux-lora", "output_root": 0, "name": "a", "options": {"instance_prompt": "\\ud800"}}',
     "instance_prompt"),
    (b'{"trainer": "flux-lora", "output_root": 0, "name": "\\udfff"}', "name"),
    (b'{"trainer": "flux-lora", "output_root": 0, "name": "a", "options": {"resolution": {"a": 1}}}', "resolution"),
    (b'{"trainer": "flux-lora", "output_root": 0, "name": "a", "options": {"instance_prompt": ["a", 1]}}',
     "instance_prompt"),
])
def test_malformed_bodies_are_a_4xx_naming_the_field_on_every_route(server, raw, field):
    url, training = server
    for route in ("jobs", "jobs/check", "jobs/dataset", "jobs/plan"):
        status, answer = _post_raw(f"{url}/api/{route}", raw)
        assert 400 <= status < 500 and isinstance(answer, dict), (route, status, answer)
        assert answer["field"] == field and answer["error"], (route, answer)
    assert training.queue.all() == []


@pytest.mark.parametrize("job_id", [2**63, 2**64, 10**30])
def test_job_ids_beyond_64_bits_are_no_such_job(server, job_id):
    url, _ = server
    for path in (f"jobs/{job_id}", f"jobs/{job_id}/log"):
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(f"{url}/api/{path}", timeout=30)
        assert answer.value.code == 404 and json.loads(answer.value.read())["field"] == "job_id"
    assert _post_raw(f"{url}/api/jobs/{job_id}/stop", b"{}") == (404, {"error": "no such job", "field": "job_id"})


def test_a_job_log_shows_each_progress_bar_at_its_last_state():
    from dreamstep.dashboard.job_routes import log_lines

    written = "loading\nsteps:  10%|#  | 1/10\rsteps:  50%|##### | 5/10\rsteps: 100%|##########| 10/10\r\n\ndone\n"
    assert log_lines(written) == ["loading", "steps: 100%|##########| 10/10", "", "done"]


def test_a_symlink_out_of_a_root_is_refused(server, roots, tmp_path):
    url, training = server
    os.symlink("/etc", roots[0] / "etc-link")
    (tmp_path / "elsewhere").mkdir()
    status, answer = _post(f"{url}/api/jobs", _job(name="etc-link"), AUTH)
    assert status == 400 and answer["field"] == "name" and "outside" in answer["error"]
    status, answer = _post(f"{url}/api/jobs", _job(logging_dir="etc-link/logs"), AUTH)
    assert status == 400 and answer["field"] == "logging_dir"
    assert training.queue.all() == []


def test_the_dataset_check_and_plan_read_nothing_outside_the_roots_however_named(tmp_path, tiny_flux_dev_dir):
    """A dataset TOML inside a root that points outside, and a symlinked image inside an allowed folder."""
    from PIL import Image

    data, outside, runs = tmp_path / "data", tmp_path / "outside", tmp_path / "runs"
    for folder in (data / "linked", outside, runs):
        folder.mkdir(parents=True)
    for folder in (data / "linked", outside):
        Image.new("RGB", (32, 32), "red").save(folder / "inside.png" if folder != outside else folder / "x.png")
    (outside / "x.txt").write_text("a secret caption\n")
    os.symlink(outside / "x.png", data / "linked" / "link.png")
    (data / "d.toml").write_text(f"[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = "
                                 f"'{outside.as_posix()}'\ncaption_extension = '.txt'\n")
    training = Training([runs], [data, tiny_flux_dev_dir.parent], runs / ".dreamstep-jobs", TOKEN, max_running=0)
    model = {"pretrained_model_name_or_path": tiny_flux_dev_dir.name}
    with serve(create_app([runs], training=training, local_hosts=True)) as url:
        for options, named in (({"dataset_config": "d.toml"}, str(outside)),
                               ({"instance_data_dir": "linked", "instance_prompt": "sks"}, "link.png")):
            body = {"trainer": "flux-lora", "output_root": 0, "name": "a", "options": {**model, **options}}
            for route in ("dataset", "plan"):
                status, answer = _post(f"{url}/api/jobs/{route}", body, AUTH)
                assert status == 400 and named in answer["error"] and "outside" in answer["error"], answer
                assert "secret" not in json.dumps(answer)


def test_only_the_job_routes_take_a_post(server):
    url, _ = server
    assert _post(f"{url}/api/runs", {}, AUTH)[0] == 405
    request = urllib.request.Request(f"{url}/api/jobs", method="DELETE", headers=AUTH)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 405


def test_bound_beyond_loopback_every_route_needs_the_token(roots):
    runs, data = roots
    training = Training([runs], data, runs / ".dreamstep-jobs", TOKEN, max_running=0)
    with serve(create_app([runs], training=training, token=TOKEN)) as url:
        for route in ("/", "/api/jobs", "/api/runs", "/api/trainers"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{url}{route}", timeout=30)
            assert refused.value.code == 401
        answer = urllib.request.urlopen(urllib.request.Request(f"{url}/api/jobs", headers=AUTH), timeout=30)
        assert json.loads(answer.read()) == {"jobs": []}


def test_queued_jobs_are_reordered_and_cancelled_and_kept_in_sqlite(tmp_path):
    queue = JobQueue(tmp_path / "jobs.sqlite")
    first, second, third = (queue.add("flux-lora", "", str(tmp_path / name)).id for name in ("a", "b", "c"))
    queue.move(third, -1)
    queue.move(first, 5)
    assert [j.id for j in JobQueue(tmp_path / "jobs.sqlite").in_state("queued")] == [third, second, first]
    queue.cancel(second)
    with pytest.raises(JobError, match="only a queued job can cancel"):
        queue.cancel(second)
    with pytest.raises(JobError, match="only a stopped or failed job can resume"):
        queue.requeue_for_resume(first)
    assert [(j.id, j.state) for j in JobQueue(tmp_path / "jobs.sqlite").all()] == [
        (third, "queued"), (first, "queued"), (second, "cancelled")]


def test_a_runs_config_toml_fills_the_form_with_paths_inside_the_roots_and_checks_without_queuing(server,
                                                                                                finished_run):
    url, training = server
    status, answer = _post(f"{url}/api/jobs/from_toml",
                           {"trainer": "flux-lora", "toml": (finished_run / "config.toml").read_text()}, AUTH)
    assert status == 200, answer
    options = answer["options"]
    assert (options["pretrained_model_name_or_path"], options["instance_data_dir"]) == ("flux-dev", "robot")
    assert "output_dir" not in options and options["rank"] == 4
    status, checked = _post(f"{url}/api/jobs/check", {"trainer": "flux-lora", "name": "again", "options": options},
                            AUTH)
    assert status == 200, checked
    assert "rank = 4\n" in checked["toml"] and checked["command"][:3] == ["dreamstep", "train", "flux-lora"]
    assert training.queue.all() == []
    status, refused = _post(f"{url}/api/jobs/from_toml", {"trainer": "flux-lora", "toml": "rank = [1"}, AUTH)
    assert status == 400 and refused["field"] == "toml"


def test_the_form_has_every_option_of_each_trainer_in_a_section_with_its_help(server):
    url, _ = server
    from dreamstep.dashboard.job_requests import SET_BY_DASHBOARD, trainer_options

    for trainer in ("flux-lora", "sdxl-lora", "flux-kohya", "flux-controlnet", "flux-kontext-lora"):
        form = json.loads(urllib.request.urlopen(f"{url}/api/trainers/{trainer}/form", timeout=30).read())
        names = {f["name"] for f in form["fields"]}
        expected = {f.name for f in dataclasses.fields(trainer_options(trainer))}
        assert names == expected - set(SET_BY_DASHBOARD)
        assert {f["group"] for f in form["fields"]} <= set(form["groups"])
        assert all(f["help"] for f in form["fields"]), [f["name"] for f in form["fields"] if not f["help"]]


def _preview(url: str, what: str, **options: object) -> tuple[int, dict]:
    body = _job(**options)
    del body["name"]  # a preview needs no run name yet
    return _post(f"{url}/api/jobs/{what}", body, AUTH)


def test_the_plan_before_queuing_is_the_trainers_own_for_the_runs_base_and_the_card(server, tiny_flux_dev_dir,
                                                                                   tmp_path, capsys):
    from dreamstep.cli import main

    url, training = server
    status, answer = _preview(url, "plan", rank=4, device_memory="2GB")
    assert status == 200, answer
    plan = answer["plan"]
    # The tiny base's own configs (MiB), not the released FLUX.1-dev's (GiB); checked against the card given.
    assert plan["base"] == str(tiny_flux_dev_dir.resolve()) and 0 < plan["peak"] < 2**30 / 10
    assert plan["fits"] is True and plan["card"] == "--device_memory 2GB" and plan["would_fit"] == []
    # The trainer prints the same plan before it loads anything (--dry_run stops there).
    assert main(["train", "flux-lora", "--pretrained_model_name_or_path", str(tiny_flux_dev_dir), "--instance_data_dir",
                 str(ROBOT_DIR), "--instance_prompt", "a photo of sks robot", "--resolution", "32", "--rank", "4",
                 "--max_train_steps", "2", "--device_memory", "2GB", "--output_dir", str(tmp_path / "dry"),
                 "--dry_run"]) == 0
    assert plan["report"] in capsys.readouterr().out
    # A card too small: the options that would fit, each under the card's usable memory (1 GiB is kept free).
    status, answer = _preview(url, "plan", resolution=512, train_batch_size=4, max_sequence_length=77,
                              device_memory="1042.4MB")
    small = answer["plan"]
    assert small["fits"] is False and "does NOT fit" in small["report"] and small["would_fit"]
    assert all(f["peak"] <= 1042.4 * 2**20 - 2**30 for f in small["would_fit"])
    assert "--resolution 448" in small["would_fit"][0]["flags"] and "would fit: " in small["report"]
    assert training.queue.all() == []


def test_the_dataset_check_before_queuing_reads_the_data_as_the_trainer_does(server):
    url, training = server
    status, answer = _preview(url, "dataset", resolution=48)
    assert status == 200, answer
    check = answer["dataset"]
    assert [b["size"] for b in check["datasets"][0]["buckets"]] == [[48, 48]]  # flux-lora: square crops
    assert {i["caption"] for i in check["images"]} == {"a photo of sks robot"} and check["problems"] == []
    status, refused = _preview(url, "dataset", instance_data_dir="no-such-folder")
    assert status == 400 and refused["field"] == "instance_data_dir"
    status, refused = _preview(url, "plan", blocks_to_swap=99)
    assert status == 400 and refused["field"] == "blocks_to_swap", refused
    assert training.queue.all() == []


@pytest.mark.parametrize("headers, expected", [({}, 403), ({**AUTH, "Origin": "http://evil.example"}, 403)])
def test_previews_follow_the_rules_of_every_change(server, headers, expected):
    url, _ = server
    for what in ("plan", "dataset"):
        assert _post(f"{url}/api/jobs/{what}", _job(), headers)[0] == expected


def test_an_sdxl_lora_plan_before_queuing_is_the_one_its_dry_run_prints(tmp_path, tiny_sdxl_dir, capsys):
    from dreamstep.cli import main

    data = tmp_path / "data"
    (data / "kohya").mkdir(parents=True)
    shutil.copytree(ROBOT_DIR, data / "kohya" / "2_sks robot")  # a link out of the roots would be refused
    runs = tmp_path / "runs"
    runs.mkdir()
    training = Training([runs], [tiny_sdxl_dir.parent, data], runs / ".dreamstep-jobs", TOKEN, max_running=0)
    options = {"pretrained_model_name_or_path": tiny_sdxl_dir.name, "train_data_dir": "kohya", "resolution": "64",
               "network_dim": 4, "device_memory": "2GB"}
    with serve(create_app([runs], training=training)) as url:
        status, answer = _post(f"{url}/api/jobs/plan", {"trainer": "sdxl-lora", "options": options}, AUTH)
    assert status == 200, answer
    assert answer["plan"]["base"] == str(tiny_sdxl_dir.resolve()) and answer["plan"]["fits"] is True
    assert main(["train", "sdxl-lora", "--pretrained_model_name_or_path", str(tiny_sdxl_dir), "--train_data_dir",
                 str(data / "kohya"), "--resolution", "64", "--network_dim", "4", "--device_memory", "2GB",
                 "--output_dir", str(tmp_path / "dry"), "--dry_run"]) == 0
    assert answer["plan"]["report"] in capsys.readouterr().out


def test_without_device_memory_the_plan_is_checked_against_the_card_found(server, monkeypatch):
    import torch

    from dreamstep.models import memory_plan

    url, _ = server
    if not torch.cuda.is_available():
        status, answer = _preview(url, "plan")
        assert status == 200 and answer["plan"]["fits"] is None and "no CUDA card found" in answer["plan"]["card"]
    # A 12 GB card (the CUDA query stood in for): the tiny run fits it.
    monkeypatch.setattr(memory_plan, "detected_device_memory", lambda: 12 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA GeForce RTX 4070")
    status, answer = _preview(url, "plan")
    plan = answer["plan"]
    assert plan["card"] == "NVIDIA GeForce RTX 4070 (detected)" and plan["device_memory"] == 12 * 2**30
    assert plan["fits"] is True and "device memory 12.0 GiB" in plan["report"]


def test_a_flux_kohya_plan_and_dataset_check_before_queuing_are_the_trainers(tmp_path, tiny_flux_files,
                                                                             tiny_flux_dev_dir, capsys):
    from dreamstep.cli import main

    data = tmp_path / "data"
    (data / "kohya").mkdir(parents=True)
    shutil.copytree(ROBOT_DIR, data / "kohya" / "2_sks robot")  # a link out of the roots would be refused
    runs = tmp_path / "runs"
    runs.mkdir()
    files = {"pretrained_model_name_or_path": tiny_flux_files["transformer"], "clip_l": tiny_flux_files["clip_l"],
             "t5xxl": tiny_flux_files["t5xxl"], "ae": tiny_flux_files["ae"], "model_config": tiny_flux_dev_dir}
    roots = [tiny_flux_files["transformer"].parent, tiny_flux_dev_dir.parent, data]
    training = Training([runs], roots, runs / ".dreamstep-jobs", TOKEN, max_running=0)
    # Paths relative to the roots, as the form sends them (the files' folder, the tiny pipeline's parent).
    options = {**{flag: path.name for flag, path in files.items()}, "train_data_dir": "kohya", "resolution": "64",
               "network_dim": 4, "device_memory": "2GB"}
    with serve(create_app([runs], training=training)) as url:
        status, answer = _post(f"{url}/api/jobs/plan", {"trainer": "flux-kohya", "options": options}, AUTH)
        assert status == 200, answer
        status, check = _post(f"{url}/api/jobs/dataset", {"trainer": "flux-kohya", "options": options}, AUTH)
    assert status == 200, check
    # sd-scripts' folder layout: the repeats and class tokens of "2_sks robot", at the flag's resolution.
    assert {image["caption"] for image in check["dataset"]["images"]} == {"sks robot"}
    assert main(["train", "flux-kohya", *(f"--{flag}={path}" for flag, path in files.items()), "--train_data_dir",
                 str(data / "kohya"), "--resolution", "64", "--network_dim", "4", "--device_memory", "2GB",
                 "--output_dir", str(tmp_path / "dry"), "--dry_run"]) == 0
    assert answer["plan"]["report"] in capsys.readouterr().out


def test_a_killed_jobs_message_says_it_was_killed_not_a_progress_bar_line(tmp_path, tiny_flux_dev_dir):
    """kill -9 (or the out-of-memory killer) leaves the run no time to say why: the job says what it knows, seen by
    the dashboard that started it (the exit code) and by one restarted since (the run status still running)."""
    import signal
    import time

    from dreamstep.dashboard.jobs import JobRunner
    from dreamstep.engine.run_folder import read_status

    queue, state, run = JobQueue(tmp_path / "jobs.sqlite"), tmp_path / "state", tmp_path / "run"
    state.mkdir()
    options = (f'pretrained_model_name_or_path = "{tiny_flux_dev_dir}"\ninstance_data_dir = "{ROBOT_DIR}"\n'
               'instance_prompt = "sks robot"\nresolution = 32\nmax_train_steps = 1000\nreport_to = "none"\n'
               'logging_steps = 1\n')
    runner = JobRunner(queue, state)
    job = queue.add("flux-lora", options, str(run))
    runner.tick()
    deadline = time.monotonic() + 240
    while (read_status(run) or {}).get("step", 0) < 2 or "%|" not in runner.log_path(job.id).read_text():
        assert time.monotonic() < deadline and queue.get(job.id).state == "running", queue.get(job.id)
        time.sleep(0.05)
    pid = queue.get(job.id).pid
    os.kill(pid, signal.SIGKILL)
    while queue.get(job.id).state == "running":
        runner.tick()
    killed = queue.get(job.id)
    assert (killed.state, killed.exit_code) == ("failed", -signal.SIGKILL)
    assert killed.message == "the trainer was killed by SIGKILL (kill -9, or the system when it runs out of memory)"

    seen_later = queue.add("flux-lora", options, str(run))
    queue.update(seen_later.id, state="running", pid=pid)  # as the dashboard that started it left it
    JobRunner(queue, state).tick()
    assert queue.get(seen_later.id).message == ("the trainer's process ended without its run recording how: most "
                                                "likely it was killed (kill -9, or the system when it runs out of "
                                                "memory)")
