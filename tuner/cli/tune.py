"""``colltune tune``: tune the algorithms' knobs with an Optuna study.

An Optuna study over the knobs (allgather's ``mode``; Ok-Topk's
``boundary_refresh``, ``peers_in_flight``, ``dense_fallback_ratio``; with
``--topk`` its ``local_refresh`` and ``global_refresh``) minimizing the
measured time on one workload, the default knobs timed in the same rounds.
Trials live in an Optuna storage (``--storage``): a journal file (a bare
path, or ``journal:PATH``), or a database URL (``sqlite:///tune.db``,
``postgresql://user@host/db``) that several nodes can share. Running the
command again resumes the study up to ``--trials``. Prints every trial, the
best one marked ``<== BEST``, and writes a policy (format:
``colltune.model.policy``)::

    colltune tune --world-size 4 --trials 30 --storage tune.journal --out tuned.yaml
    colltune tune --world-size 4 --trials 30 --storage sqlite:///tune.db --out tuned.yaml
    colltune tune --world-size 4 --topk --n 2^22 --density 1e-3 --trials 40
"""

from __future__ import annotations

import argparse
import os
import time

from colltune.cli.common import Command, parse_density, parse_n, parse_nonneg_int, parse_overlap, parse_positive_int, parse_world
from colltune.model.files import write_text_atomic


def _write_text(path: str, text: str) -> None:
    write_text_atomic(path, text, ".yaml")


class TuneCommand(Command):
    """``colltune tune``: an Optuna study over the knobs (registered in :data:`colltune.cli.COMMANDS`)."""

    name = "tune"
    help = "tune the algorithms' knobs with Optuna on a workload (resumable); write them as a policy"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:

        parser.add_argument("--world-size", "-P", type=parse_world, default=None, metavar="P",
                            help="ranks to start (default 4; under torchrun: the running ranks)")
        parser.add_argument("--trials", type=parse_positive_int, default=30, metavar="N",
                            help="finished trials the study should hold (default 30); a resumed study runs the rest")
        parser.add_argument("--storage", default="colltune-tune.journal", metavar="STORAGE",
                            help="the study's Optuna storage: a journal file (a path, or journal:PATH; default "
                                 "colltune-tune.journal) or a database URL such as sqlite:///tune.db or "
                                 "postgresql://user@host/db, which several nodes can share; run again to resume")
        parser.add_argument("--out", "-o", default="tuned-policy.yaml", metavar="FILE",
                            help="the policy to write (default tuned-policy.yaml)")
        parser.add_argument("--algorithm", default="all", metavar="NAME",
                            help="whose knobs to tune: all (default: every registered algorithm with knobs to "
                                 "tune in the mode) or one of them by name")
        parser.add_argument("--topk", action="store_true",
                            help="tune topk_allreduce (Ok-Topk's threshold and boundary refresh intervals, peers in "
                                 "flight) instead of sparse_allreduce")
        parser.add_argument("--n", type=parse_n, default=2**20, metavar="N", help="rows n (default 2^20)")
        parser.add_argument("--density", type=parse_density, default=1e-2, metavar="D",
                            help="entries per rank over n (default 1e-2)")
        parser.add_argument("--overlap", type=parse_overlap, default=0.5, metavar="O",
                            help="overlap of the ranks' indices (default 0.5)")
        parser.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"), default="float32")
        parser.add_argument("--rounds", type=parse_positive_int, default=9, metavar="R",
                            help="timed rounds per trial, each with the defaults interleaved (default 9)")
        parser.add_argument("--steps", type=parse_positive_int, default=16, metavar="S",
                            help="--topk: calls per round (default 16)")
        parser.add_argument("--profile", metavar="FILE", help="name this profile in the policy written")
        parser.add_argument("--seed", type=parse_nonneg_int, default=0, help="sampler and input seed (default 0)")
        parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
        parser.add_argument("--quiet", action="store_true", help="no line per trial")

    def run(self, args: argparse.Namespace) -> int:
        from colltune.offline import launch
        from colltune.offline.autotune import (
            TuneTarget,
            completed_trials,
            format_trials,
            journal_file,
            policy_text,
            run_study,
            space,
            storage_label,
        )
        from colltune.offline.profiling import ProfilingError, check_output_path

        is_root = True
        if launch.in_torchrun():
            r, here = launch.torchrun_rank()
            if args.world_size not in (None, here):
                raise ProfilingError(f"--world-size {args.world_size} does not match the {here} ranks torchrun "
                                     f"started; omit it or pass --world-size {here}.")
            world, is_root = here, r == 0
        else:
            world = args.world_size or 4
        if is_root:
            check_output_path(args.out)
            _check_storage(args.storage)
            if args.profile is not None:
                from colltune.model.profile import load_profile

                load_profile(args.profile)
        mode = "topk" if args.topk else "exact"
        tunable = tuple(space(mode))
        if args.algorithm != "all" and args.algorithm not in tunable:
            raise ProfilingError(
                f"--algorithm {args.algorithm!r} has no knobs to tune in {mode} mode; pass all or one of "
                f"{', '.join(tunable) or 'none'}{' (drop --topk for the others)' if args.topk else ''}.")
        algorithms = tunable if args.algorithm == "all" else (args.algorithm,)
        w = TuneTarget(mode, args.n, args.density, args.overlap, args.dtype, world, args.rounds, args.steps, args.seed)
        from colltune.offline.workloads import k_for_density

        if w.world_size > 1 and mode == "exact" and k_for_density(w.n, w.density) > w.n:
            raise ProfilingError("--density is too high for --n.")
        t0 = time.monotonic()
        study = run_study(w, algorithms, args.trials, args.storage, seed=args.seed, show=not args.quiet,
                          backend=args.backend)
        if study is None:
            return 0
        print()
        print(format_trials(study, algorithms))
        text = policy_text(study, algorithms, args.storage, args.profile, args.backend)
        _write_text(args.out, text)
        print(f"\nwrote {args.out} (the best knobs as a policy; study {study.study_name!r} in "
              f"{args.storage if journal_file(args.storage) is not None else storage_label(args.storage)}, "
              f"{len(completed_trials(study))} trials; {time.monotonic() - t0:.0f} s)")
        return 0


def _check_storage(spec: str) -> None:
    """Refuse a ``--storage`` that cannot hold the study, before any rank starts.

    A journal file must be writable and, when it holds anything, an Optuna
    journal; a database URL must open.
    """
    import json

    from colltune.offline.autotune import journal_file, storage_of
    from colltune.offline.profiling import ProfilingError, check_output_path

    path = journal_file(spec)
    if path is None:
        storage_of(spec)
        return
    if not path:
        raise ProfilingError(f"--storage {spec!r} names no file; pass journal:PATH or a path such as tune.journal.")
    check_output_path(path, "--storage")
    if not (os.path.exists(path) and os.path.getsize(path) > 0):
        return
    try:
        with open(path, "rb") as fh:
            first = fh.readline()
        rec = json.loads(first.decode("utf-8"))
        if not isinstance(rec, dict) or "op_code" not in rec:
            raise ValueError
    except (OSError, ValueError, UnicodeDecodeError):
        raise ProfilingError(f"--storage {path!r} is not an Optuna journal file; pass a new path (it is created), "
                             "the file of an earlier colltune tune run, or a database URL such as "
                             "sqlite:///tune.db.") from None
