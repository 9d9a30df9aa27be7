"""A Hugging Face ``Trainer`` script written the way its users write them, with ftrun snapshots.

Stock transformers: a small GPT-2 built from a ``GPT2Config`` (dropout on), a map-style
``Dataset`` of token sequences, ``TrainingArguments`` with ``max_steps``, a cosine schedule
with warm-up, gradient clipping, ``dataloader_drop_last`` and a seed, and ``Trainer.train()``.
Nothing is downloaded. The ftrun part is one line: ``add_snapshots(trainer)``.

Run it::

    ftrun --nproc-per-node 3 examples/hf_trainer.py
    ftrun --nproc-per-node 3 examples/hf_trainer.py --kill-at-step 7 --kill-rank 1
    python examples/hf_trainer.py               # one process; snapshots are off

At the end rank 0 prints ``hf-trainer: step=N world=W params_xxh3=HEX train_loss=X`` and the
``(step, loss)`` pairs of ``TrainerState.log_history``; each rank prints ``hf-trainer: rank R
trains from global_step=S epoch=E`` (the Trainer's counters) at its first step, and a rank
that resumed prints ``hf-trainer: rank R resumed from step S (SOURCE)`` (where the snapshot
came from: ``memory``, ``memory (from node(s) N)``, ...). ``--kill-at-step S
--kill-rank R`` SIGKILLs rank R once per job right after its optimizer step S (before the
snapshot of S), so the job resumes from the snapshot of S-1; the marker file that makes it
once lives in ``$FTRUN_JOB_DIR`` (or ``--fault-dir``). ``--hold-at-step S`` (for tests that take
a whole host away at a step of their choosing) has every rank wait after its optimizer step S,
once per job, until the file ``hf-trainer-release`` exists there; each writes
``hf-trainer-held-rank<R>`` first. ``--fail-mode raise`` raises there instead of the
SIGKILL; ``--pid-log DIR`` has each rank append ``step pid time`` to ``DIR/pids-rank<R>.log``
after every optimizer step.

``--resilient`` runs the training function ``train`` under ``@ftrun.resilient``, as a user
would decorate theirs: after a fault the surviving ranks run it again in their own processes
(new ``TrainingArguments`` and ``Trainer``, which resumes from the snapshot), and only the
failed rank gets a new process::

    ftrun --nproc-per-node 3 examples/hf_trainer.py --resilient --kill-at-step 7 --kill-rank 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

# examples/user_ddp.py (this directory is on sys.path)
from user_ddp import add_framework_fault_args, log_pid, params_xxh3

import ftrun
from ftrun.faults import fire_once, kill_once
from ftrun.integrations.transformers import add_snapshots
from ftrun.testing import wait_for


class CountingDataset(Dataset):
    """Sequences that count up modulo the vocabulary from a random start: easy to learn."""

    def __init__(self, samples: int, length: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        starts = torch.randint(0, vocab, (samples, 1), generator=gen)
        self.ids = (starts + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class ReportStart(TrainerCallback):
    """Prints the Trainer's own counters where this process starts training (after a resume:
    those of the snapshot, not 0)."""

    def __init__(self) -> None:
        self.reported = False

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if not self.reported:
            self.reported = True
            print(f"hf-trainer: rank {args.process_index} trains from "
                  f"global_step={state.global_step} epoch={state.epoch or 0:g}",
                  file=sys.stderr, flush=True)


class KillOnce(TrainerCallback):
    """Fault injection for the tests: SIGKILL rank ``rank`` after its optimizer step
    ``step``, once per job (ftrun.faults.kill_once), or raise there (``raise_=True``)."""

    def __init__(self, step: int, rank: int, directory: str | None, raise_: bool = False) -> None:
        self.step, self.rank, self.directory, self.raise_ = step, rank, directory, raise_

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step != self.step or args.process_index != self.rank:
            return
        if not self.raise_:
            kill_once("hf-trainer", self.rank, self.step, self.directory)
            return
        directory = self.directory or os.environ.get("FTRUN_JOB_DIR", ".")
        if fire_once(os.path.join(directory, f"hf-trainer-fault-rank{self.rank}-step{self.step}")):
            print(f"hf-trainer: raising in rank {self.rank} in step {self.step}",
                  file=sys.stderr, flush=True)
            raise RuntimeError(f"hf-trainer: injected fault in rank {self.rank} at step "
                               f"{self.step}")


class PidLog(TrainerCallback):
    """Each rank appends ``step pid time`` to ``<directory>/pids-rank<R>.log`` after every
    optimizer step: which process trained which step, and when."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_step_end(self, args, state, control, **kwargs) -> None:
        log_pid(self.directory, args.process_index, state.global_step)


