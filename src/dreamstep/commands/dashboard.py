"""``dreamstep dashboard [RUN_DIR ...] [--dataset TOML_OR_FOLDER --trainer T --config TOML]``: a local web
page over run folders (live loss and LR, sample grids, metrics, config, LoRA files, log tail, run comparison)
and a dataset check before training, made by the chosen trainer's data code with its settings. Read-only
unless --allow_training: then it also queues, runs, stops and resumes training jobs, each its own
``dreamstep train`` process writing into a run folder under the first RUN_DIR given (or another RUN_DIR).
Listens on 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from dreamstep.errors import UserError

DEFAULT_PORT = 7860


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    parser.add_argument("run_dirs", nargs="*", metavar="RUN_DIR",
                        help="a run's --output_dir, or a folder whose subfolders are runs (e.g. demo_out)")
    parser.add_argument("--dataset", metavar="TOML_OR_FOLDER",
                        help="check a Kohya dataset TOML or an image folder as --trainer will read it (with "
                             "--config: that run's settings); --config alone checks the data the TOML names")
    from dreamstep.cli import COMMANDS

    parser.add_argument("--trainer", default="flux-lora", choices=[key[1] for key in COMMANDS if key[0] == "train"],
                        help="for --dataset: the trainer whose data code and defaults the check uses (default "
                             "flux-lora: a folder is --instance_data_dir; sdxl-lora and flux-controlnet read a "
                             "folder as --train_data_dir)")
    parser.add_argument("--config", metavar="TOML",
                        help="for --dataset: the trainer's own options, e.g. a run's config.toml or the file "
                             "you pass to 'dreamstep train TRAINER --config' (resolution, captions, crops, ...)")
    parser.add_argument("--resolution", help="for --dataset: the trainer's --resolution (default: --config's, "
                                             "else the trainer's)")
    parser.add_argument("--seed", type=int, help="for --dataset: the training seed (caption shuffles)")
    parser.add_argument("--instance_prompt",
                        help="for --dataset FOLDER: the caption of images without a caption file (flux-lora, "
                             "flux-kontext-lora)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--token", nargs="?", const="random",
                        help="require this token on every request; --token alone makes a random one")
    parser.add_argument("--allow_training", action="store_true",
                        help="let the page and the API start, stop and resume training jobs (queued in "
                             "RUN_DIR/.dreamstep-jobs; new runs are made inside the RUN_DIRs)")
    parser.add_argument("--data_root", action="append", default=[], metavar="FOLDER",
                        help="with --allow_training: a folder whose datasets and models jobs may read "
                             "(repeatable); a job's paths must lie inside a RUN_DIR or a --data_root")
    parser.add_argument("--edit_captions", action="store_true",
                        help="with --dataset: let the page edit caption files and caption the images without "
                             "one (a 'dreamstep caption' process; its --model folder inside a RUN_DIR or "
                             "--data_root)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_port(host: str, port: int) -> None:
    """Refuse a port another server listens on, as uvicorn's own bind would. Like uvicorn's socket the probe
    reuses the address (POSIX), so the connections a stopped dashboard left in TIME_WAIT do not refuse a restart."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if os.name == "posix":  # on Windows SO_REUSEADDR would let the probe share a port in use
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); "
                            "pick another --port") from None


def _check_training_flags(args: argparse.Namespace) -> None:
    if args.edit_captions and not args.dataset:
        raise UserError("--edit_captions edits the captions of --dataset; give --dataset TOML_OR_FOLDER")
    if not args.allow_training:
        if args.data_root and not args.edit_captions:
            raise UserError("--data_root is for --allow_training; add it, or remove --data_root")
        return
    if not args.run_dirs:
        raise UserError("--allow_training needs a RUN_DIR: the folder new runs are made in")
    for folder in args.data_root:
        if not Path(folder).is_dir():
            raise UserError(f"--data_root {folder}: no such folder")


