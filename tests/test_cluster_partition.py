"""`memtrain submit` compares one node's share of the job (CPUs: --cpus-per-task x tasks per
node; GPUs of the --gpu-type) with the nodes of the partition as `sinfo` lists them, and
refuses before sbatch, naming the numbers and the flag, what no node holds; where sinfo is
missing or fails it says in one line that the check was skipped. Checked with fake `sinfo`
scripts for GPU nodes and against the real single-node SLURM for CPUs."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from daemons import run_ok
from slurm_cluster import start_cluster_for_test
from train_helpers import BIN, ROOT, child_env, tiny_config

from cluster import torch_check
from cluster.partition import parse_gres, parse_sinfo
from cluster.submit import main_submit

SKIPPED = "CPUs and GPUs per node not checked against the partition's nodes"


def _path_with(tmp_path: Path, sinfo: str | None) -> str:
    """A PATH whose `sinfo` prints `sinfo` (None: no sinfo at all) and whose `sbatch`
    records that it was called. The folders of the real sinfo are left out, so the fakes
    use shell builtins only."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "sinfo"
    fake.unlink(missing_ok=True)
    if sinfo is not None:
        fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/sinfo.args\n"
                        f"printf '%s\\n' {shlex.quote(sinfo)}\n")
        fake.chmod(0o755)
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\n: > {tmp_path}/sbatch.called\necho 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    keep = [d for d in os.environ["PATH"].split(":") if d and not (Path(d) / "sinfo").exists()]
    return ":".join([str(bin_dir), *keep])


@pytest.fixture
def submit(tmp_path, monkeypatch, capsys):
    """submit(sinfo_output, *argv) -> (exit code, stderr) of a real submit (no --dry-run)
    of a GPU job under a fake sinfo; sbatch is a recorder, the torch check a CUDA build."""
    monkeypatch.setattr(torch_check, "probe", lambda python: {
        "version": "2.13.0+cu126", "cuda": "12.6", "archs": ["sm_70", "sm_80", "sm_90"]})
    monkeypatch.chdir(tmp_path)

    def run(sinfo, *argv):
        monkeypatch.setenv("PATH", _path_with(tmp_path, sinfo))
        overrides = [a for a in argv if "=" in a and not a.startswith("-")]
        flags = [a for a in argv if a not in overrides]
        code = main_submit(["--config", "quickstart", *flags, f"run_dir={tmp_path}/run",
                            *overrides])
        return code, capsys.readouterr().err
    return run


# sinfo -h -N -o "%N|%c|%G|%P" of 40-core nodes with 8 V100 (a DGX-1), of 4-GPU V100
# nodes, and of A100 nodes in another partition.
DGX1_NODES = "\n".join(f"d{i:02d}|40|gpu:tesla_v100:8(S:0-1)|gpu*" for i in range(4))
V100_NODES = "\n".join(f"v{i:02d}|40|gpu:tesla_v100:4(S:0-1)|gpu*" for i in range(4))
A100_NODES = "\n".join(f"a{i:02d}|128|gpu:a100:8,nic:1|a100" for i in range(4))


def test_the_default_cpus_are_refused_on_40_core_nodes_with_the_flag_that_fits(submit,
                                                                                tmp_path):
    """The default 8 CPUs per task x 8 tasks (one per GPU) = 64 CPUs per node; a DGX-1 has
    40 cores."""
    code, err = submit(DGX1_NODES, "--gpus-per-node", "8", "--gpu-type", "tesla_v100")
    assert code == 2, err
    assert ("--cpus-per-task: 8 CPUs per task x 8 tasks per node = 64 CPUs per node asked, "
            "but its nodes in the default partition have at most 40 CPUs: use "
            "--cpus-per-task 5 (5 x 8 = 40)") in err
    assert not (tmp_path / "sbatch.called").exists()
    code, err = submit(DGX1_NODES, "--gpus-per-node", "8", "--gpu-type", "tesla_v100",
                       "--cpus-per-task", "5")
    assert code == 0, err
    assert (tmp_path / "sbatch.called").exists() and SKIPPED not in err


