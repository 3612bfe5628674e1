"""Preemption under Lightning: ranksafe's signal handlers instead of Lightning's, and SLURM's requeue after the commit.

Lightning's own handlers act inside the signal handler: its SIGTERM handler broadcasts a tensor, and its SLURM
requeue handler (SIGUSR1, with ``SLURMEnvironment(auto_requeue=True)``) saves a checkpoint, then runs
``scontrol requeue <job id>`` on rank 0. A signal interrupts each rank somewhere else (a step, an all-reduce, a
save), so a collective started there pairs with whatever the other ranks are in, or waits forever. With
``RankSafe(preemption=True)`` the manager's handlers only record the signal; the ranks save together at the next
common step boundary, stop, and then :func:`requeue` runs Lightning's command from rank 0.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment

from . import compat

log = logging.getLogger(__name__)

UNAGREED_REQUEUE = (
    "SLURMEnvironment(auto_requeue=True): Lightning's requeue handler saves a checkpoint from inside the signal "
    "handler, where the ranks cannot meet; a signal that reaches them at different points fails or hangs the job. "
    "RankSafe(checkpoint_dir=..., preemption=True) saves at a step every rank agrees on, then requeues"
)
"""The warning of a multi-rank fit that leaves SLURM's requeue signal to Lightning's handler."""


@dataclass(frozen=True)
class SlurmRequeue:
    """``SLURMEnvironment(auto_requeue=True)``'s request: after a stop caused by ``signal``, requeue the job."""

    signal: signal.Signals

    @classmethod
    def of(cls, trainer: pl.Trainer) -> SlurmRequeue | None:
        """The Trainer's request, or None when its cluster environment asks for no requeue."""
        environment = compat.cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            return cls(signal.Signals(environment.requeue_signal))
        return None

    def check_handled(self, handled: Iterable[int]) -> None:
        """Raise ``ValueError`` unless ranksafe handles the requeue signal: else nobody would (Lightning's handler is
        not installed), and its default action ends the process."""
        handled = tuple(signal.Signals(s) for s in handled)
        if self.signal not in handled:
            names = ", ".join(s.name for s in handled)
            raise ValueError(
                f"SLURMEnvironment requeues on {self.signal.name}, but RankSafe(preemption=...) handles {names}: "
                f"add signal.{self.signal.name} to preemption"
            )


def slurm_job_id() -> str:
    """The id ``scontrol requeue`` takes, as Lightning's handler reads it: ``<array job>_<task>`` in a job array.
    Raises ``KeyError`` naming the missing variable, ``ValueError`` for an id that is no SLURM job id."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_-]+", job_id):
        raise ValueError(f"not a SLURM job id: {job_id!r}")
    return job_id


def requeue() -> None:
    """Run ``scontrol requeue <job id>``: on rank 0 only, once the preemption step is committed. Never raises (rank 0
    alone runs it, and the other ranks must not be left in a collective): a requeue that fails is a warning, as in
    Lightning; the step is committed, and resubmitting the job resumes from it."""
    try:
        job_id = slurm_job_id()
        log.info(f"requeueing SLURM job {job_id}")
        code = subprocess.call(["scontrol", "requeue", job_id])
        failure = None if code == 0 else f"scontrol requeue {job_id} exited with status {code}"
    except (KeyError, ValueError, OSError) as e:
        failure = f"cannot requeue the SLURM job: {type(e).__name__}: {e}"
    if failure is not None:
        warnings.warn(f"{failure}; resubmit the job to resume from its last step", stacklevel=2)
