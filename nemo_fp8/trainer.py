"""Wiring a validated config into a running GRPO job: setup -> train -> cleanup.

``run(cfg, resume, resume_from, overwrite)`` takes ownership of the run's folders, runs the
preflight (hardware, data, model path, resources), builds the data and the reward, starts the
Ray worker groups (policy ranks and the engine) with the refit between them, restores a
checkpoint when asked and runs ``nemo_fp8.algorithms.grpo.grpo_train``. The entry point
``examples/run_grpo_math.py`` only parses arguments and calls it.
"""

from __future__ import annotations

import logging
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from nemo_fp8.algorithms.grpo import RefitController, grpo_train, prompts_batch
from nemo_fp8.config import MasterConfig, config_to_yaml
from nemo_fp8.data import (MathExample, PromptDataloader, PromptFormatter, PromptSample, load_math_file,
                           make_arithmetic_problems, tokenize_prompts)
from nemo_fp8.data.prompts import MAX_CHARS_PER_TOKEN
from nemo_fp8.generation.spec import GenerationSpec
from nemo_fp8.models.hf import load_tokenizer, resolve_device
from nemo_fp8.policy.spec import PolicySpec
from nemo_fp8.rewards.interfaces import RewardScorer
from nemo_fp8.utils.checkpoint import CheckpointManager
from nemo_fp8.utils.console import run_console
from nemo_fp8.utils.cpus import usable_cpus
from nemo_fp8.utils.logger import MetricsLogger

logger = logging.getLogger(__name__)


def ensure_model(cfg: MasterConfig) -> None:
    """Build the tiny model when ``policy.model_name`` is missing and ``tiny_model.build_if_missing``.

    Concurrent runs that need the same missing model take turns on ``<model>.build.lock``: the
    first builds it, the others wait and then use it.

    Raises:
        FileNotFoundError: the model folder is missing and may not be built.
    """
    import fcntl

    path = Path(cfg.policy.model_name)
    if (path / "config.json").is_file():
        return
    from nemo_fp8.models.hub import TINY_BUILD_HINT, is_tiny_build_target

    tiny = cfg.policy.tiny_model
    if not is_tiny_build_target(str(path), tiny.build_if_missing):
        fix = (TINY_BUILD_HINT if tiny.build_if_missing else
               "set policy.tiny_model.build_if_missing=true to build the tiny model there")
        raise FileNotFoundError(f"policy.model_name: no HF checkpoint at {path} (needs config.json); {fix}, or point "
                                "it at a local checkpoint")
    from nemo_fp8.models.tiny import TinyModelSpec, build_tiny_model

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".build.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is building the tiny model at %s; waiting for it", path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "config.json").is_file():  # built by the other process meanwhile
            return
        logger.info("building the tiny model at %s (tools/make_tiny_model.py does the same)", path)
        build_tiny_model(path, TinyModelSpec(sft_steps=tiny.sft_steps, max_operand=tiny.max_operand, seed=tiny.seed),
                         device=str(resolve_device(cfg.policy.device)))


def load_examples(cfg: MasterConfig) -> tuple[list[MathExample], list[MathExample], int]:
    """(train, validation) problems from ``data.*`` and how many rows were dropped for an empty gold answer (the
    preflight named them); validation never overlaps training."""
    d, n_val = cfg.data, cfg.grpo.max_val_samples
    if d.dataset == "synthetic":
        val = make_arithmetic_problems(d.num_synthetic_val, seed=d.seed + 1, max_operand=d.synthetic_max_operand)
        held_out = {e.problem for e in val}
        train = [e for e in make_arithmetic_problems(d.num_synthetic_train, seed=d.seed,
                                                     max_operand=d.synthetic_max_operand) if e.problem not in held_out]
        return train, val[:n_val], 0
    loaded = load_math_file(d.train_path, schema=d.dataset, limit=d.max_train_samples)
    train, empty = loaded.examples, len(loaded.empty_answer_rows)
    if d.val_path:
        val = load_math_file(d.val_path, schema=d.dataset, limit=n_val)
        return train, val.examples, empty + len(val.empty_answer_rows)
    if len(train) <= n_val:
        raise ValueError(f"data.train_path has {len(train)} problems; with no data.val_path, "
                         f"grpo.max_val_samples={n_val} are held out of it (valid: fewer than {len(train)})")
    return train[:-n_val], train[-n_val:], empty


