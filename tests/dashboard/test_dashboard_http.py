"""The dashboard's HTTP API with Starlette's TestClient: runs, a growing run, corrupt folders, files,
path traversal, read-only and the token."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dashboard_testkit import FINISHED_STEPS, GrowingRun, copy_run, raw_get, serve
from PIL import Image

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from dreamstep.dashboard.app import create_app  # noqa: E402
from dreamstep.dashboard.paths import UnsafePath, resolve_inside  # noqa: E402


def client(*folders: Path, **kwargs) -> TestClient:
    return TestClient(create_app(list(folders), **kwargs))


def _runs(c: TestClient) -> dict[str, dict]:
    response = c.get("/api/runs")
    assert response.status_code == 200
    return {r["name"]: r for r in response.json()["runs"]}


def test_finished_run_is_listed_with_status_steps_and_last_loss(finished_run):
    run = _runs(client(finished_run.parent))["robot"]
    log_steps = [line for line in (finished_run / "train.log").read_text().splitlines()
                 if line.split(" ")[2:3] == ["step"]]
    last_loss = float(log_steps[-1].split("loss=")[1].split()[0])
    assert run["state"] == "finished"
    assert (run["step"], run["total"]) == (FINISHED_STEPS, FINISHED_STEPS)
    assert run["last_loss"] == pytest.approx(last_loss)
    assert run["seconds_per_step"] > 0 and run["eta_s"] is None and run["errors"] == []


def test_run_page_data_curves_samples_config_loras_log(finished_run):
    c = client(finished_run.parent)
    detail = c.get("/api/runs/0.robot").json()
    loss = detail["curves"]["loss"]
    assert loss["steps"] == list(range(1, FINISHED_STEPS + 1)) and len(loss["smoothed"]) == FINISHED_STEPS
    assert detail["curves"]["lr"]["values"][-1] > 0
    samples = detail["samples"]
    assert [(s["kind"], s["step"]) for s in samples] == [("validation", 2), ("final", 4), ("validation", 4)]
    assert {s["prompt"] for s in samples} == {"sks robot on the beach"} and {s["seed"] for s in samples} == {3}
    assert detail["config"] == (finished_run / "config.toml").read_text()
    assert detail["log"][-1].strip().startswith("TensorBoard logs") or "finished" in "\n".join(detail["log"])
    assert [f["name"] for f in detail["lora_files"]] == ["pytorch_lora_weights.safetensors"]
    loras = c.get("/api/runs/0.robot/loras").json()["loras"]
    assert "diffusers/PEFT layout" in loras[0]["info"] and "rank 4" in loras[0]["info"]
    image = c.get(f"/files/0.robot/{samples[0]['path']}")
    assert image.status_code == 200 and image.content[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_folder_growing_while_the_server_runs_shows_the_new_steps(growing_run: GrowingRun):
    c = client(growing_run.folder.parent)
    growing_run.add_steps(3)
    first = _runs(c)["live"]
    assert (first["state"], first["step"], first["total"]) == ("running", 3, 100)
    growing_run.add_steps(5)
    growing_run.add_sample()
    second = _runs(c)["live"]
    assert second["step"] == 8 and second["last_loss"] == pytest.approx(1 / 8)
    assert second["eta_s"] == pytest.approx(92 * second["seconds_per_step"])
    detail = c.get("/api/runs/0.live").json()
    assert detail["curves"]["loss"]["steps"] == list(range(1, 9))
    assert [(s["step"], s["prompt"], s["seed"]) for s in detail["samples"]] == [(8, "a growing robot", 7)]
    # A partly written last line is left for the next refresh, not misread.
    with open(growing_run.folder / "train.log", "a") as log:
        log.write("2026-11-23 10:00:00.000 step 9 loss=0.1")
    assert _runs(c)["live"]["step"] == 8
    with open(growing_run.folder / "train.log", "a") as log:
        log.write("11 lr=0.0001\n")
    assert _runs(c)["live"]["last_loss"] == pytest.approx(0.111)


def test_damaged_values_in_a_runs_files_are_named_with_file_and_key_not_shown(tmp_path):
    run = tmp_path / "runs" / "edited"
    run.mkdir(parents=True)
    (run / "run_status.json").write_text('{"state": 5, "step": "abc", "total": 1e999}')
    (run / "config.toml").write_text('max_train_steps = "ten"\n')
    response = client(tmp_path / "runs").get("/api/runs")
    assert response.status_code == 200  # Infinity would not even be JSON
    summary = _runs(client(tmp_path / "runs"))["edited"]
    assert summary["step"] is None and summary["total"] is None and summary["state"] in ("running", "interrupted")
    errors = "\n".join(summary["errors"])
    for key, shown in (("state", "5"), ("step", '"abc"'), ("total", "Infinity")):
        assert f"run_status.json: '{key}' is {shown}, not" in errors
    assert "config.toml: 'max_train_steps' is \"ten\", not a whole number from 1" in errors


def test_a_corrupt_or_half_written_run_shows_its_errors_and_the_other_runs_still_show(finished_run, tmp_path):
    root = tmp_path / "runs"
    copy_run(finished_run, root)
    broken = root / "broken"
    (broken / "samples").mkdir(parents=True)
    (broken / "config.toml").write_text("max_train_steps = [oops\n")
    (broken / "train.log").write_bytes(b"\xff\xfe garbage\n2026-11-23 10:00:00.000 step 2 loss=nan\nstep x\n")
    (broken / "samples" / "validation-000002.png").write_bytes(b"\x89PNG\r\n\x1a\n half")
    (broken / "run_status.json").write_text("{not json")
    (broken / "metrics.csv").write_text("loss,step\n1,2\n")
    (broken / "pytorch_lora_weights.safetensors").write_bytes(b"\x00" * 20)
    c = client(root)
    runs = _runs(c)
    assert runs["robot"]["state"] == "finished" and runs["robot"]["errors"] == []
    errors = " ".join(runs["broken"]["errors"])
    assert "config.toml" in errors and "run_status.json" in errors
    detail = c.get("/api/runs/0.broken")
    assert detail.status_code == 200
    body = detail.json()
    assert body["samples"][0]["error"].startswith("unreadable image")
    assert "step" in body["metrics"]["error"]
    loras = c.get("/api/runs/0.broken/loras").json()["loras"]
    assert loras[0].get("error")
    assert c.get("/files/0.broken/samples/validation-000002.png").status_code == 200  # served as it is


# Each case: (description, request target after /files/0.robot/). They are sent byte for byte to a real
# uvicorn server (an HTTP client library would normalise some of them away); every one must be refused,
# and the secret files beside and above the run folder never come back.
TRAVERSAL_CASES = [
    ("dot-dot", "../secret.txt"),
    ("dot-dot twice", "samples/../../secret.txt"),
    ("dot-dot to the parent of all folders", "../../secret.txt"),
    ("encoded dot-dot", "%2e%2e/secret.txt"),
    ("encoded dot-dot, upper case", "%2E%2E/secret.txt"),
    ("encoded slash", "..%2fsecret.txt"),
    ("encoded slash, upper case", "..%2Fsecret.txt"),
    ("encoded backslash", "..%5csecret.txt"),
    ("double-encoded dot-dot", "%252e%252e/secret.txt"),
    ("double-encoded slash", "..%252fsecret.txt"),
    ("overlong UTF-8 dot", "%c0%ae%c0%ae/secret.txt"),
    ("backslash", "..\\secret.txt"),
    ("absolute path", "/etc/passwd"),
    ("encoded absolute path", "%2fetc%2fpasswd"),
    ("windows drive", "C:/Windows/win.ini"),
    ("NUL byte", "config.toml%00.png"),
    ("symlink to a file outside", "link-to-secret.txt"),
    ("symlink to a folder outside", "outside-dir/secret.txt"),
    ("hidden file", ".hidden"),
    ("empty segment", "samples//final-000004.png"),
    ("current-dir segment", "./config.toml"),
    ("a folder, not a file", "samples"),
    ("missing file", "nope.png"),
]


@pytest.fixture(scope="module")
def traversal_root(finished_run, tmp_path_factory) -> Path:
    top = tmp_path_factory.mktemp("traversal")
    root = top / "served"
    run = copy_run(finished_run, root)
    (root / "secret.txt").write_text("SECRET")
    (top / "secret.txt").write_text("SECRET")
    (run / "link-to-secret.txt").symlink_to(root / "secret.txt")
    (run / "outside-dir").symlink_to(top, target_is_directory=True)
    (run / ".hidden").write_text("SECRET")
    return root


@pytest.fixture(scope="module")
def live_server(traversal_root):
    with serve(create_app([traversal_root])) as url:
        yield url


def test_the_live_server_serves_a_file_inside(live_server, traversal_root):
    status, body = raw_get(live_server, "/files/0.robot/config.toml")
    assert status == 200 and body == (traversal_root / "robot" / "config.toml").read_bytes()


@pytest.mark.parametrize("case, path", TRAVERSAL_CASES, ids=[c for c, _ in TRAVERSAL_CASES])
def test_path_traversal_is_refused(live_server, case, path):
    status, body = raw_get(live_server, f"/files/0.robot/{path}")
    assert status in (400, 404), case
    assert b"SECRET" not in body and b"root:" not in body


def test_the_resolver_refuses_what_the_url_layer_might_let_through(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "served")
    (tmp_path / "served" / "secret.txt").write_text("SECRET")
    (run / "link-to-secret.txt").symlink_to(tmp_path / "served" / "secret.txt")
    (run / "outside-dir").symlink_to(tmp_path, target_is_directory=True)
    (run / "samples" / "link-inside.png").symlink_to(run / "samples" / "final-000004.png")
    assert resolve_inside(run, "samples/link-inside.png") == (run / "samples" / "final-000004.png").resolve()
    for path in ["../secret.txt", "/etc/passwd", "a/../../secret.txt", "x\\..\\secret.txt", "%2e%2e/x",
                 "link-to-secret.txt", "outside-dir/secret.txt", "config.toml\x00", ""]:
        with pytest.raises(UnsafePath):
            resolve_inside(run, path)


def test_run_ids_are_looked_up_never_joined_into_paths(live_server):
    for run_id in ["..", "0.%2e%2e", "0.robot%2f..", "0.robot/..", "1", "0.secret.txt", "%2e%2e"]:
        for target in [f"/files/{run_id}/secret.txt", f"/api/runs/{run_id}"]:
            status, body = raw_get(live_server, target)
            assert status in (400, 404) and b"SECRET" not in body, target
    for target in ["/static/../../../secret.txt", "/static/%2e%2e/%2e%2e/secret.txt", "/static/..%2f..%2fsecret.txt",
                   "/static//etc/passwd", "/api/dataset/image/..%2f..%2fsecret.txt"]:
        status, body = raw_get(live_server, target)
        assert status in (400, 404) and b"SECRET" not in body and b"root:" not in body, target


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_read_only_every_write_method_is_refused(finished_run, method):
    c = client(finished_run.parent)
    for url in ["/", "/api/runs", "/api/runs/0.robot", "/files/0.robot/config.toml", "/static/app.js"]:
        assert c.request(method, url).status_code == 405
    assert (finished_run / "config.toml").is_file()


def test_token_guards_every_request(finished_run):
    c = client(finished_run.parent, token="s3cret")
    for url in ["/", "/api/runs", "/static/app.js", "/files/0.robot/config.toml"]:
        assert c.get(url).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    page = c.get("/?token=s3cret")
    assert page.status_code == 200 and "dreamstep_token" in page.headers["set-cookie"]
    assert c.get("/files/0.robot/config.toml").status_code == 200  # the cookie now carries the token


def test_page_assets_are_served_from_the_package_with_no_outside_source(finished_run):
    c = client(finished_run.parent)
    page = c.get("/")
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name in ["app.js", "chart.js", "style.css"]:
        text = c.get(f"/static/{name}").text
        assert "http://" not in text and "https://" not in text and "//cdn" not in text


def test_status_file_is_used_when_present_and_a_dead_process_means_interrupted(growing_run: GrowingRun):
    growing_run.add_steps(2)
    status = growing_run.folder / "run_status.json"
    c = client(growing_run.folder.parent)
    status.write_text(json.dumps({"state": "failed", "step": 2, "total": 100, "pid": os.getpid()}))
    assert _runs(c)["live"]["state"] == "failed"
    dead = max(os.getpid() + 100000, 4_000_000)
    status.write_text(json.dumps({"state": "running", "step": 2, "total": 100, "pid": dead}))
    run = _runs(c)["live"]
    assert run["state"] == "interrupted" and str(dead) in run["state_detail"]
    status.write_text(json.dumps({"state": "running", "step": 2, "total": 100, "pid": os.getpid()}))
    assert _runs(c)["live"]["state"] == "running"


@pytest.mark.parametrize("pid", ["abc", 10**30, -5, 0, True, 3.5, [1]])
def test_a_status_file_with_a_pid_no_process_can_have_is_still_served(pid, growing_run: GrowingRun):
    growing_run.add_steps(2)
    (growing_run.folder / "run_status.json").write_text(json.dumps({"state": "failed", "step": 2, "pid": pid}))
    c = client(growing_run.folder.parent)
    assert _runs(c)["live"]["state"] == "failed"
    assert c.get(f"/api/runs/{_runs(c)['live']['id']}").status_code == 200


def test_a_run_that_stopped_without_finishing_is_interrupted(growing_run: GrowingRun):
    growing_run.add_steps(2)
    old = growing_run.folder / "train.log"
    os.utime(old, (1_000_000, 1_000_000))
    run = _runs(client(growing_run.folder.parent))["live"]
    assert run["state"] == "interrupted" and run["eta_s"] is None


def test_evaluation_scores_show_while_training_and_from_metrics_csv_at_the_end(growing_run: GrowingRun):
    growing_run.add_steps(2)
    growing_run.logger.log_metrics(2, {"val_loss": 0.5, "clip_t": 0.21})  # the trainer's own call
    growing_run.add_steps(2)
    growing_run.logger.log_metrics(4, {"val_loss": 0.4})
    c = client(growing_run.folder.parent)
    live = c.get("/api/runs/0.live").json()["metrics"]
    assert live == {"steps": [2, 4], "metrics": {"clip_t": [0.21, None], "val_loss": [0.5, 0.4]}, "png": False,
                    "source": "train.log"}
    growing_run.logger.write_metrics()  # what the trainer writes at the end of the run
    (growing_run.folder / "metrics.csv").write_text(
        (growing_run.folder / "metrics.csv").read_text() + "6,0.3")  # and a half-written row
    final = c.get("/api/runs/0.live").json()["metrics"]
    assert final["source"] == "metrics.csv" and final["png"] is True and final["steps"] == [2.0, 4.0]
    assert final["metrics"] == {"val_loss": [0.5, 0.4], "clip_t": [0.21, None]}


def test_new_runs_appear_and_a_folder_that_is_itself_a_run_is_shown(finished_run, tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    c = client(root, finished_run)
    assert set(_runs(c)) == {"robot"}
    GrowingRun(root / "later").add_steps(1)
    assert set(_runs(c)) == {"robot", "later"}


def test_a_run_with_a_thousand_samples_sends_the_latest_and_the_rest_on_request(growing_run: GrowingRun):
    from PIL import Image

    growing_run.add_steps(2)
    samples = growing_run.folder / "samples"
    samples.mkdir()
    tiny = Image.new("RGB", (4, 4))
    for step in range(1, 1001):
        tiny.save(samples / f"validation-{step:06d}.png")
    c = client(growing_run.folder.parent)
    detail = c.get("/api/runs/0.live").json()
    assert detail["samples_total"] == 1000
    assert [s["step"] for s in detail["samples"]] == list(range(953, 1001))
    every = c.get("/api/runs/0.live/samples").json()["samples"]
    assert [s["step"] for s in every] == list(range(1, 1001))


def test_adapter_panel_reports_a_lokr_run(finished_run, tiny_flux_dev_dir: Path, tmp_path: Path):
    """A flux-lora --lora_type lokr run's file, as the adapter panel reports it: algorithm, factor, parameters."""
    from diffusers import FluxPipeline

    from dreamstep.config.lycoris import LycorisOptions
    from dreamstep.lora.lycoris_network import create_flux_network
    from dreamstep.models.flux.lora_targets import flux_lora_targets

    run = copy_run(finished_run, tmp_path)
    transformer = FluxPipeline.from_pretrained(tiny_flux_dev_dir).transformer
    network = create_flux_network(transformer, flux_lora_targets(transformer, ["attention"]), None, (),
                                  LycorisOptions("lokr", dim=2, alpha=1.0, factor=4))
    network.save_weights(run / "pytorch_lora_weights.safetensors", None, {"lycoris_algo": "lokr"})
    loras = client(run.parent).get(f"/api/runs/0.{run.name}/loras").json()["loras"]
    info = loras[0]["info"]
    assert "LyCORIS layout (LoKr" in info and "LoKr (factor 4, rank 2)" in info
    assert f"params:    {sum(p.numel() for p in network.parameters()):,}" in info


