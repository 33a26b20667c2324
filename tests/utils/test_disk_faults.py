"""Full disks and folders the run cannot write: a checkpoint that does not fit, the partial checkpoint it would
leave, a resume on a disk that partial filled, read-only folders and files in a folder's place. Real full and
read-only file systems come from small tmpfs mounts (``tmpfs`` fixture: skipped where mounting is not allowed);
root ignores permission bits, so those cannot stand in."""

import errno
import subprocess
import sys

import pytest

from nemo_fp8.utils.checkpoint import CheckpointManager, CheckpointWriteError, verify_checkpoint
from nemo_fp8.utils.run_dir import FolderLock, RunSetupError, read_marker, write_marker
from tests.conftest import fill_disk
from tests.utils.test_run_safety_units import REPO, FakePolicy, cfg_for


def test_a_full_disk_while_checkpointing_names_the_folder_and_leaves_no_partial(tmp_path, tmpfs):
    ckpt = tmpfs.mount("ckpt", 1)
    m = CheckpointManager(ckpt, keep_last_k=3, run_id="r")
    m.save(1, FakePolicy(), {"dataloader": {}}, "a: 1\n")
    fill_disk(ckpt)
    with pytest.raises(CheckpointWriteError) as e:
        m.save(2, FakePolicy(), {"dataloader": {}}, "a: 1\n")
    assert f"checkpointing.checkpoint_dir={ckpt}" in str(e.value) and "the disk is full" in str(e.value)
    assert sorted(p.name for p in ckpt.iterdir()) == ["filler", "step_1"]  # no step_2.tmp holding the space
    verify_checkpoint(ckpt / "step_1")


def test_torchs_own_error_on_a_full_disk_is_named_as_a_full_disk(tmp_path, tmpfs):
    import torch

    class TorchPolicy:  # the optimizer's torch.save says "unexpected pos ..." (a RuntimeError) on a full disk
        def save(self, path):
            path.mkdir(parents=True)
            torch.save({"exp_avg": torch.zeros(2**20)}, path / "optimizer.pt")

    ckpt = tmpfs.mount("ckpt", 1)
    with pytest.raises(CheckpointWriteError, match=r"checkpointing.checkpoint_dir=.*: the disk is full \(.*MiB left; "
                                                    r"RuntimeError"):
        CheckpointManager(ckpt, run_id="r").save(1, TorchPolicy(), {}, "a: 1\n")
    assert list(ckpt.iterdir()) == []


def test_a_policy_workers_disk_full_error_through_ray_is_named(tmp_path):
    import ray

    class RayWorkerPolicy:  # what PolicyGroup.save raises when a rank's write fails: RayTaskError(OSError)
        def save(self, path):
            (path / "model").mkdir(parents=True)
            cause = OSError(errno.ENOSPC, "No space left on device")
            raise ray.exceptions.RayTaskError("save", "ray::PolicyWorker.save()", cause).as_instanceof_cause()

    m = CheckpointManager(tmp_path / "ckpt", run_id="r")
    with pytest.raises(CheckpointWriteError, match=r"step_1 could not be written to checkpointing.checkpoint_dir="
                                                    r".*ckpt: the disk is full \(\[Errno 28\]"):
        m.save(1, RayWorkerPolicy(), {}, "a: 1\n")
    assert not (tmp_path / "ckpt" / "step_1.tmp").exists()


def test_resume_on_a_disk_that_a_partial_checkpoint_filled(tmp_path, tmpfs):
    from nemo_fp8.config import config_to_yaml
    from nemo_fp8.trainer import prepare_run_dirs

    ckpt = tmpfs.mount("ckpt", 1)
    cfg = cfg_for(tmp_path, f"checkpointing.checkpoint_dir={ckpt}")
    yaml = config_to_yaml(cfg)
    FolderLock(ckpt, "r").acquire().release()  # the first run held it
    write_marker(ckpt, "r", "h", resumed=False)
    CheckpointManager(ckpt, run_id="r").save(1, FakePolicy(), {"dataloader": {}}, yaml)
    (ckpt / "step_2.tmp").mkdir()  # killed while saving step 2, which filled the disk
    fill_disk(ckpt / "step_2.tmp")
    setup = prepare_run_dirs(cfg, yaml, resume=True)
    try:
        assert setup.checkpoint == ckpt / "step_1" and not (ckpt / "step_2.tmp").exists()
        write_marker(ckpt, setup.run_id, "h", resumed=True, key="checkpointing.checkpoint_dir")
        assert read_marker(ckpt)["resumes"]
    finally:
        setup.release()


