"""Runs started from the page: each one a Ray job running ``rayfactory train <config>``.

A Ray job lives in the cluster, not in this server: closing the browser leaves it running. With no
job address the UI starts a Ray head of its own on this machine (``cluster/local_head.py``,
dashboard on 127.0.0.1, Ray's token auth with a token of its own, recorded in the share dir) and
the job runs from the folder the UI was started in, so relative paths in the config (dataset_dir,
output_dir) mean what they mean to ``rayfactory train`` run there. Stopping the UI stops that head
and the runs on it (``shutdown``: their checkpoints stay, Resume continues them). With an address
the checkout is uploaded as the job's working dir, as ``rayfactory submit`` does, and the cluster
and its runs go on when the UI stops.

Progress and the charts come from the run's own ``trainer_log.jsonl`` (``charts``: the series the
page draws, picked here so the browser only draws them), the console from Ray's job logs.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from registries.errors import UserError

from ..local_head import Head, session_processes, start_head, stop_head
from ..submit import REPO_ROOT, config_argument, runtime_env
from .form import write_yaml
from .paths import check_config

HEAD_FILE = "ray-head.json"
HEAD_GONE = ("(this run's Ray head is gone: the web UI stops its head, and the runs on it, when it stops. "
             "Its checkpoints are in output_dir; Resume continues from the latest.)\n")
LOG_TAIL_CHARS = 6000
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")
# The run page's charts: (id, title, the trainer_log keys it draws). A chart's series are the keys the
# log holds; a chart without any is not drawn (except loss, which says it waits for the first one).
# RL runs log reward (eval_reward when they evaluate) and, multi-turn ones, the mean policy turns
# and tool calls per trajectory (stages/rl/agents/multi_turn.py's rollout_stats).
CHARTS = (
    ("loss", "loss", ("loss", "eval_loss", "value_loss")),
    ("metric", "accuracy and reward", ("rewards/accuracies", "eval_rewards/accuracies", "reward", "eval_reward")),
    ("turns", "per trajectory", ("rollout/turns", "rollout/tool_calls")),
    ("tasks", "eval_tasks (lm-evaluation-harness)", ()),  # its keys are read off the log: task_keys
)
TASK_PREFIX = "eval_tasks/"  # stages/inference/harness_eval.py's keys
UNBOUNDED = ("perplexity", "bits_per_byte")  # not on the 0..1 scale of the task chart's other scores


def task_keys(records: list[dict[str, Any]]) -> tuple[str, ...]:
    """The eval_tasks scores the log holds (accuracies and the like; perplexities would flatten them)."""
    keys = dict.fromkeys(key for r in records for key in r if key.startswith(TASK_PREFIX))
    return tuple(key for key in keys if not key.endswith(UNBOUNDED))


def read_records(output_dir: str) -> list[dict[str, Any]]:
    """The run's trainer_log.jsonl records; a line being written (or otherwise not a JSON object) is
    skipped, not an error: the page polls while the run writes."""
    from stages.training.callbacks import LOG_FILE  # every stage's log, one JSON line per logged step

    records = []
    try:
        with open(os.path.join(output_dir, LOG_FILE), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
    except OSError:  # no log yet
        pass
    return records


def _value(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def charts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The series to draw: per chart of CHARTS, one {key, points: [[step, value], ...]} for each of its
    keys that some record holds as a finite number (with its step, ``current_steps``)."""
    out = []
    for chart_id, title, keys in CHARTS:
        keys = keys or task_keys(records)
        series = []
        for key in keys:
            points = [[step, value] for r in records
                      if (step := _value(r, "current_steps")) is not None and (value := _value(r, key)) is not None]
            if points:
                series.append({"key": key, "points": points})
        out.append({"id": chart_id, "title": title, "series": series})
    return out


