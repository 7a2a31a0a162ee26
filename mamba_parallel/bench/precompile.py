"""Compile every kernel a ``bench all`` run will time, in parallel processes, before the timed run starts.

Triton compiles each autotune candidate on the host, one after another: on a fresh GPU machine the side-by-side SSD
section spends minutes compiling the candidates of three implementations and under a second timing them. The
warm-up runs the same sections on the same kernel shapes in ``workers`` processes at once (models cut to two layers,
one timed repeat, two new tokens), so the compiled binaries land in Triton's on-disk cache. The timed run then
compiles nothing, autotunes again on an idle GPU and times exactly as it would have: nothing measured by the
warm-up is kept (its results go to a scratch folder, and fla's on-disk autotune results are switched off in it).

Jobs of one family (the SSD shapes, the Mamba-2 training presets, ...) compile the same kernels: started together,
each would compile all of them itself, and the host's cores would spend most of the warm-up on copies. So the
first job of a family runs alone and the others start when it has ended, finding its binaries in the cache
(they still compile what their shapes specialise differently, and autotune on their shapes).

Some first jobs are dominated by long autotune sweeps: mamba_ssm's Mamba-3 kernels try 27 to 81 launch
configurations each (about 190 for its SISO backward), and the SSD section compiles ours, mamba_ssm's and fla's
candidates. Such a job is split into k slices started together (candidates.py): slice i compiles only candidates
i, i + k, ... of every autotuner, so the k processes compile disjoint binaries and the job's autotune compiles
take about 1/k of the time. k shares out the workers the unsliced families' first jobs leave free (at most
``MAX_SLICES``); with too few workers nothing is sliced. The rest of a sliced family waits for all the slices.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from mamba_parallel.bench import candidates

WARM_LAYERS = 2  # every layer of a stack runs the same kernels: two layers compile what the whole model needs
MAX_SLICES = 12  # each slice pays its own start-up (imports, the kernels nobody tunes) and GPU memory for its inputs


@dataclass
class Job:
    name: str
    argv: list[str]
    tail: list[str] = field(default_factory=list)  # flags after the common ones (they win: argparse keeps the last)
    family: str = ""  # jobs compiling the same kernels; "" = a family of its own
    sliceable: bool = False  # long autotune sweeps: worth splitting into candidate slices when it leads its family
    part: candidates.Slice | None = None  # the autotune candidates this job compiles (None: all)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    seconds: float = 0.0
    status: str = "waiting"  # waiting | running | done | failed (exit code) | stopped (budget spent)
    log_file: object = None

    @property
    def label(self) -> str:
        return self.name + (f" [{self.part}]" if self.part else "")


def _common(a, out: str) -> list[str]:
    argv = ["--out", out, "--report", "", "--kernel-warmup", "1", "--kernel-reps", "1", "--peer-impl", a.peer_impl]
    if a.peer is not None:
        argv.append("--peer" if a.peer else "--no-peer")
    if a.device:
        argv += ["--device", a.device]
    if a.no_fla:
        argv.append("--no-fla")
    return argv


def jobs_for(a, sections, ssd_shapes, scan_shapes, out: str, fla: bool | None = None,
             workers: int | None = None) -> list[Job]:
    """One warm-up job per kernel shape / preset / model of the sections a ``bench all`` run times (``a``: its
    parsed arguments; ``fla``: whether it times fla, default unless --no-fla), the slowest to compile first;
    given the ``workers`` that will run them, the first jobs of the SSD and Mamba-3 families (Mamba-3 training
    too) are split into candidate slices (``slice_leads``)."""
    common = _common(a, out)
    layers = str(min(WARM_LAYERS, a.n_layer) if a.n_layer else WARM_LAYERS)
    jobs = []
    if "ssd" in sections:  # fla's candidates compile in a job of their own: the SSD shapes are the slowest jobs
        for s in ssd_shapes:
            argv = ["--only", "ssd", "--ssd-shape", *map(str, s), "--ssd-chunk", str(a.ssd_chunk)]
            kind = "p{} n{} g{}".format(*s[3:])  # headdim, d_state and groups pick the tiles: other binaries
            if a.no_fla or fla is False:
                jobs.append(Job(f"ssd {' '.join(map(str, s))}", argv, family=f"ssd {kind}", sliceable=True))
            else:
                jobs += [Job(f"ssd {' '.join(map(str, s))}", argv, tail=["--no-fla"], family=f"ssd {kind}",
                             sliceable=True),
                         Job(f"ssd {' '.join(map(str, s))} fla", argv, tail=["--no-peer"],
                             family=f"ssd fla {kind}", sliceable=True)]
    if "mamba3" in sections:
        jobs.append(Job("mamba3", ["--only", "mamba3"], family="mamba3", sliceable=True))
    if "train" in sections:
        jobs += [Job(f"train {p}", ["--only", "train", "--train-presets", p, "--train-seq-len", str(a.train_seq_len),
                                    "--train-batch", str(a.train_batch), "--train-warmup", "1", "--train-steps", "1",
                                    "--n-layer", layers], family=f"train {_kind(p)}",
                     sliceable=_kind(p).startswith("Mamba3")) for p in a.train_presets]  # the peer's Mamba-3 autotunes long
    if "selective_scan" in sections:
        jobs += [Job(f"selective_scan {' '.join(map(str, s))}", ["--only", "selective_scan",
                                                                "--selective-scan-shape",
                                                                *map(str, s)], family="selective_scan")
                 for s in scan_shapes]
    if "generate" in sections:
        jobs += [Job(f"generate {m}", ["--only", "generate", "--generate-models", m, "--generate-batches",
                                       *map(str, a.generate_batches), "--prompt-len", str(a.prompt_len),
                                       "--new-tokens", "2", "--generate-repeats", "1", "--n-layer", layers],
                     family=f"generate {_kind(m)}") for m in a.generate_models]
    if "long_context" in sections:
        jobs.append(Job(f"long_context {a.long_preset}", ["--only", "long_context", "--long-preset", a.long_preset,
                                                          "--long-start", str(a.long_start), "--long-max",
                                                          str(a.long_start), "--n-layer", layers],
                        family="long_context"))
    for j in jobs:  # a job's own flags replace the common ones they contradict (--no-peer beats --peer)
        j.argv = j.argv + [x for x in common if not ("--no-peer" in j.tail and x == "--peer")] + j.tail
    return slice_leads(jobs, workers) if workers else jobs


def _family(job: Job) -> str:
    return job.family or job.name


def slice_leads(jobs: list[Job], workers: int) -> list[Job]:
    """``jobs`` with the first job of every sliceable family replaced by k candidate slices of it, k the share of
    the ``workers`` left once every other family's first job has one (at most MAX_SLICES; below 2: unchanged).
    All first jobs then fit in the workers at once, so the slices of one job start together."""
    leads: dict[str, Job] = {}
    for j in jobs:
        leads.setdefault(_family(j), j)
    sliced = [j for j in leads.values() if j.sliceable]
    if not sliced:
        return jobs
    k = min(MAX_SLICES, (workers - (len(leads) - len(sliced))) // len(sliced))
    if k < 2:
        return jobs
    out = []
    for j in jobs:
        if not any(j is s for s in sliced):
            out.append(j)
            continue
        for i in range(k):
            part = candidates.Slice(i, k)
            out.append(Job(j.name, j.argv + ["--warmup-candidates", str(part)], list(j.tail), j.family,
                           j.sliceable, part))
    return out


def _kind(preset: str) -> str:
    """What kernels a preset's model runs: its mixer, and attention in a hybrid (an unknown name: itself)."""
    from mamba_parallel.config import PRESETS, get_preset

    if preset not in PRESETS:
        return preset
    cfg = get_preset(preset)
    return (cfg.ssm_cfg or {}).get("layer", "Mamba1") + (" + attention" if cfg.attn_layer_idx else "")


