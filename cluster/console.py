"""What ``rayfactory train`` shows on the terminal, and where the rest of a run's output goes.

The terminal gets the plan, the records our own packages log at INFO and above (they are
written for the user: data ready, bad rows skipped, a reused tokenized_path), one progress bar
fed by rank 0's Trainer logs, eval lines and a summary.

Everything else goes to ``<output_dir>/rayfactory.log``. While the run lasts, this process's
stdout and stderr (file descriptors 1 and 2) point at that file, so it receives Ray's and the
libraries' log records, the output of every Ray worker and actor (Ray forwards it to the
driver's stdout and stderr) and what no Python handler sees (Ray's C++ core, torch's c10
warnings). The console writes to copies of the terminal's descriptors. With ``verbose`` nothing
is redirected: the terminal shows everything, as plain Ray does, and the log file gets the
driver's log records only.

A Console that is never entered (``run_exp`` from Python) only prints the plan and the summary:
no progress bar, no log file, no redirection, logging left as the caller configured it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings

LOG_NAME = "rayfactory.log"
OWN_PACKAGES = ("cluster", "fabric", "stages", "registries")
# Eval metrics that describe the evaluation itself, not the model.
_EVAL_SPEED_KEYS = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


class Console:
    """The CLI enters it around ``run_exp``; the driver calls plan, progress and summary."""

    def __init__(self, output_dir: str | None = None, verbose: bool = True, started: float | None = None):
        self.output_dir = output_dir
        self.verbose = verbose
        self.log_path: str | None = None
        self._terminal = None  # our copy of the terminal while stdout points at the log
        self._bar = None
        self._metrics: dict = {}  # the latest value of each metric rank 0 logged
        self._started = time.time() if started is None else started  # where the start-up line's clock starts
        self._marks: list[tuple[str, float]] = []  # start-up phases: (what finished, when)
        self._notes_shown: set[str] = set()  # also our own log lines, which training in this process logs too
        self._in_driver = False  # the plan's answer: training runs in this process (fabric/train_in_driver.py)
        self._undo: list = []  # what __enter__ changed, restored last change first

    # ------------------------------------------------------------------ what the user reads
    def say(self, line: str) -> None:
        stream = self._terminal or sys.stdout
        if self._bar is not None:
            self._bar.write(line, file=stream)  # above the bar, which is redrawn below
        else:
            print(line, file=stream, flush=True)

    def plan(self, cfg, in_driver: bool = False) -> None:
        """What is about to run; printed before Ray starts. ``in_driver``: the training runs in this
        process (fabric/train_in_driver.py)."""
        model, tuning, data, ray_args = cfg.model, cfg.finetuning, cfg.data, cfg.ray
        method = tuning.finetuning_type + (f" (rank {tuning.lora_rank})" if tuning.finetuning_type == "lora" else "")
        if model.quantization_bit:
            method += f" on a {model.quantization_bit}-bit base"
        datasets = ", ".join(data.dataset or []) or (
            f"tokenized data in {data.tokenized_path}" if data.tokenized_path else "none (prediction only)")
        if data.eval_dataset:
            datasets += f"; eval: {', '.join(data.eval_dataset)}"
        address = ray_args.resolved_address()
        written = cfg.raw.get("template") if isinstance(cfg.raw, dict) else None
        template = data.template or "auto"
        if written in (None, "auto") and template != "auto":  # the driver resolved auto from the tokenizer
            template += " (template: auto)"
        self.say(f"rayfactory: stage {tuning.stage}, finetuning_type {method}, model {model.model_name_or_path}, "
                 f"template {template}")
        self.say(f"  data      {datasets} (cutoff_len {data.cutoff_len})")
        each = ", ".join(f"{name} {amount:g}" for name, amount in ray_args.resources_per_worker.items())
        self._in_driver = in_driver
        if in_driver:
            self.say("  workers   none: training runs in this process (a lone CPU worker; train_in_driver), "
                     "data on a local Ray")
        else:
            self.say(f"  workers   {ray_args.ray_num_workers}, each {each}, on "
                     + (f"the Ray cluster at {address}" if address else "a local Ray"))
        if tuning.spec.launch == "rl_controller":
            if cfg.rl.rollout_backend == "vllm":
                engines = ", ".join(f"{name} {amount:g}" for name, amount in ray_args.rollout_resources.items())
                colocated = ray_args.colocate_rollout or ray_args.colocate_all
                where = "on the policy workers' bundles" if colocated else f"each {engines}"
                self.say(f"  rollout   {ray_args.rollout_num_engines} vLLM engine(s), {where}")
            else:
                self.say("  rollout   transformers generate in the policy workers")
            scorers = ([f"reward model {tuning.reward_model} ({tuning.reward_model_type})"] if tuning.reward_model else [])
            scorers += cfg.rl.reward_funcs
            self.say(f"  rewards   {' + '.join(scorers)}; {cfg.rl.num_generations} samples per prompt, "
                     f"{cfg.rl.rollout_batch_size} prompts per step")
            if "critic" in tuning.spec.rl.roles(tuning, cfg.rl):
                from stages.rl.workers.critic import critic_source

                self.say(f"  critic    {ray_args.critic_num_workers} worker(s) from the {critic_source(cfg)} model, "
                         f"GAE (gamma {cfg.rl.gamma:g}, lam {cfg.rl.lam:g}), {cfg.rl.ppo_epochs} epochs x "
                         f"{cfg.rl.ppo_buffer_size} mini-batches a step")
        self.say(f"  output    {cfg.training.output_dir}")
        if self.log_path:
            hint = "" if self.verbose else " (Ray's, the workers' and the libraries' output; --verbose shows it here)"
            self.say(f"  log       {self.log_path}{hint}")
        for note in cfg.notes:
            self.say(f"[rayfactory] note: {note}")

    def mark(self, phase: str, at: float | None = None) -> None:
        """A start-up phase has finished (config checked, Ray up, data ready; from the workers,
        model loaded and first step, at the time rank 0 stamped on its record)."""
        self._marks.append((phase, time.time() if at is None else at))

    @property
    def _stepped(self) -> bool:
        """Start-up is over: later worker-group starts (restarts) are not part of it."""
        return any(phase == "first step" for phase, _ in self._marks)

    def startup_line(self) -> str | None:
        """'first step 23.1 s after the start: config 1.2 s, Ray 3.0 s, ...': where the wait went."""
        if not self._stepped:
            return None
        parts, before = [], self._started
        for phase, at in self._marks:
            parts.append(f"{phase} {at - before:.1f} s")
            before = at
        total = next(at for phase, at in self._marks if phase == "first step") - self._started
        return f"  start-up    first step {total:.1f} s after the start: " + ", ".join(parts)

    def progress_sink(self):
        """Where rank 0's log records should go: the bar of an entered console (the CLI's). The
        relay costs a few seconds a run (an actor, a call per log line), which a caller of
        ``run_exp`` from Python, who reads trainer_log.jsonl and the result, is not asked to pay."""
        return self.progress if self.log_path is not None else None

    def progress(self, record: dict) -> None:
        """One of rank 0's Trainer log records (fabric.progress): the bar, or an eval line."""
        step = record.get("step", 0)
        self._metrics.update((k, v) for k, v in record.items() if isinstance(v, (int, float)))
        if record.get("event") == "first_step":
            if not self._stepped:
                self.mark("first step", record.get("time"))
            return
        if record.get("event") == "begin":  # also after a restart of the worker group
            if not self._stepped:
                self.mark("model" if self._in_driver else "workers + model", record.get("time"))
            self._close_bar()
            for note in record.get("notes", ()):  # rank 0's facts (the memory plan); a restart repeats them
                if note not in self._notes_shown:
                    self._notes_shown.add(note)
                    self.say(f"[rayfactory] {note}")
            from tqdm.auto import tqdm

            self._bar = tqdm(total=record.get("max_steps") or None, initial=step, desc="train", unit="step",
                             file=self._terminal or sys.stdout, dynamic_ncols=True)
            return
        evals = {k: v for k, v in record.items() if k.startswith("eval_") and k not in _EVAL_SPEED_KEYS}
        if evals:
            self.say(f"eval at step {step}: " + ", ".join(f"{k} {_number(v)}" for k, v in evals.items()))
        if self._bar is None:
            return
        if "reward" in record:  # RL stages: the mean reward says more than a policy-gradient loss
            self._bar.set_postfix_str(f"reward {_number(record['reward'])}, kl {_number(record.get('kl', 0.0))}",
                                      refresh=False)
        elif "loss" in record:
            lr = record.get("learning_rate")
            self._bar.set_postfix_str(f"loss {_number(record['loss'])}" + (f", lr {lr:.2e}" if lr is not None else ""),
                                      refresh=False)
        self._bar.update(step - self._bar.n)
        if "train_runtime" in record:  # the Trainer's closing record: saving and the final eval follow
            self._close_bar()

    def summary(self, result, output_dir: str, resume_from: str | None = None) -> None:
        """After a run that succeeded: its headline metrics and where everything went. ``resume_from``:
        the checkpoint in output_dir that ``resume_from_checkpoint: auto`` resumes from; Ray Train's
        copy of it in Ray storage (``result.checkpoint``) is shown apart, for what it is."""
        self._close_bar()
        metrics = {**(result.metrics or {}), **self._metrics}
        shown = ", ".join(f"{k} {_number(metrics[k])}" for k in ("train_loss", "eval_loss", "reward", "eval_reward")
                          if k in metrics)
        self.say(f"done in {_duration(time.time() - self._started)}" + (f": {shown}" if shown else ""))
        self.say(f"  outputs     {output_dir}")
        startup = self.startup_line()
        if startup:
            self.say(startup)
        plot = os.path.join(output_dir, "training_loss.png")
        if os.path.exists(plot):
            self.say(f"  loss plot   {plot}")
        if resume_from:
            self.say(f"  checkpoint  {resume_from} (resume_from_checkpoint: auto resumes from it)")
        copy = result.checkpoint.path if result.checkpoint is not None else None
        if copy and os.path.abspath(copy) != os.path.abspath(resume_from or ""):
            self.say(f"  ray copy    {copy} (Ray Train's: what a restart after a worker failure loads, max_failures)")
        if self.log_path:
            self.say(f"  log         {self.log_path}")

    def predictions(self, path: str, rows: int, metrics: dict) -> None:
        """After a prediction run (fabric.predict): where the replies went and their scores."""
        self._close_bar()
        scores = ", ".join(f"{k.removeprefix('predict_')} {_number(v)}" for k, v in metrics.items()
                           if k.startswith(("predict_bleu", "predict_rouge")))
        self.say(f"predictions for {rows} eval rows: {path}" + (f" ({scores})" if scores else ""))

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # ------------------------------------------------------------------ where the rest goes
    def __enter__(self) -> "Console":
        os.makedirs(self.output_dir, exist_ok=True)
        self.log_path = os.path.abspath(os.path.join(self.output_dir, LOG_NAME))
        self._log = open(self.log_path, "a", encoding="utf-8", buffering=1)  # a resumed run appends
        self._log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} rayfactory train (pid {os.getpid()}) =====\n")
        self._ray_was_up = _ray_is_up()
        if not self.verbose:
            self._redirect_to_log()
        self._route_logging()
        return self

    def __exit__(self, *exc) -> None:
        self._close_bar()
        try:
            if not self._ray_was_up and _ray_is_up():
                # Now, not at exit: worker lines still in flight land in the log, not after the summary.
                from fabric.ray_session import shutdown

                shutdown()
        finally:
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()
            self._log.close()

    def _redirect_to_log(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        self._terminal = os.fdopen(os.dup(1), "w", buffering=1, encoding=encoding, errors="replace")
        os.dup2(self._log.fileno(), 1)
        os.dup2(self._log.fileno(), 2)
        # Line by line, so the log keeps the order of forwarded stdout and stderr lines.
        was_line_buffered = getattr(sys.stdout, "line_buffering", True)
        _line_buffered(sys.stdout, True)

        def restore():
            sys.stdout.flush()
            sys.stderr.flush()
            _line_buffered(sys.stdout, was_line_buffered)
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            self._terminal.close()
            self._terminal = None

        self._undo.append(restore)
        # How the driver writes the lines Ray forwards: no colour codes in a file, and every line
        # (Ray folds identical lines from several workers into one; read when ray is imported).
        for key in ("RAY_COLOR_PREFIX", "RAY_DEDUP_LOGS"):
            if key not in os.environ:
                os.environ[key] = "0"
                self._undo.append(lambda key=key: os.environ.pop(key, None))

    def _route_logging(self) -> None:
        root = logging.getLogger()
        to_file = logging.StreamHandler(self._log)
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        to_console = _ConsoleHandler(self)
        to_console.setFormatter(logging.Formatter("[rayfactory] %(message)s"))
        changes = [(root, to_file)] + [(logging.getLogger(name), to_console) for name in OWN_PACKAGES]
        for logger, handler in changes:
            level = logger.level
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            self._undo.append(lambda logger=logger, handler=handler, level=level: (
                logger.removeHandler(handler), logger.setLevel(level)))
        # Our own warnings (a template that renders differently from the tokenizer's) are for the
        # user too; every warning also goes where Python sends it (stderr: the log, unless verbose).
        show = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if not self.verbose and category.__module__.split(".")[0] in OWN_PACKAGES:
                self.say(f"[rayfactory] warning: {message}")
            show(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        self._undo.append(lambda: setattr(warnings, "showwarning", show))


class _ConsoleHandler(logging.Handler):
    def __init__(self, console: Console):
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console._notes_shown.add(record.getMessage())  # a note that repeats it is not shown again
            self.console.say(self.format(record))
        except Exception:  # noqa: BLE001 (logging's contract: a handler never raises)
            self.handleError(record)


def _ray_is_up() -> bool:
    ray = sys.modules.get("ray")  # never import Ray just to ask
    return ray is not None and ray.is_initialized()


def _line_buffered(stream, on: bool) -> None:
    if hasattr(stream, "reconfigure"):
        stream.reconfigure(line_buffering=on)


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
