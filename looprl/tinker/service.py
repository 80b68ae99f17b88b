"""The Tinker server's state and its work queue.

Every request that touches a model runs on one worker thread, one at a time: the weights a
sampler swaps in and out, the gradients a forward_backward accumulates and the step that
applies them never interleave. A training client numbers its requests (`seq_id` 1, 2, …);
they are queued in that order whatever order they arrive in (`SeqGate`). A request that
answers later (a "future") gets a request id at once; its result (JSON, protobuf bytes, or
an error the SDK raises as `RequestFailedError`) waits in `results` for the client's poll.
"""

from __future__ import annotations

import concurrent.futures
import gc
import hashlib
import json
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from looprl.errors import LoopRLError, ModelError, RequestError
from looprl.loop.checkpoint import export_model
from looprl.model.load import ALIASES, load_causal_lm, load_tokenizer
from looprl.model.memory import release_free_memory
from looprl.tinker.sampling import Sampler, sample_batch
from looprl.tinker.training import LoraShape, TrainedModel

log = logging.getLogger("looprl.tinker")

# a training client's request that arrives ahead of one it follows waits this long for it;
# then the queue goes on without it (a client that skipped a number must not hang)
GAP_TIMEOUT_S = 5.0


@dataclass
class Result:
    """A finished request: a JSON body, protobuf bytes, or an error message."""

    body: dict[str, Any] | bytes | None = None
    error: str | None = None
    category: str = "user"


@dataclass
class SeqGate:
    """One training client's queue: jobs released in `seq_id` order."""

    next_seq: int = 1
    pending: dict[int, Callable[[], None]] = field(default_factory=dict)
    waiting_since: float = 0.0