def child_env() -> dict:
    """The warm-up's environment: no autotune result is written to disk for the timed run to pick up."""
    env = dict(os.environ)
    env["FLA_CACHE_RESULTS"] = "0"  # fla keeps autotune results on disk by default; these were timed on a busy GPU
    env.pop("TRITON_CACHE_AUTOTUNING", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _stop(job: Job) -> None:
    try:
        os.killpg(job.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    job.proc.wait()


def _leads(jobs: list[Job]) -> dict[str, list[Job]]:
    """family -> its first job (all its slices, when that job was sliced)."""
    out: dict[str, list[Job]] = {}
    for job in jobs:
        group = out.setdefault(_family(job), [job])
        if job.part is not None and job is not group[0] and job.name == group[0].name:
            group.append(job)
    return out


def _kept(job: Job) -> tuple[int, int] | None:
    """(autotune sweeps, their candidates) a sliced job's log reports at its end (candidates.summary)."""
    try:
        with open(job.log_file.name) as f:
            line = next((x for x in f if x.startswith(candidates.PREFIX)), None)
    except (OSError, AttributeError):
        return None
    found = re.search(r"(\d+) autotune sweeps, \d+ of their (\d+) candidates", line or "")
    return (int(found[1]), int(found[2])) if found else None


def _summary(jobs: list[Job]) -> str:
    """One entry per job; the slices of a job as one: their count, the longest, how they ended, the sweeps."""
    parts, seen = [], set()
    for j in jobs:
        if j.part is None:
            parts.append(f"{j.name} {j.seconds:.0f} s" + ("" if j.status == "done" else f" [{j.status}]"))
            continue
        if (j.name, j.family) in seen:
            continue
        seen.add((j.name, j.family))
        group = [x for x in jobs if x.part is not None and (x.name, x.family) == (j.name, j.family)]
        bad = [x.status for x in group if x.status != "done"]
        kept = [k for k in map(_kept, group) if k]
        sweeps = f" ({max(k[0] for k in kept)} autotune sweeps of {max(k[1] for k in kept)} candidates)" if kept \
            else ""
        parts.append(f"{j.name} in {len(group)} candidate slices {max(x.seconds for x in group):.0f} s{sweeps}"
                     + (f" [{len(bad)} not done: {', '.join(sorted(set(bad)))}]" if bad else ""))
    return ", ".join(parts)


def run(jobs: list[Job], workers: int, budget_s: float, log_dir: str, log, poll_s: float = 0.5) -> list[Job]:
    """Run the jobs, ``workers`` at a time (the first of each family alone, or its candidate slices together; the
    rest of the family once that has ended), each one's output in ``log_dir``; what has not finished after
    ``budget_s`` seconds is stopped. -> the jobs with their status and seconds (a failed or stopped warm-up only
    means the timed run compiles that part itself)."""
    if workers < 1:
        raise ValueError(f"bench all: --precompile-workers must be >= 1 to warm up, got {workers}")
    workers = min(workers, max(1, len(jobs)))
    env, t0 = child_env(), time.monotonic()
    waiting, running = list(jobs), []
    leads = _leads(jobs)
    sliced = sorted({j.name for j in jobs if j.part is not None})
    log(f"precompile: {len(jobs)} warm-ups in {workers} processes, for at most {budget_s:.0f} s"
        + (f" ({', '.join(sliced)}: autotune candidates split between processes started together)" if sliced
           else ""))
    while waiting or running:
        now = time.monotonic()
        for job in list(running):
            code = job.proc.poll()
            if code is None and now - t0 < budget_s:
                continue
            if code is None:
                _stop(job)
                job.status = "stopped"
            else:
                job.status = "done" if code == 0 else f"failed (exit {code})"
            job.seconds = time.monotonic() - job.started
            job.log_file.close()
            running.remove(job)
        if now - t0 >= budget_s:
            for job in waiting:
                job.status = "stopped"
            waiting = []
        for job in list(waiting):
            if len(running) >= workers:
                break
            lead = leads[_family(job)]
            if not any(job is x for x in lead) and any(x.status in ("waiting", "running") for x in lead):
                continue  # its binaries are still being compiled by the family's first job
            waiting.remove(job)
            job.log_file = open(os.path.join(log_dir, f"{len(jobs) - len(waiting):02d}.log"), "w")
            job.started = time.monotonic()
            job.proc = subprocess.Popen([sys.executable, "-m", "mamba_parallel.bench.bench_all", *job.argv],
                                        stdout=job.log_file, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
            job.status = "running"
            running.append(job)
        if running:
            time.sleep(poll_s)
    log(f"precompile: {len(jobs)} warm-ups in {workers} processes, {time.monotonic() - t0:.0f} s: {_summary(jobs)}"
        f" (logs in {log_dir})")
    return jobs