def _training(args: argparse.Namespace, token: str | None) -> Any:
    """The job queue of --allow_training (None without it)."""
    if not args.allow_training:
        return None
    from dreamstep.dashboard.job_routes import Training

    return Training([Path(d).resolve() for d in args.run_dirs], [Path(d).resolve() for d in args.data_root],
                    Path(args.run_dirs[0]).resolve() / ".dreamstep-jobs", token or secrets.token_urlsafe(16))


def _captions(args: argparse.Namespace, token: str | None) -> Any:
    """Caption editing of --edit_captions (None without it), with the token changes need."""
    if not args.edit_captions:
        return None
    from dreamstep.dashboard.caption_routes import CaptionEditing

    roots = [Path(d).resolve() for d in (*args.run_dirs, *args.data_root)]
    return CaptionEditing(token or secrets.token_urlsafe(16), roots)


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    if not args.run_dirs and not args.dataset and not args.config:
        raise UserError("give at least one RUN_DIR or --dataset TOML_OR_FOLDER; see 'dreamstep dashboard --help'")
    for folder in args.run_dirs:
        if not Path(folder).is_dir():
            raise UserError(f"RUN_DIR {folder}: no such folder; give a run's --output_dir or a folder of runs")
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port}: must be between 1 and 65535")
    if args.token is not None and not args.token.strip():
        raise UserError("--token is empty, which would let anyone in; give a token, or --token alone for a random one")
    _check_training_flags(args)
    try:
        import uvicorn

        from dreamstep.dashboard.app import create_app
        from dreamstep.dashboard.runs import discover_runs
    except ImportError as e:
        raise UserError(f"the dashboard needs the 'ui' extra ({e.name} is missing): "
                        "pip install 'dreamstep[ui]'") from None
    check, recheck = None, None
    if args.dataset or args.config:
        import functools

        from dreamstep.dashboard.dataset_check import check_dataset

        recheck = functools.partial(check_dataset, args.dataset, args.resolution, args.seed, args.instance_prompt,
                                    trainer=args.trainer, config_toml=args.config)
        print(f"checking {args.dataset or args.config} as 'dreamstep train {args.trainer}' reads it ...", flush=True)
        check = recheck()
        print(f"  {len(check.images)} images, {len(check.problems)} problems")
    for folder in args.run_dirs:
        if not discover_runs([Path(folder)]):
            print(f"note: RUN_DIR {folder} holds no run yet (a run folder has a config.toml, train.log, "
                  "run_status.json or TensorBoard files); runs started in it will appear", file=sys.stderr)
    token = secrets.token_urlsafe(16) if args.token == "random" else args.token
    training = _training(args, token)
    captions = _captions(args, training.token if training is not None else token)
    changes = training or captions
    if changes is not None and not is_loopback(args.host):
        token = changes.token  # bound beyond loopback, every request needs it; on loopback only changes do
    if not is_loopback(args.host):
        print(f"warning: --host {args.host} lets other machines open the dashboard and read every file in "
              f"{', '.join(args.run_dirs) or 'the dataset'}" + ("" if token else "; add --token to require a token"),
              file=sys.stderr)
    _check_port(args.host, args.port)
    app = create_app([Path(d) for d in args.run_dirs], dataset=check.source if check else None, dataset_check=check,
                     recheck=recheck, token=token, training=training,
                     local_hosts=changes is not None and is_loopback(args.host), captions=captions)
    token = changes.token if changes is not None else token
    shown_host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown_host}:{args.port}/" + (f"?token={token}" if token else "")
    # The LoRA reports (and the new-run page's memory plans) need torch, diffusers and peft; importing them takes
    # seconds, so start now, not on the first page that shows a LoRA file or a plan.
    from dreamstep.dashboard.heavy import import_heavy

    modules = ("dreamstep.lora.info",) + (("dreamstep.models.plans",) if training is not None else ())
    threading.Thread(target=lambda: [import_heavy(m) for m in modules], daemon=True).start()
    mode = "training allowed" if training is not None else "caption editing" if captions else "read-only"
    print(f"dashboard: {url}  ({mode}; Ctrl-C stops it, not its jobs)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
