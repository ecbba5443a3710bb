"""Experiment tracking: always a local `metrics.jsonl` + `summary.json` in the run dir, and W&B when enabled.

W&B runs `offline` when no API key is configured (sync later with `wandb sync <run_dir>/wandb/offline-run-*`),
`disabled` on request. Only rank 0 tracks.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.fileio import write_json_atomic
from mtp_train.recipe import recipe_to_dict

log = logging.getLogger(__name__)


def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class Tracker:
    def __init__(self, run_dir: Path, recipe, enabled: bool, resume: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self.metrics_path = run_dir / "metrics.jsonl"
        self.wandb_run = None
        self.start = time.time()
        if not enabled:
            return
        wandb_cfg = recipe.tracking.wandb
        mode = wandb_cfg.mode
        if mode == "online" and not _wandb_has_key() and os.environ.get("WANDB_MODE") != "online":
            log.warning("W&B: no API key found; logging offline (sync later with `wandb sync %s/wandb`)", run_dir)
            mode = "offline"
        if mode != "disabled":
            import wandb  # local: wandb is slow to import and only needed when tracking is on

            run_id_file = run_dir / "wandb_run_id"
            run_id = run_id_file.read_text().strip() if resume and run_id_file.is_file() else None
            self.wandb_run = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.run_name or recipe.name,
                group=wandb_cfg.group,
                tags=list(wandb_cfg.tags),
                config=recipe_to_dict(recipe),
                dir=str(run_dir),
                mode=mode,
                id=run_id,
                resume="allow" if run_id else None,
            )
            run_id_file.write_text(self.wandb_run.id)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time() - self.start, 3), **metrics}
        with self.metrics_path.open("a") as stream:
            stream.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def log_files(self, paths: list[Path], step: int | None = None) -> None:
        """Log PNG plots (and nothing else) to W&B as images."""
        if not self.enabled or self.wandb_run is None:
            return
        import wandb  # local: wandb is slow to import and only needed when tracking is on

        self.wandb_run.log({p.stem: wandb.Image(str(p)) for p in paths if p.suffix == ".png"}, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return

        write_json_atomic(self.run_dir / "summary.json", summary)
        if self.wandb_run is not None:
            for key, value in summary.items():
                if isinstance(value, (int, float, str)):
                    self.wandb_run.summary[key] = value
            self.wandb_run.finish()


def read_metric_rows(metrics_path: Path) -> list[dict[str, Any]]:
    """The rows of a run's `metrics.jsonl` ([] without the file). A torn last line (a kill while it was appended) is
    dropped with a warning; any other line that is not a JSON object with a `step` is a UserError naming the file and
    line."""
    if not metrics_path.is_file():
        return []
    lines = metrics_path.read_bytes().split(b"\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a JSON object with an integer step")
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if all(not rest.strip() for rest in lines[number:]):
                log.warning("%s:%d: dropping a torn last line (%s; the run was killed while writing it)",
                            metrics_path, number, type(err).__name__)
                break
            raise UserError(f"{metrics_path}:{number}: not a metrics row ({err}); the file was edited or damaged: "
                            "remove that line") from None
        rows.append(row)
    return rows


def truncate_metrics(metrics_path: Path, after_step: int) -> None:
    """On resume, drop metric rows logged after the checkpoint (they will be logged again), and a torn last line."""
    if not metrics_path.is_file():
        return
    kept = [row for row in read_metric_rows(metrics_path) if row["step"] <= after_step]
    metrics_path.write_text("".join(json.dumps(row) + "\n" for row in kept))
