"""`looprl serve-tinker`: the routes of Tinker's API (`/api/v1/...`) as the official SDK
(tinker 0.38.0) calls them. Routes that touch a model answer with a future's request id at
once; the client polls `/retrieve_future`, which answers as soon as the result is ready
(or `try_again` before the SDK's 45 s poll timeout). A request the server cannot serve is
answered as one error: in a future, `{"error", "category": "user"}`, which the SDK raises
as `RequestFailedError`; on a direct route, HTTP 400 with the same message."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from looprl.errors import ModelError, RequestError
from looprl.tinker.service import Service
from looprl.tinker.training import LoraShape
from looprl.tinker.wire import (
    PROTO_CONTENT_TYPE,
    decode_forward_backward,
    encode_forward_backward_output,
)

# how long one poll of /retrieve_future waits for its result (the SDK's poll times out at 45)
POLL_WAIT_S = 20.0


def build_app(service: Service) -> Any:
    app = FastAPI(title="looprl Tinker server")
    api = "/api/v1"

    @app.exception_handler(RequestError)
    @app.exception_handler(ModelError)
    async def refused(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse({"error": str(err), "category": "user"}, status_code=400)

    @app.exception_handler(KeyError)
    async def missing(_: Request, err: KeyError) -> JSONResponse:
        message = f"the request lacks the field {err}"
        return JSONResponse({"error": message, "category": "user"}, status_code=400)

    async def on_worker(work) -> Any:
        return await asyncio.wrap_future(service.call(work))

    # ---- client, sessions ---------------------------------------------------------------

    @app.post(f"{api}/client/config")
    async def client_config() -> dict:
        # chunks of a large batch arrive one after another, in seq_id order
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False}

    @app.post(f"{api}/client/dynamic_config")
    async def dynamic_config() -> dict:
        return {}

    @app.get(f"{api}/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post(f"{api}/create_session")
    async def create_session(request: Request) -> dict:
        body = await request.json()
        session_id = f"session-{len(service.sessions) + 1}-{int(time.time())}"
        service.sessions[session_id] = {"tags": body.get("tags"), "started": time.time()}
        return {"type": "create_session", "session_id": session_id}

    @app.post(f"{api}/session_heartbeat")
    async def heartbeat() -> dict:
        return {"type": "session_heartbeat"}

    @app.post(f"{api}/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    @app.post(f"{api}/sessions/{{session_id}}/finish")
    async def finish(session_id: str) -> dict:
        service.sessions.pop(session_id, None)
        await on_worker(lambda: service.forget(session_id))
        return {}

    @app.get(f"{api}/get_server_capabilities")
    async def capabilities() -> dict:
        served = [{"model_name": n, "trainable": True, "sampleable": True} for n in service.served]
        return {"supported_models": served}

    # ---- training -----------------------------------------------------------------------

    @app.post(f"{api}/create_model")
    async def create_model(request: Request) -> dict:
        body = await request.json()
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
        asked = body.get("lora_config") or {"rank": 32}
        lora = LoraShape(**{k: v for k, v in asked.items() if k in LoraShape.__dataclass_fields__})
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        base_model = body["base_model"]

        def work() -> dict:
            if optimizer != "adamw":
                raise RequestError(f"optimizer {optimizer!r} is not served; use adamw")
            service.create_model(model_id, base_model, lora)
            return {"model_id": model_id}

        return {"request_id": service.submit(work), "model_id": model_id}

    @app.post(f"{api}/get_info")
    async def get_info(request: Request) -> dict:
        body = await request.json()
        trained = service.model(body["model_id"])
        arch = type(trained.model.get_base_model()).__name__
        tokenizer_id = await on_worker(lambda: service.tokenizer_id(trained.base_model))
        return {
            "type": "get_info",
            "model_id": trained.model_id,
            "model_data": {
                "model_name": trained.base_model,
                "tokenizer_id": tokenizer_id,
                "arch": arch,
            },
            "is_lora": True,
            "lora_rank": trained.lora.rank,
            "model_name": trained.base_model,
        }

    @app.post(f"{api}/forward_backward")
    async def forward_backward(request: Request) -> dict:
        body = await request.body()
        try:
            decoded = decode_forward_backward(body, request.headers.get("content-encoding"))
        except RequestError as err:  # said through the future, as every refusal is
            message = str(err)

            def refuse() -> bytes:
                raise RequestError(message)

            return {"request_id": service.submit(refuse)}

        def work() -> bytes:
            if decoded.refusal is not None:
                raise RequestError(decoded.refusal)
            logprobs, metrics = service.model(decoded.model_id).forward_backward(decoded)
            return encode_forward_backward_output(logprobs, metrics)

        request_id = service.submit(work, decoded.model_id, decoded.seq_id)
        return {"request_id": request_id, "model_id": decoded.model_id}

    @app.post(f"{api}/optim_step")
    async def optim_step(request: Request) -> dict:
        body = await request.json()
        model_id = body["model_id"]
        params = body.get("adam_params") or body.get("optim_params")
        if params is None:
            params = {"type": (body.get("optimizer_params") or {}).get("type", "?")}

        def work() -> dict:
            if "type" in params:
                raise RequestError(f"optimizer {params['type']!r} is not served; use adam_params")
            return {"metrics": service.model(model_id).optim_step(params)}

        return {"request_id": service.submit(work, model_id, body.get("seq_id") or 0)}

    @app.post(f"{api}/save_weights")
    async def save_weights(request: Request) -> dict:
        body = await request.json()
        model_id, name = body["model_id"], body.get("path") or f"state-{int(time.time())}"

        def work() -> dict:
            trained = service.model(model_id)
            return {"path": service.save(trained, "weights", name, optimizer=True)}

        return {"request_id": service.submit(work, model_id, body.get("seq_id") or 0)}

    @app.post(f"{api}/load_weights")
    async def load_weights(request: Request) -> dict:
        body = await request.json()
        path, optimizer = body["path"], bool(body.get("optimizer"))
        if body.get("model_id"):
            model_id = body["model_id"]

            def work() -> dict:
                service.model(model_id).load(service.folder(path), optimizer)
                return {"path": path, "model_id": model_id}

            seq = body.get("seq_id") or 0
            return {"request_id": service.submit(work, model_id, seq), "model_id": model_id}
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"

        def create() -> dict:
            service.model_from(model_id, path, optimizer)
            return {"path": path, "model_id": model_id}

        return {"request_id": service.submit(create), "model_id": model_id}

    @app.post(f"{api}/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        body = await request.json()
        model_id, name = body["model_id"], body.get("path")
        sampler_seq = body.get("sampling_session_seq_id")

        def work() -> dict:
            trained = service.model(model_id)
            if name:
                path = service.save(trained, "sampler_weights", name, optimizer=False)
                service.snapshots[path] = (model_id, trained.trainable_state())
                return {"path": path}
            sampler_id = f"{model_id}:sampler:{sampler_seq}"
            service.snapshot_sampler(sampler_id, trained, None)
            return {"sampling_session_id": sampler_id}

        return {"request_id": service.submit(work, model_id, body.get("seq_id") or 0)}

    # ---- sampling -----------------------------------------------------------------------

    @app.post(f"{api}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        body = await request.json()
        sampler_id = f"{body['session_id']}:sample:{body['sampling_session_seq_id']}"
        path, base = body.get("model_path"), body.get("base_model")
        await on_worker(lambda: service.new_sampler(sampler_id, base, path))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get(f"{api}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str) -> dict:
        sampler = service.sampler(sampler_id)
        return {
            "sampler_id": sampler_id,
            "base_model": sampler.base_model,
            "model_path": sampler.model_path,
        }

    @app.post(f"{api}/asample")
    async def asample(request: Request) -> dict:
        body = await request.json()
        n = int(body.get("num_samples", 1))

        request_id = service.submit_sample(body)
        return {
            "request_id": request_id,
            "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)],
        }

    # ---- futures ------------------------------------------------------------------------

    @app.post(f"{api}/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        body = await request.json()
        request_id = body["request_id"]
        future = service.results.get(request_id)
        if future is None:
            return JSONResponse({"error": f"unknown request_id {request_id!r}", "category": "user"})
        # asyncio.wait, not wait_for: a poll that times out must not cancel the work
        done, _ = await asyncio.wait([asyncio.wrap_future(future)], timeout=POLL_WAIT_S)
        if not done:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        result = future.result()
        if result.error is not None:
            return {"error": result.error, "category": result.category}
        if isinstance(result.body, bytes):
            return Response(content=result.body, media_type=PROTO_CONTENT_TYPE)
        return result.body

    # ---- training runs (the cookbook's resume and checkpoint cleanup) -------------------

    @app.get(f"{api}/training_runs/{{run_id}}")
    async def training_run(run_id: str) -> dict:
        trained = service.model(run_id)

        def stamp(t: float) -> str:
            return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()

        return {
            "training_run_id": run_id,
            "base_model": trained.base_model,
            "model_owner": "local",
            "is_lora": True,
            "lora_rank": trained.lora.rank,
            "last_request_time": stamp(service.runs.get(run_id, time.time())),
        }

    @app.delete(f"{api}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str) -> dict:
        import shutil

        folder = service.folder(f"tinker://{run_id}/{checkpoint_id}")
        shutil.rmtree(folder, ignore_errors=True)
        service.snapshots.pop(f"tinker://{run_id}/{checkpoint_id}", None)
        return {}

    return app


def run_tinker_server(
    store: Path, served: list[str], host: str, port: int, dtype: str = "float32"
) -> None:
    import uvicorn

    service = Service(store, getattr(torch, dtype), served)
    uvicorn.run(build_app(service), host=host, port=port, log_level="warning")