class HoldOnce(TrainerCallback):
    """For the tests: every rank waits after its optimizer step ``step``, once per job, until
    the test writes ``hf-trainer-release`` (it takes a host away meanwhile)."""

    def __init__(self, step: int, directory: str) -> None:
        self.step, self.directory = step, directory

    def on_step_end(self, args, state, control, **kwargs) -> None:
        release = os.path.join(self.directory, "hf-trainer-release")
        if state.global_step == self.step and fire_once(
                os.path.join(self.directory, f"hf-trainer-held-rank{args.process_index}")):
            wait_for(lambda: os.path.exists(release), 600, release)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=4, help="per device")
    p.add_argument("--n-embd", type=int, default=32, help="GPT-2 width")
    p.add_argument("--n-layer", type=int, default=2, help="GPT-2 blocks")
    p.add_argument("--save-steps", type=int, default=0,
                   help="save a checkpoint every N steps (default: none)")
    p.add_argument("--every", default=None, help="snapshot every K steps, or auto "
                   "(default: the launcher's --snapshot-every)")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--kill-at-step", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--hold-at-step", type=int, default=0)
    p.add_argument("--fault-dir")
    add_framework_fault_args(p)
    args = p.parse_args()
    (train if args.resilient else train.__wrapped__)(args)
    return 0


@ftrun.resilient
def train(args: argparse.Namespace) -> None:
    """The whole run, from the model to ``trainer.train()``: under ``--resilient`` ftrun runs
    it again in this process after a fault (ftrun.integrations.transformers resets
    accelerate's process-wide state first, so that the new ``TrainingArguments`` and
    ``Trainer`` join the new world)."""
    torch.set_num_threads(1)

    set_seed(0)
    vocab, length = 64, 16
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab, n_positions=length, n_embd=args.n_embd, n_layer=args.n_layer, n_head=2,
        bos_token_id=0, eos_token_id=0))  # dropout: GPT-2's default 0.1 everywhere
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="hf-trainer-")
    training_args = TrainingArguments(
        output_dir=output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3,
        weight_decay=0.01,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        dataloader_drop_last=True,
        logging_steps=2,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=training_args,
                      train_dataset=CountingDataset(args.samples, length, vocab))
    snapshots = add_snapshots(trainer, every=int(args.every) if (args.every or "auto").isdigit()
                              else args.every)
    trainer.add_callback(ReportStart())
    if args.kill_at_step:
        trainer.add_callback(KillOnce(args.kill_at_step, args.kill_rank, args.fault_dir,
                                      raise_=args.fail_mode == "raise"))
    if args.pid_log:
        trainer.add_callback(PidLog(args.pid_log))
    if args.hold_at_step:
        trainer.add_callback(HoldOnce(args.hold_at_step,
                                      args.fault_dir or os.environ.get("FTRUN_JOB_DIR", ".")))

    result = trainer.train()

    rank = training_args.process_index
    if snapshots.resumed_from:
        print(f"hf-trainer: rank {rank} resumed from step {snapshots.resumed_from} "
              f"({snapshots.snapshotter.source})", file=sys.stderr, flush=True)
    if rank == 0:
        print(f"hf-trainer: step={result.global_step} world={training_args.world_size} "
              f"params_xxh3={params_xxh3(trainer.model)} "
              f"train_loss={result.training_loss!r}", flush=True)
        logged = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
        print(f"hf-trainer: logged (step, loss) {logged}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