def test_a_marker_on_a_full_disk_names_the_key_and_folder(tmp_path, tmpfs):
    logs = tmpfs.mount("logs", 1)
    fill_disk(logs)
    with pytest.raises(RunSetupError, match=rf"logger.log_dir: cannot write {logs}/run.json: the disk is full"):
        write_marker(logs, "r", "h", resumed=False, key="logger.log_dir")
    assert sorted(p.name for p in logs.iterdir()) == ["filler"]


@pytest.mark.parametrize("key", ["logger.log_dir", "checkpointing.checkpoint_dir"])
def test_folders_on_a_read_only_file_system_are_named(tmp_path, tmpfs, key):
    from nemo_fp8.preflight import PreflightError
    from nemo_fp8.trainer import prepare_run_dirs

    ro = tmpfs.mount("ro", 1, readonly=True)
    for folder, expect in ((ro, f"{key}: {ro} is on a read-only file system"),
                           (ro / "sub", f"{key}: {ro / 'sub'} cannot be created: {ro} is on a read-only file system")):
        with pytest.raises(PreflightError) as e:
            prepare_run_dirs(cfg_for(tmp_path, f"{key}={folder}"), "", resume=False)
        assert expect in str(e.value), str(e.value)


def test_a_file_in_a_folders_place_is_named(tmp_path):
    from nemo_fp8.preflight import PreflightError
    from nemo_fp8.trainer import prepare_run_dirs

    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(PreflightError) as e:
        prepare_run_dirs(cfg_for(tmp_path, f"logger.log_dir={f}", f"checkpointing.checkpoint_dir={f / 'ckpt'}"), "",
                         resume=False)
    assert f"logger.log_dir: {f} is a file; a folder is needed" in str(e.value)
    assert f"checkpointing.checkpoint_dir: {f / 'ckpt'} cannot be created: {f} is a file" in str(e.value)


def test_the_job_refuses_a_read_only_log_dir_with_exit_2_and_no_traceback(tmp_path, tmpfs):
    ro = tmpfs.mount("ro", 1, readonly=True)
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "run_grpo_math.py"), f"logger.log_dir={ro}",
                           f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", f"policy.model_name={tmp_path / 'm'}"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"logger.log_dir: {ro} is on a read-only file system" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written


def _metrics_logger(log_dir, tensorboard: bool):
    from nemo_fp8.utils.config import LoggerConfig
    from nemo_fp8.utils.logger import MetricsLogger

    return MetricsLogger(LoggerConfig(log_dir=str(log_dir), tensorboard_enabled=tensorboard, plot_enabled=True), {})


def _assert_named_and_closes(metrics_logger, path, why: str):
    """The next row (longer than the file's last page: a full tmpfs still fits a short one) fails with a
    ``MetricsWriteError`` naming the file and ``why``, which ends the run as a known fault (no traceback);
    closing the writers afterwards does not raise over it."""
    from nemo_fp8.distributed.teardown import describe_failure
    from nemo_fp8.utils.logger import MetricsWriteError

    with pytest.raises(MetricsWriteError) as e:
        metrics_logger.log(2, {f"train/metric_{i}": 0.5 for i in range(1000)})
    assert f"the metrics file {path / 'metrics.jsonl'} (logger.log_dir) could not be written at step 2: {why}" \
        in str(e.value)
    what, traceback_helps = describe_failure(e.value)
    assert what.startswith("MetricsWriteError: the metrics file") and not traceback_helps
    metrics_logger.close()


def test_a_removed_log_dir_is_named_when_the_next_row_is_written(tmp_path):
    import shutil

    logs = tmp_path / "logs"
    metrics_logger = _metrics_logger(logs, tensorboard=True)
    metrics_logger.log(1, {"train/reward_mean": 0.5})
    shutil.rmtree(logs)
    _assert_named_and_closes(metrics_logger, logs, "FileNotFoundError: [Errno 2] No such file or directory")


def test_a_log_dir_turned_read_only_or_full_is_named(tmp_path, tmpfs):
    logs = tmpfs.mount("logs", 1)
    metrics_logger = _metrics_logger(logs, tensorboard=False)
    metrics_logger.log(1, {"train/reward_mean": 0.5})
    subprocess.run(["mount", "-o", "remount,ro", str(logs)], check=True)
    _assert_named_and_closes(metrics_logger, logs, f"the file system is read-only ([Errno {errno.EROFS}]")
    subprocess.run(["mount", "-o", "remount,rw", str(logs)], check=True)
    fill_disk(logs)
    _assert_named_and_closes(_metrics_logger(logs, tensorboard=False), logs,
                             f"the disk is full ([Errno {errno.ENOSPC}]")


def test_a_lock_on_a_removed_folder_is_released_without_raising(tmp_path):
    import shutil

    lock = FolderLock(tmp_path / "logs", "r").acquire()  # the lock creates the folder
    shutil.rmtree(tmp_path / "logs")
    lock.release()
    FolderLock(tmp_path / "logs", "r2").acquire().release()  # free again