class Service:
    """Sessions, training clients, samplers and futures of one Tinker server."""

    def __init__(self, store: Path, dtype: torch.dtype, served: list[str]) -> None:
        self.store = store
        self.dtype = dtype
        self.served = served
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tinker")
        self.lock = threading.Lock()
        self.results: dict[str, concurrent.futures.Future] = {}
        self.gates: dict[str, SeqGate] = {}
        self.models: dict[str, TrainedModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.snapshots: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
        self.bases: dict[str, tuple[Any, Any]] = {}
        self.tokenizers: dict[str, Any] = {}
        self.sessions: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, float] = {}  # training run (model) id → last request time
        # asample requests waiting, by sampler: the worker runs all of a sampler's at once
        self.inbox: dict[str, list[tuple[dict[str, Any], concurrent.futures.Future]]] = {}

    # ---- futures and ordering -----------------------------------------------------------

    def submit(
        self, work: Callable[[], dict | bytes], model_id: str | None = None, seq_id: int = 0
    ) -> str:
        """Queue `work`; its result, once done, is kept under the returned request id."""
        request_id = uuid.uuid4().hex
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.results[request_id] = future

        def job() -> None:
            future.set_result(self.run(work))

        if model_id is None or not seq_id:
            self.worker.submit(job)
            return request_id
        with self.lock:
            gate = self.gates.setdefault(model_id, SeqGate())
            if seq_id < gate.next_seq:  # a number already passed: run it now, in turn
                self.worker.submit(job)
                return request_id
            gate.pending[seq_id] = job
            self._release(gate)
            if gate.pending and not gate.waiting_since:
                gate.waiting_since = time.monotonic()
                threading.Timer(GAP_TIMEOUT_S, self._skip_gap, (model_id,)).start()
        return request_id

    def submit_sample(self, body: dict[str, Any]) -> str:
        """Queue an `asample` request. The worker takes every request waiting for the same
        sampler when it gets to the first, and samples them as one batch: a recipe's
        concurrent one-sample requests share the engine's forward passes."""
        request_id = uuid.uuid4().hex
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.results[request_id] = future
        key = body.get("sampling_session_id") or (
            f"direct:{body.get('model_path') or body.get('base_model')}"
        )
        with self.lock:
            self.inbox.setdefault(key, []).append((body, future))
        self.worker.submit(self._sample_waiting, key)
        return request_id

    def _sample_waiting(self, key: str) -> None:
        with self.lock:
            waiting = self.inbox.pop(key, [])
        if not waiting:  # an earlier turn took them
            return
        outcome = self.run(lambda: self._sample_all(key, [body for body, _ in waiting]))
        for i, (_, future) in enumerate(waiting):
            if outcome.error is not None:
                future.set_result(outcome)
                continue
            answer = outcome.body[i]
            future.set_result(self.run(lambda a=answer: _raise_or(a)))

    def _sample_all(self, key: str, bodies: list[dict[str, Any]]) -> list[bytes | Exception]:
        if key.startswith("direct:"):
            first = bodies[0]
            sampler = self.samplers.get(key) or self.new_sampler(
                key, first.get("base_model"), first.get("model_path")
            )
        else:
            sampler = self.sampler(key)
        return sample_batch(sampler, bodies)

    def _release(self, gate: SeqGate) -> None:
        while gate.next_seq in gate.pending:
            self.worker.submit(gate.pending.pop(gate.next_seq))
            gate.next_seq += 1
        if not gate.pending:
            gate.waiting_since = 0.0

    def _skip_gap(self, model_id: str) -> None:
        with self.lock:
            gate = self.gates[model_id]
            if gate.pending and time.monotonic() - gate.waiting_since >= GAP_TIMEOUT_S - 0.1:
                log.warning(
                    "model %s: seq_id %d never came; going on with %d",
                    model_id,
                    gate.next_seq,
                    min(gate.pending),
                )
                gate.next_seq = min(gate.pending)
                gate.waiting_since = 0.0
                self._release(gate)
            if gate.pending and not gate.waiting_since:
                gate.waiting_since = time.monotonic()
                threading.Timer(GAP_TIMEOUT_S, self._skip_gap, (model_id,)).start()

    @staticmethod
    def run(work: Callable[[], dict | bytes]) -> Result:
        """`work`'s result, or its failure as the error the client will raise."""
        try:
            return Result(body=work())
        except (RequestError, ModelError) as err:
            return Result(error=str(err), category="user")
        except LoopRLError as err:
            return Result(error=str(err), category="server")
        except Exception as err:  # a server bug: said to the client, traceback in the log
            log.error("request failed:\n%s", traceback.format_exc())
            return Result(error=f"server error: {type(err).__name__}: {err}", category="server")

    def call(self, work: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `work` on the worker (for sync routes that touch a model)."""
        return self.worker.submit(work)

    # ---- models -------------------------------------------------------------------------

    def source(self, name: str) -> str:
        """What loads for `base_model` `name`: an alias or a model folder as is; a looprl
        run folder (its config.yaml and checkpoints/) as its newest checkpoint's model,
        LoRA merged, exported once into the store (`looprl export`'s folder)."""
        folder = Path(name).expanduser()
        if name in ALIASES or (folder.is_dir() and not (folder / "config.yaml").exists()):
            return name
        if folder.is_dir() and (folder / "checkpoints").is_dir():
            key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
            out = self.store / "exported" / f"{folder.name}-{key}"
            if not (out / "config.json").exists():
                export_model(folder, out)
            return str(out)
        if folder.is_dir():
            raise RequestError(f"run folder {name!r} has no checkpoint to train from yet")
        raise RequestError(
            f"unknown model {name!r}: this server loads looprl's aliases "
            f"({', '.join(ALIASES)}), local model folders and looprl run folders; pass one "
            "as base_model"
        )

    def tokenizer(self, name: str) -> Any:
        if name not in self.tokenizers:
            self.tokenizers[name] = load_tokenizer(self.source(name))
        return self.tokenizers[name]

    def tokenizer_id(self, name: str) -> str:
        """A local folder `AutoTokenizer.from_pretrained` loads: the model's folder if it
        holds a tokenizer, else a copy saved in the store."""
        folder = Path(self.source(name)).expanduser()
        if folder.is_dir() and any(folder.glob("tokenizer*")):
            return str(folder.resolve())
        out = self.store / "tokenizers" / name.replace("/", "_")
        if not (out / "tokenizer_config.json").exists():
            self.tokenizer(name).save_pretrained(out)
        return str(out.resolve())

    def load_base(self, name: str) -> Any:
        """A fresh copy of `name`'s weights (each training client adapts its own)."""
        model = load_causal_lm(self.source(name), self.dtype)
        model.requires_grad_(False)
        return model

    def base_sampler_model(self, name: str) -> Any:
        if name not in self.bases:
            self.bases[name] = self.load_base(name).eval()
        return self.bases[name]

    def create_model(self, model_id: str, base_model: str, lora: LoraShape) -> TrainedModel:
        tok = self.tokenizer(base_model)
        trained = TrainedModel.create(
            model_id, base_model, self.load_base(base_model), lora, tok.pad_token_id
        )
        self.models[model_id] = trained
        self.runs[model_id] = time.time()
        return trained

    def model(self, model_id: str) -> TrainedModel:
        if model_id not in self.models:
            raise RequestError(
                f"unknown model_id {model_id!r}: create it first (create_lora_training_client)"
            )
        self.runs[model_id] = time.time()
        return self.models[model_id]

    def forget(self, session_id: str) -> None:
        """A finished session's training clients and samplers leave memory (their saved
        states stay in the store)."""
        prefix = f"{session_id}:"
        for table in (self.models, self.samplers):
            for key in [k for k in table if k.startswith(prefix)]:
                del table[key]
        self.snapshots = {
            path: kept for path, kept in self.snapshots.items() if not kept[0].startswith(prefix)
        }
        gc.collect()
        release_free_memory()

    # ---- checkpoints --------------------------------------------------------------------

    def folder(self, path: str) -> Path:
        """The store folder of `tinker://MODEL/weights/NAME` (or `sampler_weights`)."""
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or "" in parts or ".." in parts:
            raise RequestError(
                f"checkpoint path {path!r}: expected tinker://MODEL_ID/weights/NAME or "
                "tinker://MODEL_ID/sampler_weights/NAME, as save_state returns"
            )
        if parts[1] not in ("weights", "sampler_weights"):
            raise RequestError(f"checkpoint path {path!r}: unknown kind {parts[1]!r}")
        return self.store / "runs" / parts[0] / parts[1] / parts[2]

    def save(self, trained: TrainedModel, kind: str, name: str, optimizer: bool) -> str:
        path = f"tinker://{trained.model_id}/{kind}/{name}"
        folder = self.folder(path)
        trained.save(folder, optimizer)
        meta = {"base_model": trained.base_model, "lora": trained.lora.as_json()}
        (folder / "meta.json").write_text(json.dumps(meta))
        return path

    def meta(self, path: str) -> dict[str, Any]:
        folder = self.folder(path)
        if not (folder / "meta.json").exists():
            raise RequestError(f"checkpoint {path!r} not found on this server")
        return json.loads((folder / "meta.json").read_text())

    def model_from(self, model_id: str, path: str, optimizer: bool) -> TrainedModel:
        """A new training client's model from a saved state (create-from-state)."""
        meta = self.meta(path)
        trained = self.create_model(model_id, meta["base_model"], LoraShape(**meta["lora"]))
        trained.load(self.folder(path), optimizer)
        return trained

    # ---- samplers -----------------------------------------------------------------------

    def sampler(self, sampler_id: str) -> Sampler:
        if sampler_id not in self.samplers:
            raise RequestError(
                f"unknown sampling session {sampler_id!r}: create one first "
                "(create_sampling_client or save_weights_and_get_sampling_client)"
            )
        return self.samplers[sampler_id]

    def snapshot_sampler(self, sampler_id: str, trained: TrainedModel, path: str | None):
        self.samplers[sampler_id] = Sampler(
            sampler_id=sampler_id,
            base_model=trained.base_model,
            model=trained.model,
            tokenizer=self.tokenizer(trained.base_model),
            snapshot=trained.trainable_state(),
            model_path=path,
        )
        return self.samplers[sampler_id]

    def new_sampler(self, sampler_id: str, base_model: str | None, path: str | None) -> Sampler:
        """A sampler of a saved sampler checkpoint, or of a base model."""
        if path:
            if path in self.snapshots:
                model_id, snapshot = self.snapshots[path]
                trained = self.models.get(model_id)
                if trained is not None:
                    sampler = self.snapshot_sampler(sampler_id, trained, path)
                    sampler.snapshot = snapshot
                    return sampler
            trained = self.model_from(f"{sampler_id}:weights", path, optimizer=False)
            self.models.pop(trained.model_id)
            return self.snapshot_sampler(sampler_id, trained, path)
        if not base_model:
            raise RequestError("create_sampling_session needs a model_path or a base_model")
        self.samplers[sampler_id] = Sampler(
            sampler_id=sampler_id,
            base_model=base_model,
            model=self.base_sampler_model(base_model),
            tokenizer=self.tokenizer(base_model),
        )
        return self.samplers[sampler_id]


def _raise_or(answer: bytes | Exception) -> bytes:
    if isinstance(answer, Exception):
        raise answer
    return answer