def test_a_controlnet_runs_weights_are_named_as_a_controlnet_not_read_as_a_lora(tmp_path, tiny_flux_dev_dir):
    from diffusers import FluxTransformer2DModel

    from dreamstep.models.flux.controlnet import build_from_transformer, save

    run = tmp_path / "runs" / "control"
    transformer = FluxTransformer2DModel.from_pretrained(tiny_flux_dev_dir, subfolder="transformer")
    save(build_from_transformer(transformer, 1, 0), run)
    (run / "config.toml").write_text("max_train_steps = 2\n")
    loras = client(run.parent).get("/api/runs/0.control/loras").json()["loras"]
    assert [f["name"] for f in loras] == ["diffusion_pytorch_model.safetensors"]
    assert "error" not in loras[0] and "FluxControlNetModel weights" in loras[0]["info"]
    assert "not a LoRA file" in loras[0]["info"]


def test_samples_of_a_run_with_a_list_of_validation_prompts_are_captioned_with_them(tmp_path):
    from dreamstep.engine.logging import TrainingLogger

    run = tmp_path / "runs" / "control"
    run.mkdir(parents=True)
    (run / "config.toml").write_text('validation_prompt = ["a red cube", "a blue cube"]\nseed = 5\n')
    TrainingLogger(run, report_to="none").log_images(2, [Image.new("RGB", (16, 16)), Image.new("RGB", (16, 16))])
    samples = client(run.parent).get("/api/runs/0.control").json()["samples"]
    assert [(s["step"], s["prompt"], s["seed"]) for s in samples] == [(2, "a red cube | a blue cube", 5)]


