"""The vLLM server process of the `vllm` engine: started from its own environment (or
attached to by URL), waited for, spoken to over HTTP, and stopped.

vLLM has dependencies (its own torch and transformers) that cannot share looprl's
environment, so it runs as a separate process from `.venv-vllm` (`make setup-vllm`),
which is also how it moves to its own GPU or node. Only the standard library speaks to
it: JSON over HTTP on the OpenAI-compatible routes plus vLLM's runtime LoRA and
dev-mode routes (`VLLM_SERVER_DEV_MODE`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looprl import children
from looprl.errors import EngineError

SERVED_NAME = "looprl"  # the base model's name on the server
INSTALL = "make setup-vllm"
WORKER_DIR = Path(__file__).parent / "vllm_worker"  # `looprl_vllm_worker`, server side


@dataclass
class LaunchSpec:
    """How to start a server: its Python, the saved model folder and `vllm serve` flags."""

    python: str
    model_dir: Path
    dtype: str  # "float32", "bfloat16", "float16"
    max_model_len: int
    lora_rank: int | None = None  # enable runtime LoRA adapters up to this rank
    eager: bool = True
    kv_cache_gb: float | None = None
    extra_args: list[str] = field(default_factory=list)
    timeout_s: float = 900.0


def check_installed(python: str) -> None:
    """The vLLM environment exists and has vllm, or a clear error naming the install."""
    if not Path(python).is_file():
        raise EngineError(
            f"rollout.engine=vllm needs vLLM's own environment, and {python} does not exist; "
            f"install it with `{INSTALL}` (or set rollout.vllm_python, or attach to a running "
            "server with rollout.vllm_url)"
        )
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([python, "-c", probe], capture_output=True).returncode != 0:
        raise EngineError(f"{python} has no vllm package; install it with `{INSTALL}`")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VLLMServer:
    """A vLLM server at `url`; `process` is set when looprl started it (and stops it)."""

    def __init__(
        self, url: str, process: subprocess.Popen | None = None, log: Path | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.process = process
        self.log = log

    @classmethod
    def start(cls, spec: LaunchSpec, workdir: Path) -> VLLMServer:
        """Start `vllm serve` on a free local port and wait until it answers."""
        check_installed(spec.python)
        port = _free_port()
        args = [
            spec.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(spec.model_dir), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", spec.dtype,
            "--max-model-len", str(spec.max_model_len), "--enable-prefix-caching",
            # sampled tokens' logprobs after temperature (forced calls are rescored)
            "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", "looprl_vllm_worker.WeightSync",
            # a per-request seed rewinds its generator when a prefill is split over
            # steps, which CPU generators cannot do: prompts are never split
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(spec.max_model_len),
        ]  # fmt: skip
        if spec.eager:
            args.append("--enforce-eager")
        if spec.lora_rank is not None:
            args += ["--enable-lora", "--max-lora-rank", str(_lora_rank_option(spec.lora_rank))]
        if spec.kv_cache_gb is not None:
            args += ["--kv-cache-memory-bytes", str(int(spec.kv_cache_gb * 2**30))]
        args += spec.extra_args
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(WORKER_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        env.pop("VIRTUAL_ENV", None)
        log = workdir / "vllm-server.log"
        process = children.start(args, log, merge_stdout=True, env=env, start_new_session=True)
        server = cls(f"http://127.0.0.1:{port}", process, log)
        atexit.register(server.close)  # a server looprl started never outlives it
        server.wait_ready(spec.timeout_s)
        return server

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise EngineError(
                    f"the vLLM server exited while starting (code {self.process.returncode}):"
                    f"\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.close()
        raise EngineError(
            f"the vLLM server did not answer within {timeout_s:.0f} s "
            f"(rollout.vllm_start_timeout_s):\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 12) -> str:
        """The server log's last error lines (or last lines), for an error message."""
        if self.log is None or not self.log.is_file():
            return f"(no log: the server at {self.url} was started elsewhere)"
        chosen = children.log_lines(self.log, lines, prefer=_is_error_line)
        return "\n".join(chosen) + f"\n(whole log: {self.log})"

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 3600.0) -> Any:
        """POST JSON, return the decoded reply; a dead server is an `EngineError`."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                data = reply.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            if err.code >= 500 or not self.alive():
                raise self.gone(f"HTTP {err.code} on {path}: {detail}") from None
            raise EngineError(
                f"the vLLM server refused {path}: HTTP {err.code}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError) as err:
            raise self.gone(f"{path}: {err}") from None
        try:
            return json.loads(data) if data else None
        except json.JSONDecodeError:  # some routes answer plain text ("Success: ...")
            return data.decode(errors="replace")

    def gone(self, what: str) -> EngineError:
        state = "" if self.alive() else f" (exit code {self.process.returncode})"  # type: ignore[union-attr]
        return EngineError(f"the vLLM server stopped answering{state}: {what}\n{self.log_tail()}")

    def close(self) -> None:
        children.stop(self.process, grace_s=30)
        self.process = None if self.process is None else self.process


def _is_error_line(line: str) -> bool:
    return "Error" in line and "ulimit" not in line


def _lora_rank_option(rank: int) -> int:
    """vLLM accepts only some maximum ranks: the smallest that holds `rank`."""
    for option in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= option:
            return option
    return rank
