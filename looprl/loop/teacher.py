"""On-policy distillation's teacher (`algo.teacher`): a model alias, a local folder, or a
run folder (its base model with its newest checkpoint), loaded frozen beside the student
on the student's device and dtype; or a server's URL (loop/teacher_server.py). The update
scores the student's own episodes with it (loop/update.py, algo/distill.py).

The teacher must share the student's tokenizer: distillation compares the log-probs the
two give the *same token ids*. `check_teacher` compares the vocabularies before anything
is written or any weights load; a mismatch is refused with the first tokens that differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from looprl.config import Config, config_from_dict, load_config
from looprl.envs import capabilities, make_env
from looprl.errors import ConfigError, EndpointError
from looprl.loop.checkpoint import list_checkpoints, load_weights
from looprl.loop.dist import main_only
from looprl.loop.evaluate import HeldOut, evaluate
from looprl.loop.play import player
from looprl.loop.policy import Policy, load_policy, make_engine
from looprl.loop.progress import DONE, Progress
from looprl.loop.remote import run_remote_eval
from looprl.loop.teacher_server import ServerTeacher, is_server
from looprl.model.load import load_tokenizer


def teacher_config(cfg: Config) -> tuple[Config, Path | None]:
    """The config the teacher loads with (a run folder's own, else a plain model's) and
    the run folder's newest checkpoint, if any."""
    spec = str(cfg.algo.teacher)
    path = Path(spec).expanduser()
    device = [f"model.device={cfg.model.device}", f"model.dtype={cfg.model.dtype}"]
    if (path / "config.yaml").is_file():
        teacher = load_config(path / "config.yaml", [*device, "model.gradient_checkpointing=false"])
        found = list_checkpoints(path)
        return teacher, found[-1] if found else None
    if path.exists() and not path.is_dir():
        raise ConfigError(f"algo.teacher={spec!r} is a file: name a model, a folder or a run")
    model = {"name": spec, "device": cfg.model.device, "dtype": cfg.model.dtype}
    return config_from_dict({"model": {**model, "lora": {"enabled": False}}}), None


def check_teacher(cfg: Config) -> None:
    """Refuse a teacher whose tokenizer is not the student's (module doc); a server's is
    probed once it is connected (loop/teacher_server.py)."""
    if not cfg.algo.teacher or is_server(cfg.algo.teacher):
        return
    teacher_cfg, _ = teacher_config(cfg)
    student = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
    teacher = load_tokenizer(teacher_cfg.model.name, teacher_cfg.model.trust_remote_code)
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine == theirs:
        return
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
    raise ConfigError(
        f"algo.teacher={cfg.algo.teacher!r} has another tokenizer than the student "
        f"{cfg.model.name!r} ({len(theirs):,} against {len(mine):,} tokens; first "
        f"differences: {', '.join(f'{tok!r}={i}' for tok, i in differ)}): on-policy "
        "distillation compares the log-probs of the same token ids, so teacher and student "
        "need one tokenizer; pick a teacher of the student's family"
    )


def load_teacher(cfg: Config, progress: Progress) -> Any:
    """The teacher's model, frozen and in eval mode, or its server, connected and its
    tokenizer probed (None without `algo.teacher`)."""
    if not cfg.algo.teacher:
        return None
    if is_server(cfg.algo.teacher):
        with progress.phase("connect to the teacher's server") as phase:
            student = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
            server = ServerTeacher.connect(cfg.algo.teacher, student)
            phase.done(f"{server.model} at {server.url}, the student's tokenizer")
        return server
    teacher_cfg, checkpoint = teacher_config(cfg)
    with progress.phase("load teacher") as phase:
        policy = load_policy(teacher_cfg)
        if checkpoint is not None:
            try:
                load_weights(policy.model, checkpoint)
            except ValueError as err:
                raise ConfigError(f"algo.teacher: {err}") from None
        model = policy.model.eval()
        model.requires_grad_(False)
        where = f" + {checkpoint.name}" if checkpoint is not None else ""
        phase.done(f"{teacher_cfg.model.name}{where} on {policy.device}")
    return model


def evaluate_teacher(held_out: HeldOut) -> dict | None:
    """The teacher's own reward on the run's held-out episodes, once (a resumed run reads
    eval/teacher.json back): the report's reference row, paired with the trained model.
    A local teacher plays them as the student does (the same tasks, sampling seeds, chat
    template and engine settings); a server teacher through its chat API, as `looprl eval
    --endpoint` plays a reference (loop/remote.py: text, not token ids)."""
    cfg, policy, run_dir = held_out.cfg, held_out.policy, held_out.run_dir
    progress = held_out.progress
    teacher = policy.teacher
    if teacher is None:
        return None
    kept = held_out.read(run_dir, "teacher")
    if kept is not None:
        progress.note(f"{DONE} teacher eval: kept from {run_dir / 'eval' / 'teacher.json'}")
        return kept
    probe = make_env(cfg.env.name, cfg.env.args)
    if isinstance(teacher, ServerTeacher):
        caps = capabilities(probe)
        if caps.agent or caps.group_judge:
            what = "an agent environment" if caps.agent else "a judge with mode: group"
            progress.note(f"teacher eval skipped: a server teacher is not played on {what}")
            return None
        out = run_dir / "eval" / "teacher.json"
        try:
            return main_only(run_remote_eval)(
                cfg, teacher.url, teacher.model, out, progress=progress
            )
        except EndpointError as err:  # its report row only: the distillation needs no chat
            progress.note(f"teacher eval failed, the report has no teacher row: {err}")
            return None
    engine = make_engine(cfg, teacher, policy.tokenizer, policy.renderer)
    own = Policy(teacher, policy.tokenizer, policy.renderer, engine, policy.device)
    named = cfg.model.model_copy(update={"name": str(cfg.algo.teacher)})  # its EvalResult's
    as_teacher = cfg.model_copy(update={"model": named})
    play = player(as_teacher, own, probe)
    return evaluate(own, play, held_out.tasks, as_teacher, run_dir, "teacher", progress)