def prepare_prompts(cfg: MasterConfig, tokenizer) -> tuple[list[PromptSample], list[PromptSample]]:
    """Format and tokenize prompts; over-long prompts are dropped and counted."""
    d = cfg.data
    formatter = PromptFormatter(d.prompt_template, use_chat_template=d.use_chat_template, system_prompt=d.system_prompt,
                                response_prefix=d.response_prefix)
    train_ex, val_ex, empty = load_examples(cfg)
    # a prompt needs room for one generated token (NeMo-RL's configs set max_input_seq_length to the total length)
    limit = min(d.max_input_seq_length, cfg.policy.max_total_sequence_length - 1)
    train, dropped_t = tokenize_prompts(train_ex, tokenizer, formatter, limit)
    val, dropped_v = tokenize_prompts(val_ex, tokenizer, formatter, limit)
    logger.info("data: %d train prompts (%d dropped > %d tokens; over %d characters: not tokenized), %d validation "
                "(%d dropped)%s", len(train), dropped_t, limit, limit * MAX_CHARS_PER_TOKEN, len(val), dropped_v,
                f"; {empty} rows with an empty gold answer dropped" if empty else "")
    if len(train) < cfg.grpo.num_prompts_per_step or not val:
        raise ValueError(f"data: {len(train)} train / {len(val)} validation prompts left after dropping those over "
                         f"data.max_input_seq_length={d.max_input_seq_length}; need >= grpo.num_prompts_per_step="
                         f"{cfg.grpo.num_prompts_per_step} and >= 1")
    return train, val


@dataclass
class Workers:
    """The run's backends (Ray worker groups) and the refit between them."""

    policy: object
    generation: object
    refitter: RefitController
    placement: object = None  # nemo_fp8.distributed.placement.Placement

    def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """Shut both groups down at once and release their placement groups; ``timeout_s`` bounds each group's
        wait for its actors' shutdown calls (the actors are ended either way), so both together wait at most that
        long: after a Ctrl-C both may be busy (asynchronous GRPO), one after the other would wait twice. Failures
        are logged, not raised."""
        from concurrent.futures import ThreadPoolExecutor

        def shut(group) -> None:
            try:
                group.shutdown(timeout_s)
            except Exception as e:  # a crashed actor must not hide the error that ended the run
                logger.warning("shutdown of %s failed: %s", type(group).__name__, e)

        with ThreadPoolExecutor(2, thread_name_prefix="shutdown") as pool:
            list(pool.map(shut, (self.generation, self.policy)))
        if self.placement is not None:
            self.placement.remove()