def test_more_gpus_of_the_type_than_any_node_has_are_refused_before_sbatch(submit, tmp_path):
    code, err = submit(V100_NODES, "--gpus-per-node", "8", "--gpu-type", "tesla_v100",
                       "--cpus-per-task", "4")
    assert code == 2
    assert ("--gpus-per-node: 8 GPUs of type tesla_v100 per node asked, but no node of the "
            "default partition has them (the most per node: 4; its nodes have "
            "gpu:tesla_v100:4 (4 nodes)): use --gpus-per-node 4") in err
    # A type the partition does not have: sbatch's "Invalid generic resource" named here.
    code, err = submit(V100_NODES, "--gpus-per-node", "4", "--gpu-type", "v100",
                       "--cpus-per-task", "4")
    assert code == 2
    assert "--gpu-type: 4 GPUs of type v100 per node asked" in err
    assert "gpu:tesla_v100:4" in err and "use --gpu-type with a type listed there" in err
    # Untyped GPUs (gres gpu:8) take no typed request: leave the type out.
    code, err = submit("g1|64|gpu:8|gpu*", "--gpus-per-node", "8", "--gpu-type", "a100")
    assert code == 2 and "these GPUs have no type in SLURM: leave --gpu-type out" in err
    assert not (tmp_path / "sbatch.called").exists()
    # The same request on the partition that has them goes to sbatch.
    code, err = submit(f"{V100_NODES}\n{A100_NODES}", "--partition", "a100", "--nodes", "4",
                       "--gpus-per-node", "8", "--gpu-type", "a100",
                       "data.global_batch=32", "eval.batch=32")
    assert code == 0, err
    assert (tmp_path / "sbatch.called").exists()
    assert (tmp_path / "sinfo.args").read_text().split()[:2] == ["-p", "a100"]


def test_without_an_answer_from_sinfo_the_check_is_skipped_in_one_line(submit, tmp_path,
                                                                        capsys):
    code, err = submit(None, "--gpus-per-node", "0", "--cpus-per-task", "64")
    assert code == 0, err
    lines = [line for line in err.splitlines() if SKIPPED in line]
    assert len(lines) == 1 and "sinfo is not installed here" in lines[0]
    # sinfo that fails (no SLURM reachable): skipped as well, with its last words.
    (tmp_path / "bin" / "sinfo").write_text("#!/bin/sh\necho 'sinfo: fatal: no "
                                            "configuration' >&2\nexit 1\n")
    (tmp_path / "bin" / "sinfo").chmod(0o755)
    code = main_submit(["--config", "quickstart", "--gpus-per-node", "0", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 0
    assert f"{SKIPPED}: sinfo failed: sinfo: fatal: no configuration" in err


def test_a_dry_run_shows_the_problem_as_a_warning(submit, tmp_path):
    code, err = submit(V100_NODES, "--gpus-per-node", "8", "--gpu-type", "tesla_v100",
                       "--dry-run")
    assert code == 0
    assert "warning (an error without --dry-run): --gpus-per-node: 8 GPUs" in err


def test_sinfo_lines_are_read_per_node_with_their_gpus_per_type():
    assert parse_gres("gpu:tesla_v100:4(S:0-1)") == {"tesla_v100": 4}
    assert parse_gres("gpu:a100:4(S:0),gpu:v100:2(S:1),nic:1") == {"a100": 4, "v100": 2}
    assert parse_gres("gpu:8") == {"": 8} and parse_gres("(null)") == {}
    nodes = parse_sinfo("n1|40|gpu:8|cpu\nn2|64|(null)|debug*\nn3|64+|(null)|debug*\n", "")
    assert [(n.name, n.cpus) for n in nodes] == [("n2", 64), ("n3", 64)]
    assert [n.name for n in parse_sinfo("n1|40|gpu:8|cpu\nn2|64|(null)|debug*", "cpu")] \
        == ["n1"]


# ----------------------------------------------------------------------------- real SLURM
@pytest.mark.slow
def test_on_slurm_more_cpus_per_node_than_the_node_has_are_refused_before_sbatch(tmp_path):
    """This SLURM's one node has the machine's CPUs: twice that is refused by the check,
    not by sbatch, and no job is queued; what fits passes the check (no "skipped" line)."""
    slurm, stop = start_cluster_for_test(tmp_path / "slurm")
    try:
        env = child_env(slurm)
        cpus = int(run_ok(["sinfo", "-h", "-N", "-o", "%c"], env=env).stdout.split()[0])
        cfg = tiny_config(tmp_path, "big", data={"global_batch": 4})

        def submit(*argv):
            return subprocess.run([str(BIN / "memtrain"), "submit", "--config", str(cfg),
                                   "--gpus-per-node", "0", "--tasks-per-node", "2",
                                   "--time", "5", *argv], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=60)

        done = submit("--cpus-per-task", str(cpus))
        assert done.returncode == 2, done.stderr
        assert (f"--cpus-per-task: {cpus} CPUs per task x 2 tasks per node = {2 * cpus} CPUs "
                f"per node asked, but its nodes in the default partition have at most "
                f"{cpus} CPUs") in done.stderr
        assert "sbatch" not in done.stderr
        queued = run_ok(["squeue", "-h", "-o", "%i"], env=env).stdout.split()
        assert queued == [] and not (tmp_path / "runs" / "big" / "jobs.jsonl").exists()
        fits = submit("--cpus-per-task", str(max(1, cpus // 2)), "--dry-run")
        assert fits.returncode == 0 and SKIPPED not in fits.stderr, fits.stderr
        assert not re.search(r"warning .*CPUs per node", fits.stderr)
    finally:
        stop()