def _holds_temp_dir(head: Head) -> bool:
    """Some process of the head's session names its temp dir: the session is that head's, not a
    later one that got the same id."""
    import psutil

    for proc in session_processes(head):
        try:
            if any(head.temp_dir in arg for arg in proc.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


@dataclass
class Run:
    job_id: str
    address: str
    config_path: str
    output_dir: str  # absolute, as seen from this machine
    started: float


class Runs:
    def __init__(self, share_dir: str, job_address: str | None = None, cwd: str | None = None):
        self.share_dir = os.path.abspath(share_dir)
        self.job_address = job_address
        self.cwd = os.path.abspath(cwd or os.getcwd())
        self._clients: dict[str, Any] = {}
        os.makedirs(os.path.join(self.share_dir, "runs"), exist_ok=True)
        os.makedirs(os.path.join(self.share_dir, "configs"), exist_ok=True)

    @property
    def roots(self) -> tuple[str, str]:
        """The folders a request's paths may name (cluster/webui/paths.py)."""
        return self.cwd, self.share_dir

    # --- the cluster --------------------------------------------------------------------

    def address(self) -> str:
        """The job server: the configured one, else this machine's head (started on first use)."""
        return self.job_address or self._head().dashboard_url

    def _head(self) -> Head:
        path = os.path.join(self.share_dir, HEAD_FILE)
        head = Head.load(path)
        if head is None or not head.token:  # a head of an older UI, without a token: never reused
            token = secrets.token_hex(32)
            head = start_head(self._head_env(token), num_cpus=max(4, os.cpu_count() or 1), token=token)
            head.save(path)  # readable by this user only: it holds the token
        return head

    def _head_env(self, token: str) -> dict[str, str]:
        # Ray's token auth, with a token of this head's own: its GCS and raylet listen on every
        # interface whatever the node's address, so only the token keeps others from running code
        # there. RAY_* settings of this shell (an address, a token mode) are about other clusters.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        return env

    def _client(self, address: str | None = None):
        """One client per job server: making one asks the server for its version, and the page
        polls a run every 2 s. This UI's own head wants its token on every request."""
        from ray.job_submission import JobSubmissionClient

        address = address or self.address()
        if address not in self._clients:
            head = None if self.job_address else Head.load(os.path.join(self.share_dir, HEAD_FILE))
            mine = head is not None and head.dashboard_url == address and head.token
            headers = {"Authorization": f"Bearer {head.token}"} if mine else None
            self._clients[address] = JobSubmissionClient(address, headers=headers)
        return self._clients[address]

    # --- runs -----------------------------------------------------------------------------

    def config_path(self, config: dict[str, Any]) -> str:
        """Where the Start button saves the config: one file per output_dir."""
        name = str(config.get("output_dir") or "run").strip("/").replace("/", "_") or "run"
        return os.path.join(self.share_dir, "configs", f"{name}.yaml")

    def start(self, config: dict[str, Any]) -> Run:
        check_config(config, self.roots)  # a resumed config too: its output_dir and data stay in the UI's folders
        path = self.config_path(config)
        write_yaml(path, config)
        address = self.address()
        job_id = f"rayfactory-webui-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"
        if self.job_address:  # a remote cluster: upload this checkout, as `rayfactory submit` does
            entrypoint = f"python -m cluster.cli train {shlex.quote(config_argument(path, REPO_ROOT))}"
            env = {**runtime_env(), "working_dir": REPO_ROOT}
        else:
            entrypoint = (f"cd {shlex.quote(self.cwd)} && {shlex.quote(sys.executable)} -m cluster.cli train "
                          f"{shlex.quote(path)}")
            env = {"env_vars": {"PYTHONPATH": REPO_ROOT}}
        self._client(address).submit_job(entrypoint=entrypoint, runtime_env=env, submission_id=job_id)
        output_dir = os.path.join(self.cwd, str(config.get("output_dir", "")))
        run = Run(job_id, address, path, os.path.abspath(output_dir), time.time())
        with open(self._record(job_id), "w", encoding="utf-8") as f:
            json.dump(asdict(run), f)
        return run

    def get(self, job_id: str) -> Run:
        try:
            with open(self._record(job_id), encoding="utf-8") as f:
                return Run(**json.load(f))
        except (OSError, ValueError, TypeError):
            raise UserError(f"no run {job_id!r} was started from this web UI (share dir {self.share_dir}).") from None

    def all(self) -> list[Run]:
        """Every run started from this share dir, the latest first."""
        folder = os.path.join(self.share_dir, "runs")
        found = [self.get(name[: -len(".json")]) for name in os.listdir(folder) if name.endswith(".json")]
        return sorted(found, key=lambda run: run.started, reverse=True)

    def status(self, job_id: str) -> dict[str, Any]:
        """The job's state, its progress, the series of its charts and the tail of its console. A run
        whose Ray head is gone (stopped with an earlier UI) reads as STOPPED: its log is still shown."""
        run = self.get(job_id)
        try:
            client = self._client(run.address)
            state = str(client.get_job_status(job_id).value)
            logs = client.get_job_logs(job_id)
        except Exception:  # noqa: BLE001 (Ray's client raises several kinds for a server that is not there)
            if not self._head_gone(run):
                raise
            state, logs = "STOPPED", HEAD_GONE
        records = read_records(run.output_dir)
        last = next((r for r in reversed(records) if _value(r, "current_steps") is not None), {})
        return {
            "job_id": job_id,
            "status": state,
            "ended": state in ENDED,
            "output_dir": run.output_dir,
            "step": last.get("current_steps", 0),
            "total": last.get("total_steps"),
            "remaining_s": last.get("remaining_time"),
            "charts": charts(records),
            "console": logs[-LOG_TAIL_CHARS:],
        }

    def stop(self, job_id: str) -> bool:
        run = self.get(job_id)
        try:
            return bool(self._client(run.address).stop_job(job_id))
        except Exception:  # noqa: BLE001 (as in status)
            if not self._head_gone(run):
                raise
            return False

    def _head_gone(self, run: Run) -> bool:
        """The run ran on a head of this UI's that is no longer there (a head's ports are new each time)."""
        if self.job_address:
            return False
        head = Head.load(os.path.join(self.share_dir, HEAD_FILE))
        return head is None or head.dashboard_url != run.address

    def shutdown(self) -> str:
        """Stop this UI's own Ray head, and so every run on it; what was done, as one line for the
        terminal. A cluster given with --address is never stopped."""
        if self.job_address:
            return (f"rayfactory webui: stopped; the runs on {self.job_address} go on (a cluster given with "
                    "--address is never stopped)")
        path = os.path.join(self.share_dir, HEAD_FILE)
        head = Head.read(path)
        if head is None or not (Head.load(path) or _holds_temp_dir(head)):  # none, or long gone (its pid reused?)
            return "rayfactory webui: stopped (no Ray head of its own was running)"
        processes = len(session_processes(head))
        stop_head(head)
        self._clients.clear()
        try:
            os.remove(path)
        except OSError:
            pass
        return (f"rayfactory webui: stopped, and its Ray head at {head.dashboard_url} ({processes} processes); "
                "runs started from the UI stopped with it (their checkpoints stay in output_dir: Resume continues them)")

    def resume(self, job_id: str, check: Callable[[dict[str, Any]], Any] = lambda config: None) -> Run:
        """The same config again, from the latest complete checkpoint in its output_dir; ``check``
        (the server's rules for a request's config) sees it first: the file may have changed."""
        from .form import parse_yaml

        run = self.get(job_id)
        with open(run.config_path, encoding="utf-8") as f:
            config = parse_yaml(f.read())
        config["resume_from_checkpoint"] = "auto"
        check(config)
        return self.start(config)

    def _record(self, job_id: str) -> str:
        if not job_id.replace("-", "").isalnum():
            raise UserError(f"{job_id!r} is not a job id this web UI makes.")
        return os.path.join(self.share_dir, "runs", f"{job_id}.json")