def make_weight_sync(cfg: MasterConfig, policy, generation):
    """The refit transport for ``policy.weight_sync`` (``auto``: by where the backends live). Calls no actor:
    ``nccl``'s group is formed afterwards (``NcclWeightSync.connect``, in ``start_workers``).

    Raises:
        ValueError: ``in_process`` requested for backends that run in Ray actors, or a transport between
            actors for backends in this process.
    """
    from nemo_fp8.distributed.weight_sync import (CudaIpcWeightSync, InProcessWeightSync, NcclWeightSync,
                                                  ObjectStoreWeightSync)
    from nemo_fp8.generation.group import GenerationGroup
    from nemo_fp8.policy.group import PolicyGroup

    ws = cfg.policy.weight_sync
    bucket_bytes = int(ws.bucket_size_mb * 2**20)
    remote = isinstance(policy, PolicyGroup) and isinstance(generation, GenerationGroup)
    if remote and ws.method == "cuda_ipc":  # config checks: vLLM TP 1, colocated, CUDA
        # engine i runs on the GPU of policy rank i (nemo_fp8.distributed.placement); every rank exports whole tensors
        return CudaIpcWeightSync(policy.workers[:generation.num_engines], generation.workers, bucket_bytes,
                                 labels=generation.labels, packed=ws.packed, pack_in_place=ws.pack_in_place)
    if remote and ws.method == "nccl":  # config checks: vLLM, not colocated, CUDA
        return NcclWeightSync(policy.weight_source, generation.workers, bucket_bytes,
                              engine_gpus=cfg.policy.generation.engine_gpus, peers=policy.weight_peers,
                              labels=generation.labels)
    if remote and ws.method in ("auto", "object_store"):
        return ObjectStoreWeightSync(policy.weight_source, generation.workers, bucket_bytes, peers=policy.weight_peers,
                                     labels=generation.labels)
    if not remote and ws.method in ("auto", "in_process"):
        return InProcessWeightSync(policy, generation, bucket_bytes)
    valid = "'auto', 'object_store', 'cuda_ipc', 'nccl'" if remote else "'auto', 'in_process'"
    raise ValueError(f"policy.weight_sync.method={ws.method!r} does not fit backends that run "
                     f"{'in Ray actors' if remote else 'in this process'} (valid: {valid})")


def generation_spec(cfg: MasterConfig, tokenizer, device: Optional[torch.device]) -> GenerationSpec:
    """Every engine's backend arguments for ``cfg`` (built inside the engine actors, ``build_generation_backend``).

    A vLLM engine gets ``weight_transfer``: ``"nccl"`` for ``policy.weight_sync.method: nccl`` (vLLM's
    ``weight_transfer_config`` backend: the trainer's NCCL broadcast, no initial load), else ``"ipc"``.
    """
    gen_cfg = cfg.policy.generation
    return GenerationSpec(
        backend=gen_cfg.backend, model_name=cfg.policy.model_name, vllm_cfg=gen_cfg.vllm_cfg, device=device,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        max_total_sequence_length=cfg.policy.max_total_sequence_length, batch_size=cfg.policy.generation_batch_size,
        offload_when_idle=gen_cfg.colocated.enabled, reference_dtype=gen_cfg.reference_dtype,
        sglang_cfg=gen_cfg.sglang_cfg,
        weight_transfer=("nccl" if cfg.policy.weight_sync.method == "nccl" else "ipc") if gen_cfg.backend == "vllm"
        else None)


def policy_spec(cfg: MasterConfig, device: torch.device) -> PolicySpec:
    """Every policy rank's backend arguments for ``cfg`` (built inside the rank actors, ``build_policy_backend``):
    the ``policy`` section, the rollout's temperature, a reference model when the KL penalty is on, the seed, and
    the facts derived from them once (``PolicySpec.from_config``)."""
    return PolicySpec.from_config(cfg.policy, device, temperature=cfg.policy.generation.temperature,
                                  keep_reference=cfg.loss_fn.reference_policy_kl_penalty > 0, seed=cfg.grpo.seed)