def test_a_lora_of_a_tiny_base_named_by_a_relative_path_fits_that_base(finished_run, tiny_flux_dev_dir, tmp_path,
                                                                      monkeypatch):
    """The run was started in another folder, with the base and the output given relative to it (as the demo's
    TOML does): the adapter panel checks the LoRA against that base, not the released FLUX.1-dev."""
    project = tmp_path / "project"
    run = copy_run(finished_run, project / "out")
    (project / "models").mkdir()
    (project / "models" / "tiny-flux").symlink_to(tiny_flux_dev_dir, target_is_directory=True)
    config = (run / "config.toml").read_text().splitlines()
    (run / "config.toml").write_text("\n".join(
        'pretrained_model_name_or_path = "models/tiny-flux"' if line.startswith("pretrained_model_name_or_path")
        else f'output_dir = "out/{run.name}"' if line.startswith("output_dir") else line for line in config) + "\n")
    monkeypatch.chdir(tmp_path)  # the dashboard is started elsewhere
    info = client(run.parent).get(f"/api/runs/0.{run.name}/loras").json()["loras"][0]["info"]
    fits = next(line for line in info.splitlines() if line.startswith("fits:"))
    assert fits.startswith("fits:      yes") and fits.endswith(f"of {project}/models/tiny-flux"), fits
    (run / "config.toml").write_text('pretrained_model_name_or_path = "black-forest-labs/FLUX.1-dev"\n')
    info = client(run.parent).get(f"/api/runs/0.{run.name}/loras").json()["loras"][0]["info"]
    assert "fits:      NO" in info and "FLUX.1-dev" in info  # a hub id: the released model's shapes