def start_workers(cfg: MasterConfig, tokenizer, version: int = 0) -> Workers:
    """Start Ray, the placement groups, the policy's ranks and the engines (``start_groups``'s order).

    On a GPU host the engines are colocated with the policy (engine i on the GPUs of ranks
    ``i*n..(i+1)*n-1``, ``n = tensor_parallel_size``) unless ``policy.generation.colocated.enabled`` is false,
    when they get GPUs of their own (``policy.generation.colocated.resources``); ``plan_from_config`` says how many.
    With ``policy.weight_sync.method: nccl`` the refit's NCCL group (policy rank 0 + every engine's workers) is
    formed once both groups exist; the engines hold no weights until the first refit (the ``RefitController``
    starts stale, so that refit, of ``version``, runs before the first rollout).
    """
    from nemo_fp8.distributed.cluster import init_ray
    from nemo_fp8.distributed.placement import create_placement_group, plan_from_config
    from nemo_fp8.distributed.weight_sync import NcclWeightSync
    from nemo_fp8.policy.group import start_groups

    device = resolve_device(cfg.policy.device)
    init_ray(cfg.cluster.address, cfg.cluster.num_cpus)
    gen_cfg = cfg.policy.generation
    colocated = gen_cfg.colocated.enabled
    plan = plan_from_config(cfg.policy, cfg.cluster, device.type == "cuda")
    pg = create_placement_group(plan)
    # Engine and trainer take turns (never run at once); data-parallel ranks and pipeline stages train side by side.
    # Asynchronous GRPO runs the engines beside the ranks: the CPUs are shared among all of them.
    ranks = cfg.policy.data_parallel_size * cfg.policy.pipeline_parallel_size
    side_by_side = ranks + (plan.num_engines if cfg.grpo.async_grpo.enabled else 0)
    threads = cfg.cluster.torch_threads_per_worker or max(1, usable_cpus() // side_by_side)
    policy, generation = start_groups(pg, plan, policy_spec(cfg, device), generation_spec(cfg, tokenizer, device),
                                      torch_threads=threads)
    weight_sync = make_weight_sync(cfg, policy, generation)
    if isinstance(weight_sync, NcclWeightSync):
        weight_sync.connect()
    refitter = RefitController(policy, generation, weight_sync, version=version,
                               requires_kv_scales=gen_cfg.vllm_cfg.kv_cache_is_fp8,
                               offload_trainer=gen_cfg.colocated.moves_trainer_state,
                               colocated=colocated, sleep_discards_weights=gen_cfg.sleep_discards_weights)
    return Workers(policy, generation, refitter, pg)


@dataclass
class RunSetup:
    """What ``prepare_run_dirs`` decided: the run id, the checkpoint to resume (None: step 0), the
    locks held on the folders, and the config changes a resume applies."""

    run_id: str
    checkpoint: Path | None
    start_step: int
    locks: list
    changes: dict

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


def prepare_run_dirs(cfg: MasterConfig, config_yaml: str, resume: bool, resume_from: str | None = None,
                     overwrite: bool = False) -> RunSetup:
    """Lock the log and checkpoint folders and decide what this run continues.

    Fresh run: refuses folders with another run's checkpoints or metrics (unless ``overwrite``).
    Resume: picks the newest checkpoint (or ``resume_from``), checks its files, compares its
    config with ``cfg`` (changes that cannot apply are errors, the others are logged), and moves
    aside metrics rows that will be written again. A run that was started but never checkpointed
    restarts from step 0.

    Removes the partial ``step_<N>.tmp`` folders a save that did not finish left (``remove_partial``).

    Raises:
        PreflightError: a folder that cannot be written (a file in its place, a read-only file system), naming
            its key (``check_run_folders``).
        RunSetupError: folder in use by another run (pid, host), mixing with another run, no
            checkpoint to resume, corrupt checkpoint (file, what is wrong, the older one to use).
        ConfigError: the new config changes keys that cannot change on resume.
    """
    from nemo_fp8.config import resume_changes
    from nemo_fp8.preflight import check_run_folders
    from nemo_fp8.utils.checkpoint import verify_checkpoint
    from nemo_fp8.utils.logger import repair_metrics
    from nemo_fp8.utils.run_dir import (FolderLock, RunSetupError, claim_fresh, new_run_id, os_error_reason,
                                        read_marker)

    check_run_folders(cfg)
    log_dir = Path(cfg.logger.log_dir)
    ckpt_dir = Path(cfg.checkpointing.checkpoint_dir) if cfg.checkpointing.enabled else None
    resume = resume or resume_from is not None
    if resume and ckpt_dir is None:
        raise RunSetupError("--resume needs checkpointing.enabled=true (this config writes no checkpoints)")
    marker = ((read_marker(ckpt_dir) if ckpt_dir else None) or read_marker(log_dir)) if resume else None
    run_id = (marker or {}).get("run_id") or new_run_id()
    folders = [("checkpointing.checkpoint_dir", ckpt_dir), ("logger.log_dir", log_dir)] \
        if ckpt_dir is not None and ckpt_dir.resolve() != log_dir.resolve() else [("logger.log_dir", log_dir)]
    locks: list = []
    try:
        for key, folder in folders:
            try:
                locks.append(FolderLock(folder, run_id).acquire())
            except OSError as e:  # what check_run_folders cannot see (a full disk)
                raise RunSetupError(f"{key}: cannot lock {folder}: {os_error_reason(e)}") from None
        if ckpt_dir is not None:  # ours now: a save that did not finish left these (on a full disk, its space)
            CheckpointManager(ckpt_dir).remove_partial()
        checkpoint, start_step, changes = None, 0, {}
        if not resume:
            claim_fresh(log_dir, ckpt_dir, overwrite)
            return RunSetup(run_id, None, 0, locks, {})
        checkpointer = CheckpointManager(ckpt_dir, cfg.checkpointing.keep_last_k)
        checkpoint = checkpointer.resolve(resume_from) if resume_from else checkpointer.latest()
        if checkpoint is None:
            if marker is None:
                raise RunSetupError(f"--resume: no checkpoint and no run under checkpointing.checkpoint_dir="
                                    f"{ckpt_dir}; check the folder name, or start without --resume")
            logger.warning("--resume: run %s wrote no checkpoint yet; restarting it from step 0", run_id)
        else:
            state = verify_checkpoint(checkpoint)
            start_step = int(state["step"])
            run_id = state.get("run_id") or run_id
            changes = resume_changes((checkpoint / "config.yaml").read_text(), cfg, start_step)
            for key, (old, new) in changes.items():
                logger.warning("--resume: %s changed from %r to %r (applies from step %d)", key, old, new,
                               start_step + 1)
        log_owner = (read_marker(log_dir) or {}).get("run_id")
        if log_owner and log_owner != run_id:
            raise RunSetupError(f"logger.log_dir={log_dir} belongs to run {log_owner}, but the checkpoint "
                                f"{checkpoint} to run {run_id}; use that run's log folder")
        repair_metrics(log_dir / "metrics.jsonl", start_step)
        return RunSetup(run_id, checkpoint, start_step, locks, changes)
    except BaseException:
        for lock in locks:
            lock.release()
        raise


class RewardStatsLogger:
    """Wraps a ``MetricsLogger``: each logged step also gets the reward scorer's counts since the
    last one (``reward/num_timeouts``, ``reward/num_over_step_budget``, ``reward/num_errors``)."""

    def __init__(self, inner, scorer: RewardScorer):
        self.inner, self.scorer = inner, scorer

    def log(self, step: int, metrics: dict[str, float]) -> None:
        stats = self.scorer.pop_stats()
        self.inner.log(step, {**metrics, **{f"reward/{k}": v for k, v in stats.items()}})

    def close(self):
        return self.inner.close()


def interrupt_hint(cfg: MasterConfig, checkpointer: CheckpointManager, run_id: str) -> str:
    """What a user can do after an interrupt, accurate for the checkpointing settings."""
    if not cfg.checkpointing.enabled:
        return "checkpointing is off (checkpointing.enabled=false): nothing to resume from"
    mine = [s for s in checkpointer.steps() if checkpointer.run_id_of(s) == run_id]
    if not mine:
        return "no checkpoint written yet; --resume restarts this run from step 0"
    return f"last checkpoint: {checkpointer.root / f'step_{mine[-1]}'}; continue with --resume"


def run(cfg: MasterConfig, resume: bool = False, resume_from: str | None = None,
        overwrite: bool = False) -> dict[str, float]:
    """Run the GRPO job described by ``cfg``; returns the last step's metrics.

    Order: folders locked and checked (``prepare_run_dirs``) -> preflight (data, model path,
    resources) -> model build -> Ray and actors -> restore -> train.

    Raises:
        RunSetupError: see ``prepare_run_dirs`` and ``nemo_fp8.preflight.preflight``.
        ConfigError: a resume changes keys that cannot change.
        RunFailed: a part failed after the start (a Ray worker or engine died, a checkpoint did not fit, the reward
            scorer raised, ...); one line naming it, with the resume hint (``describe_failure``).
        KeyboardInterrupt: Ctrl-C; ``Terminated`` (a KeyboardInterrupt) on SIGTERM.
    """
    from nemo_fp8.utils.run_dir import raise_on_sigterm

    random.seed(cfg.grpo.seed)
    torch.manual_seed(cfg.grpo.seed)
    raise_on_sigterm()
    config_yaml = config_to_yaml(cfg)
    setup = prepare_run_dirs(cfg, config_yaml, resume, resume_from, overwrite)
    try:
        with run_console(Path(cfg.logger.log_dir) / "console.log") as log_file:  # every record and line; one bar
            return _run_checked(cfg, setup, config_yaml, resume, resume_from, log_file)
    finally:
        setup.release()


def _run_checked(cfg: MasterConfig, setup: RunSetup, config_yaml: str, resume: bool,
                 resume_from: Optional[str], log_file) -> dict[str, float]:
    """``run`` once the folders are owned: the preflight, the folders' markers and the log file (``log_file``, a
    ``nemo_fp8.utils.console.LogFile``: a refused run leaves no folder behind), then the run itself."""
    from nemo_fp8.preflight import preflight, with_local_model
    from nemo_fp8.utils.run_dir import config_hash, write_marker

    preflight(cfg)
    cfg = with_local_model(cfg)  # a hub id -> its snapshot folder; the saved config keeps the id
    resumed = setup.checkpoint is not None or resume or resume_from is not None
    folders = {cfg.logger.log_dir: "logger.log_dir"}
    if cfg.checkpointing.enabled:
        folders.setdefault(cfg.checkpointing.checkpoint_dir, "checkpointing.checkpoint_dir")
    for folder, key in folders.items():
        write_marker(folder, setup.run_id, config_hash(config_yaml), resumed=resumed, key=key)
    log_file.open()
    logger.info("run %s (config %s)%s", setup.run_id, config_hash(config_yaml),
                f", resuming from {setup.checkpoint}" if setup.checkpoint else "")
    return _run_owned(cfg, setup, config_yaml)


class GuardedScorer:
    """Wraps the reward scorer: an exception it raises becomes ``RunFailed`` naming the scorer and the exception
    (the run then stops with that message, not a bare traceback after Ray's teardown)."""

    def __init__(self, scorer):
        self.scorer = scorer

    def __call__(self, responses: list[str], ground_truths: list[str]) -> list[float]:
        """The scorer's rewards.

        Raises:
            RunFailed: the scorer raised (its type and message named; the original is the cause).
        """
        from nemo_fp8.utils.run_dir import RunFailed

        try:
            return self.scorer(responses, ground_truths)
        except Exception as e:
            raise RunFailed(f"the reward scorer ({type(self.scorer).__name__}, env.math) raised "
                            f"{type(e).__name__}: {e}") from e


def _stop_error(e: BaseException, hint: str, watchdog, workers) -> BaseException:
    """What ``_run_owned`` raises for ``e``; the message is logged here, before Ray is torn down (the teardown takes
    seconds, and a Ray half gone could end the process first). SIGTERM: ``Terminated``; Ctrl-C: ``e`` (a second
    Ctrl-C now ends the process at once, ``SignalWatchdog``); setup errors: ``e``; anything else: ``RunFailed``
    naming what failed (``describe_failure``) with the resume ``hint``, and the traceback logged when it helps."""
    from nemo_fp8.distributed.teardown import actor_names, describe_failure
    from nemo_fp8.utils.run_dir import RunFailed, RunSetupError, Terminated

    if isinstance(e, Terminated) or watchdog.fired.is_set():
        logger.warning("terminated; %s", hint)
        return Terminated()
    if isinstance(e, KeyboardInterrupt):
        watchdog.absorb_interrupts()
        logger.warning("interrupted; %s", hint)
        return e
    if isinstance(e, RunSetupError):
        return e
    what, unexpected = describe_failure(e, actor_names(workers))
    logger.error("%s; stopping the run", what, exc_info=e if unexpected else None)
    return RunFailed(f"{what}; {hint}")


@contextmanager
def _logged_if_slow(what: str, over_s: float = 2.0):
    """Log a teardown phase that took ``over_s`` seconds or more: after Ctrl-C the watchdog ends a cleanup that
    runs 20 s (``SignalWatchdog``), and these lines say which phase took the time."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        took_s = time.monotonic() - t0
        if took_s >= over_s:
            logger.info("teardown: %s took %.1f s", what, took_s)


def _end_ray(procs, watchdog, workers: Optional[Workers], graceful_wait_s: Optional[float]) -> None:
    """Tear Ray down: ``graceful_teardown`` when ``graceful_wait_s`` is set (the actors still answer: done or Ctrl-C;
    it bounds each wait), else ``fast_teardown``; then stop the watchdog and let the reaper go."""
    from nemo_fp8.distributed.teardown import fast_teardown, graceful_teardown

    with _logged_if_slow("shutting the actors and Ray down"):
        if graceful_wait_s is not None:
            graceful_teardown(workers, procs, graceful_wait_s)
        else:
            fast_teardown(procs, shutdown_timeout_s=2.0 if watchdog.fired.is_set() else 5.0)
    watchdog.stop()
    procs.close_reaper()


def _training_loop(cfg: MasterConfig, checkpoint: Optional[Path], state: Optional[dict], start_step: int,
                   changes: dict):
    """(the loop to run, its extra keyword arguments): ``grpo_train``, or with ``grpo.async_grpo.enabled`` (generation
    ahead of training on engines of their own) ``async_grpo_train`` with the rollouts the resumed ``checkpoint``'s
    collector had made ahead, where they can be used (``restorable_ahead``, which logs why not).

    Raises:
        CheckpointError: the checkpoint's rollouts made ahead cannot be read.
    """
    from nemo_fp8.algorithms.async_state import STATE_KEY, restorable_ahead

    if not cfg.grpo.async_grpo.enabled:
        saved = (state or {}).get(STATE_KEY) or {}
        if saved.get("steps_ahead") or saved.get("partial_step") is not None:
            logger.info("--resume: the rollouts an asynchronous run made ahead of %s are not used by the synchronous "
                        "loop; it makes step %d's rollouts again from the same prompts", checkpoint, start_step + 1)
        return grpo_train, {}
    from nemo_fp8.algorithms.async_grpo import async_grpo_train, effective_max_age

    if checkpoint is None:
        return async_grpo_train, {}
    return async_grpo_train, {"ahead": restorable_ahead(checkpoint, state, start_step, effective_max_age(cfg),
                                                        cfg.grpo.max_num_steps, changes)}


def _run_owned(cfg: MasterConfig, setup: RunSetup, config_yaml: str) -> dict[str, float]:
    """The body of ``run`` once the folders are owned and the preflight passed."""
    from nemo_fp8.distributed.teardown import RayProcesses, SignalWatchdog
    from nemo_fp8.distributed.cluster import init_ray
    from nemo_fp8.preflight import check_cluster
    from nemo_fp8.rewards import MathRewardScorer
    from nemo_fp8.utils.run_dir import RunSetupError, Terminated, raise_on_sigterm

    ensure_model(cfg)
    tokenizer = load_tokenizer(cfg.policy.tokenizer.name or cfg.policy.model_name)
    try:
        train, val = prepare_prompts(cfg, tokenizer)
    except ValueError as e:  # the preflight parsed the files; what is left: too few prompts after tokenizing
        raise RunSetupError(str(e)) from None
    dataloader = PromptDataloader(train, cfg.grpo.num_prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    checkpointer = CheckpointManager(cfg.checkpointing.checkpoint_dir, cfg.checkpointing.keep_last_k,
                                     run_id=setup.run_id)
    latest = setup.checkpoint

    start_step, state = 0, None
    if latest is not None:
        state = CheckpointManager.load_trainer_state(latest)
        start_step = int(state["step"])
    procs = RayProcesses(reaper=True)
    hint = lambda: interrupt_hint(cfg, checkpointer, setup.run_id)  # noqa: E731
    watchdog = SignalWatchdog(procs, hint)
    try:
        init_ray(cfg.cluster.address, cfg.cluster.num_cpus)
        raise_on_sigterm()  # ray.init replaced it with sys.exit
        procs.record()
        watchdog.start()
        check_cluster(cfg)
        workers = start_workers(cfg, tokenizer, version=start_step)
        procs.record()
    except BaseException as e:
        err = _stop_error(e, hint(), watchdog, None)
        _end_ray(procs, watchdog, None, None)
        raise err from None
    metrics_logger = scorer = None
    graceful_wait_s = None  # None: fast teardown; else a graceful one, each wait at most this long
    try:
        if latest is not None:
            workers.policy.load(latest / "policy")
            dataloader.load_state_dict(state["dataloader"])
            logger.info("resumed from %s (step %d)", latest, start_step)
        if workers.refitter.requires_kv_scales:  # FP8 KV: scales for the starting weights, from the first prompts
            first = train[: cfg.grpo.num_prompts_per_step]
            workers.refitter.mark_stale(start_step, workers.policy.calibrate_kv_scales(
                prompts_batch(first, tokenizer.pad_token_id), start_step,
                cfg.policy.generation.vllm_cfg.kv_scale_margin))
        metrics_logger = MetricsLogger(cfg.logger, cfg.model_dump(mode="json"), resume=latest is not None)
        (Path(cfg.logger.log_dir) / "config.yaml").write_text(config_yaml)
        scorer = MathRewardScorer(num_workers=cfg.env.math.num_workers, timeout_s=cfg.env.math.timeout_s,
                                  max_seconds_per_step=cfg.env.math.max_seconds_per_step)
        train, resumed = _training_loop(cfg, latest, state, start_step, setup.changes)
        out = train(cfg, workers.policy, workers.generation, GuardedScorer(scorer), tokenizer, dataloader, val,
                    RewardStatsLogger(metrics_logger, scorer), checkpointer, start_step, config_yaml,
                    workers.refitter, **resumed)
        graceful_wait_s = 30.0
        return out
    except BaseException as e:
        # SIGTERM gets no graceful calls to the actors (a SIGTERM to every process may have taken Ray's GCS; one to
        # the process group misses it: cluster.init_ray). Ray turns a signal inside ray.get into a plain
        # KeyboardInterrupt, and a dying actor may surface first as an actor error: the watchdog tells them apart.
        err = _stop_error(e, hint(), watchdog, workers)
        if isinstance(err, KeyboardInterrupt) and not isinstance(err, Terminated):
            graceful_wait_s = 5.0  # the actors may be busy with the interrupted call: do not wait for it long
        raise err from None
    finally:
        if metrics_logger is not None:
            with _logged_if_slow("writing the curves"):
                png = metrics_logger.close()
            if png:
                logger.info("curves: %s", png)
        if scorer is not None:
            with _logged_if_slow("stopping the reward workers"):
                scorer.close()
        _end_ray(procs, watchdog, workers, graceful_wait_s)
